"""A stand-in for NVIDIA apex with just the ``amp`` calls the precision plugin makes, for CPU tests.

It records how it was called (``amp.calls``) so tests can check the order of operations that
Lightning and the plugin produce; real apex is exercised on a GPU machine.
"""

__version__ = "test-double"
