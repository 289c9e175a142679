"""Errors that are the user's to fix: the command line prints their one sentence, without a traceback."""


class UserError(ValueError):
    """A problem with the user's input; the message names the file or value and says what to do."""


class DataError(UserError):
    """A problem with the user's data: a missing or malformed folder, or a file that cannot be read."""


class ConfigError(UserError):
    """A combination of settings that cannot run, found before training starts."""
