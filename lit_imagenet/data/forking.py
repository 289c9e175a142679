"""Processes forked by the data path (loader workers, the folder scan) never collect the parent's garbage.

A forked child starts with a copy of every object of its parent, garbage cycles not yet collected
included. When the child's collector frees such a cycle, the destructors of its objects run in a
process where their threads and handles do not exist: a DALI pipeline freed there ends the worker
with a segmentation fault. So a child forked within ``forks_skip_parent_garbage`` freezes what it
inherited (``gc.freeze()``) as its first step, before any collection can run in it: its collector
sees only the objects it makes itself, and it leaves the pages it shares with the parent unwritten
(the pattern of Python's ``gc`` documentation for forking servers). The parent's own collection is
not touched.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_forking = 0  # how many threads are within forks_skip_parent_garbage; a child inherits the count


def _freeze_inherited_objects() -> None:
    if _forking:
        gc.freeze()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_freeze_inherited_objects)


@contextmanager
def forks_skip_parent_garbage() -> Iterator[None]:
    """Within it, a process forked (by a ``DataLoader``'s workers, a process pool) freezes the objects it inherits."""
    global _forking
    with _lock:
        _forking += 1
    try:
        yield
    finally:
        with _lock:
            _forking -= 1
