"""Processes forked by the data path never collect the parent's garbage: a DALI pipeline freed by a worker's
collector would end the worker with a segmentation fault."""

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
