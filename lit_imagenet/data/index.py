"""The samples of a split as numpy arrays, and the index file that later runs read instead of walking the folders.

Forked loader workers share a ``SampleTable``'s arrays without copies (reference counts would copy a list of tuples).
The index keeps each scanned folder's modification time: an entry added, removed or renamed means a rescan.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import sys
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

#: The layout of the index file; an index of another layout is scanned again.
INDEX_VERSION = 1
_MAGIC = b"LITIMGIX"
# A folder modified this close to its scan may change again with the same time (times in steps of up to 2 s).
_RACE_NS = 2_000_000_000


class SampleTable(Sequence[tuple[str, int]]):
    """A split's ``(path, label)`` samples in numpy arrays: a ``Sequence`` of pairs that workers share without copies.

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
        self._ascii: str | None = None  # the names as one string, if they are ASCII

    @classmethod
    def from_pairs(cls, root: str | os.PathLike[str], pairs: Iterable[tuple[str, int]]) -> SampleTable:
        """A table of ``(path, label)`` pairs, each path under ``root`` or relative to it; ``root`` ``""``: as given."""
        root = os.fspath(root)
        encoded, labels = [], []
        for path, label in pairs:
            path = os.fspath(path)
            encoded.append(os.fsencode(os.path.relpath(path, root) if root and os.path.isabs(path) else path))
            labels.append(int(label))
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        names = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return cls(root, names, offsets, np.asarray(labels, dtype=np.int32))

    def __len__(self) -> int:
        return len(self.labels)

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, index: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} of {len(self)}")
        return self.path(index), int(self.labels[index])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return (self[i] for i in range(len(self)))

    @staticmethod
    def of(samples: Sequence[tuple[str, int]]) -> SampleTable:
        """``samples`` as a table: itself if it is one, else its pairs with their paths as given."""
        return samples if isinstance(samples, SampleTable) else SampleTable.from_pairs("", samples)

    def relative(self, index: int) -> str:
        """Sample ``index``'s path relative to ``root``."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return os.fsdecode(self.names[start:end].tobytes())

    def path(self, index: int) -> str:
        """Sample ``index``'s path."""
        return os.path.join(self.root, self.relative(index)) if self.root else self.relative(index)

    def paths(self, indices: Iterable[int] | np.ndarray) -> list[str]:
        """The paths of the samples ``indices``, in their order."""
        where = np.fromiter(indices, dtype=np.int64) if not isinstance(indices, np.ndarray) else indices
        starts, ends = self.offsets[where].tolist(), self.offsets[where + 1].tolist()
        prefix = os.path.join(self.root, "") if self.root else ""
        if self._ascii is None:
            self._ascii = self.names.tobytes().decode("ascii") if not (self.names >= 128).any() else ""
        if self._ascii:  # byte offsets are character offsets
            text = self._ascii
            return [prefix + text[a:b] for a, b in zip(starts, ends)]
        blob = self.names.tobytes()
        return [prefix + os.fsdecode(blob[a:b]) for a, b in zip(starts, ends)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SampleTable):
            return NotImplemented
        return (
            self.root == other.root
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.names, other.names)
            and np.array_equal(self.labels, other.labels)
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r}, {len(self)} samples)"


@dataclass
class Scan:
    """A scanned split: class names, samples, each folder's ``st_mtime_ns`` (``"."``: the split) and its start time."""

    classes: list[str]
    samples: SampleTable
    folders: dict[str, int]
    started_ns: int

    def racy(self) -> bool:
        """Whether a folder was modified so close to the scan that a later change might not move its time."""
        return any(mtime >= self.started_ns - _RACE_NS for mtime in self.folders.values())


def default_index_dir() -> Path:
    """``$LIT_IMAGENET_CACHE/index``, else ``lit_imagenet/index`` in ``$XDG_CACHE_HOME`` or ``~/.cache``."""
    if os.environ.get("LIT_IMAGENET_CACHE"):
        return Path(os.environ["LIT_IMAGENET_CACHE"]) / "index"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "lit_imagenet" / "index"


def index_path(index_dir: str | os.PathLike[str], split_dir: str | os.PathLike[str]) -> Path:
    """The index file of a split folder: named by a digest of the folder's real path, and the folder's name."""
    real = os.path.realpath(split_dir)
    digest = hashlib.sha256(os.fsencode(real)).hexdigest()[:20]
    return Path(index_dir) / f"{Path(real).name or 'root'}-{digest}.index"


def write_index(path: str | os.PathLike[str], scan: Scan) -> None:
    """Writes ``scan`` to the index file ``path``: a temporary file in its folder, fsynced, renamed over it."""
    path = Path(path)
    table = scan.samples
    arrays = [table.offsets.astype("<i8"), table.labels.astype("<i4"), table.names.astype(np.uint8)]
    payload = b"".join(a.tobytes() for a in arrays)
    header = {
        "version": INDEX_VERSION,
        "split": os.path.realpath(table.root),
        "classes": scan.classes,
        "folders": scan.folders,
        "samples": len(table),
        "name_bytes": int(table.names.size),
        "crc32": zlib.crc32(payload),
    }
    head = json.dumps(header, ensure_ascii=True).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # readable by the other users of a shared cache
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + len(head).to_bytes(8, "little") + head + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


class StaleIndex(Exception):
    """The index file is missing, of another layout, or its split's folders changed since it was written."""


class CorruptIndex(Exception):
    """The index file cannot be read as one: truncated, damaged, or not an index."""


def read_index(path: str | os.PathLike[str], split_dir: str | os.PathLike[str]) -> Scan:
    """The scan kept in the index file ``path``, if it is whole and the folders of ``split_dir`` are as it saw them.

    Raises:
        StaleIndex: There is no such file, it is of another layout or another folder, or a folder changed.
        CorruptIndex: The file is damaged.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        raise StaleIndex("no index yet") from None
    if data[: len(_MAGIC)] != _MAGIC or len(data) < len(_MAGIC) + 8:
        raise CorruptIndex("not an index file")
    start = len(_MAGIC) + 8
    size = int.from_bytes(data[len(_MAGIC) : start], "little")
    try:
        header = json.loads(data[start : start + size])
        if header.get("version") != INDEX_VERSION:
            raise StaleIndex(f"an index of layout {header.get('version')}")
        count, name_bytes = int(header["samples"]), int(header["name_bytes"])
        payload = memoryview(data)[start + size :]
        if len(payload) != 8 * (count + 1) + 4 * count + name_bytes or zlib.crc32(payload) != header["crc32"]:
            raise CorruptIndex("its contents do not match its checksum")
        classes, folders = list(header["classes"]), {str(k): int(v) for k, v in header["folders"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptIndex(f"its header cannot be read ({type(err).__name__})") from None
    if header.get("split") != os.path.realpath(split_dir):
        raise StaleIndex(f"an index of {header.get('split')}")
    for folder, mtime in folders.items():
        try:
            if os.stat(os.path.join(split_dir, folder)).st_mtime_ns != mtime:
                raise StaleIndex(f"{folder} changed")
        except OSError:
            raise StaleIndex(f"{folder} is gone") from None
    offsets = np.frombuffer(payload, dtype="<i8", count=count + 1).astype(np.int64)
    labels = np.frombuffer(payload, dtype="<i4", count=count, offset=8 * (count + 1)).astype(np.int32)
    names = np.frombuffer(payload, dtype=np.uint8, offset=12 * count + 8).copy()
    return Scan(classes, SampleTable(split_dir, names, offsets, labels), folders, started_ns=0)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds an exclusive lock on ``path`` (created if need be), where the file system has locks; else none."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "ab")  # noqa: SIM115  (held until the end of the block)
    except OSError:  # an unwritable folder: writing the index fails too, with a warning
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as err:  # a file system without locks: go on without
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
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
        damaged = None
        try:
            return read_index(path, split_dir)
        except StaleIndex:
            pass
        except (CorruptIndex, OSError) as err:
            damaged = err
        found = scan(split_dir)
        if found.racy():
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
