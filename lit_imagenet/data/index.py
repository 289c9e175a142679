"""The samples of a split as numpy arrays, and the index file that later runs read instead of walking the folders.

The index keeps each scanned folder's modification time: an entry added, removed or renamed means a rescan.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

#: The layout of the index file, part of its name: an index of another layout is not read.
INDEX_VERSION = 2
# A folder modified this close to its scan may change again with the same time (times in steps of up to 2 s).
_RACE_NS = 2_000_000_000


class SampleTable(Sequence[tuple[str, int]]):
    """A split's ``(path, label)`` samples in numpy arrays: a ``Sequence`` of pairs that forked workers share without
    copies (reference counts would copy a list of tuples).

    Args:
        root: The folder the relative paths start from (the split's folder).
        names: uint8, the relative paths' bytes (``os.fsencode``) one after the other.
        offsets: int64 ``(N + 1,)``: path ``i`` is ``names[offsets[i]:offsets[i + 1]]``.
        labels: int32 ``(N,)`` class indices.
    """

    def __init__(self, root: str | os.PathLike[str], names: np.ndarray, offsets: np.ndarray, labels: np.ndarray):
        if len(offsets) != len(labels) + 1:
            raise ValueError(f"Need one more offset than labels. Got {len(offsets)} offsets for {len(labels)} labels")
        self.root = os.fspath(root)
        self.names = names
        self.offsets = offsets
        self.labels = labels
        self._blob: bytes | None = None  # the names as bytes, for ``paths``: slicing bytes beats slicing the array

    @classmethod
    def from_names(cls, root: str | os.PathLike[str], names: Sequence[bytes], labels: Iterable[int]) -> SampleTable:
        """A table of paths relative to ``root``, each as ``os.fsencode`` gives it, and their labels."""
        offsets = np.zeros(len(names) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, names), dtype=np.int64, count=len(names)), out=offsets[1:])
        blob = np.frombuffer(b"".join(names), dtype=np.uint8).copy()
        return cls(root, blob, offsets, np.fromiter(labels, dtype=np.int32, count=len(names)))

    @classmethod
    def from_pairs(cls, root: str | os.PathLike[str], pairs: Iterable[tuple[str, int]]) -> SampleTable:
        """A table of ``(path, label)`` pairs, each path under ``root`` or relative to it; ``root`` ``""``: as given."""
        root, pairs = os.fspath(root), [(os.fspath(path), int(label)) for path, label in pairs]
        relative = [os.path.relpath(path, root) if root and os.path.isabs(path) else path for path, _ in pairs]
        return cls.from_names(root, [os.fsencode(path) for path in relative], (label for _, label in pairs))

    def __len__(self) -> int:
        return len(self.labels)

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, index: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        index = range(len(self))[index]  # negative from the end; IndexError out of range
        return self.path(index), int(self.labels[index])

    @staticmethod
    def of(samples: Sequence[tuple[str, int]]) -> SampleTable:
        """``samples`` as a table: itself if it is one, else its pairs with their paths as given."""
        return samples if isinstance(samples, SampleTable) else SampleTable.from_pairs("", samples)

    def path(self, index: int) -> str:
        """Sample ``index``'s path."""
        relative = os.fsdecode(self.names[self.offsets[index] : self.offsets[index + 1]].tobytes())
        return os.path.join(self.root, relative) if self.root else relative

    def paths(self, indices: Iterable[int] | np.ndarray) -> list[str]:
        """The paths of the samples ``indices``, in their order."""
        where = np.fromiter(indices, dtype=np.int64) if not isinstance(indices, np.ndarray) else indices
        starts, ends = self.offsets[where].tolist(), self.offsets[where + 1].tolist()
        prefix = os.path.join(self.root, "") if self.root else ""
        self._blob = self.names.tobytes() if self._blob is None else self._blob
        return [prefix + os.fsdecode(self._blob[a:b]) for a, b in zip(starts, ends)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleTable):
            return NotImplemented
        arrays = ("offsets", "names", "labels")
        return self.root == other.root and all(np.array_equal(getattr(self, a), getattr(other, a)) for a in arrays)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r}, {len(self)} samples)"


@dataclass
class Scan:
    """A scanned split: class names, samples and each folder's ``st_mtime_ns`` (``"."``: the split)."""

    classes: list[str]
    samples: SampleTable
    folders: dict[str, int]


def default_index_dir() -> Path:
    """``$LIT_IMAGENET_CACHE/index``, else ``lit_imagenet/index`` in ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    if os.environ.get("LIT_IMAGENET_CACHE"):
        return Path(os.environ["LIT_IMAGENET_CACHE"]) / "index"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lit_imagenet" / "index"


def index_path(index_dir: str | os.PathLike[str], split_dir: str | os.PathLike[str]) -> Path:
    """The index file of a split folder: named by the folder's name, a digest of its real path and the layout."""
    real = os.path.realpath(split_dir)
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:20]
    return Path(index_dir) / f"{Path(real).name or 'root'}-{digest}-v{INDEX_VERSION}.index"


def write_index(path: str | os.PathLike[str], scan: Scan) -> None:
    """Writes ``scan`` to the index file ``path`` (numpy's ``.npz``): a temporary file, fsynced, renamed over it."""
    path, table = Path(path), scan.samples
    header = {"split": os.path.realpath(table.root), "classes": scan.classes, "folders": scan.folders}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # readable by the other users of a shared cache
        with os.fdopen(fd, "wb") as f:
            arrays = {"names": table.names, "offsets": table.offsets, "labels": table.labels}
            np.savez(f, header=np.array(json.dumps(header)), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class StaleIndex(Exception):
    """The index file is missing, of another folder, or its split's folders changed since it was written."""


class CorruptIndex(Exception):
    """The index file cannot be read as one: truncated, damaged, or not an index."""


def read_index(path: str | os.PathLike[str], split_dir: str | os.PathLike[str]) -> Scan:
    """The scan kept in the index file ``path``, if it is whole and the folders of ``split_dir`` are as it saw them.

    Raises:
        StaleIndex: There is no such file, it is of another folder, or a folder changed.
        CorruptIndex: The file is damaged (the ``.npz``'s checksums tell).
    """
    try:
        with np.load(path) as index:
            header = json.loads(index["header"].item())
            split, classes, folders = header["split"], list(header["classes"]), dict(header["folders"])
            table = SampleTable(split_dir, index["names"], index["offsets"], index["labels"])
    except (FileNotFoundError, NotADirectoryError):
        raise StaleIndex("no index yet") from None
    except (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, zipfile.BadZipFile) as err:
        raise CorruptIndex(f"it cannot be read as an index ({type(err).__name__})") from None
    if split != os.path.realpath(split_dir):
        raise StaleIndex(f"an index of {split}")
    for folder, mtime in folders.items():
        try:
            if os.stat(os.path.join(split_dir, folder)).st_mtime_ns != mtime:
                raise StaleIndex(f"{folder} changed")
        except OSError:
            raise StaleIndex(f"{folder} is gone") from None
    return Scan(classes, table, folders)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (created if need be), where the file system has locks; else none."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "ab")  # noqa: SIM115  (held until the end of the block)
    except OSError:  # an unwritable folder: writing the index fails too, with a warning
        yield
        return
    with f:
        with contextlib.suppress(OSError):  # a file system without locks: go on without
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


_warned_unwritable: set[Path] = set()


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def cached_scan(split_dir: Path, index_dir: Path | None, scan: Callable[[Path], Scan]) -> Scan:
    """``scan(split_dir)``, or the index of an earlier scan in ``index_dir`` when the folders did not change.

    Under a lock, so that one process scans and the others read its file. ``index_dir`` ``None`` scans every time.
    """
    if index_dir is None:
        return scan(split_dir)
    path = index_path(index_dir, split_dir)
    with _locked(path.with_name(path.name + ".lock")):
        try:
            return read_index(path, split_dir)
        except (StaleIndex, CorruptIndex) as err:
            damaged = err if isinstance(err, CorruptIndex) else None
        started = time.time_ns()
        found = scan(split_dir)
        if any(mtime >= started - _RACE_NS for mtime in found.folders.values()):
            return found  # a folder is being changed now: the next run scans again
        try:
            write_index(path, found)
        except OSError as err:
            if Path(index_dir) not in _warned_unwritable:
                _warned_unwritable.add(Path(index_dir))
                _warn(f"cannot write the index of {split_dir} to {path} ({err.strerror or err}); "
                      "set --data.index_dir to a writable folder, or --data.index false.")  # fmt: skip
            return found
        if damaged is not None:
            _warn(
                f"the index {path} of {split_dir} could not be read ({damaged}); scanned the folder and wrote it anew."
            )
        return found
