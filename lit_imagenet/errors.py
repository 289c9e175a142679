"""Errors that are the user's to fix: the command line prints their one sentence, without a traceback."""

from __future__ import annotations

import os


class UserError(ValueError):
    """A problem with the user's input; the message names the file or value and says what to do."""


class DataError(UserError):
    """A problem with the user's data: a missing or malformed folder, or a file that cannot be read."""


class ConfigError(UserError):
    """A combination of settings that cannot run, found before training starts."""


def undecodable_image(path: str | os.PathLike[str], reason: str) -> DataError:
    """The error for an unusable image, whoever finds it: missing, a broken link, or undecodable for ``reason``."""
    if not os.path.lexists(path):
        return DataError(
            f"Image {path} is missing: its folder changed after it was scanned; run again, which scans it anew."
        )
    if not os.path.exists(path):
        return DataError(f"Image {path} is a broken link; replace or remove it.")
    return DataError(f"Cannot decode image {path} ({reason}); replace or remove the file.")
