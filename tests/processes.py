"""Finding the processes of a run that Lightning started, to signal one rank of it."""

from __future__ import annotations

from pathlib import Path


def rank_pid(parent: int, rank: int) -> int:
    """The process of ``rank``: the child of rank 0 (``parent``) that Lightning started with ``LOCAL_RANK=rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"LOCAL_RANK={rank}".encode() in environ:
            return int(entry.name)
    raise AssertionError(f"no process of rank {rank} found among the children of {parent}")
