"""The ImageFolder layout: the class folders of a split, their images, and the checks made before training.

Every bad layout stops the run before training with a ``DataError`` naming the thing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lit_imagenet.data.index import SampleTable, Scan, cached_scan
from lit_imagenet.errors import DataError, undecodable_image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _walk(folder: str, relative: str, names: list[bytes], folders: dict[str, int]) -> None:
    """Appends the non-hidden images under ``folder`` to ``names`` (sorted) and folder times to ``folders``."""
    folders[relative] = os.stat(folder).st_mtime_ns  # before listing: a change after it moves the time
    with os.scandir(folder) as scan:
        entries = sorted((e for e in scan if not e.name.startswith(".")), key=lambda e: e.name)
    for entry in (e for e in entries if not e.is_dir()):  # is_dir follows links, as the decoders' readers do
        path = entry.path
        if os.path.splitext(entry.name)[1].lower() not in IMAGE_EXTENSIONS:
            raise DataError(
                f"{path} is not an image file (expected one of {', '.join(IMAGE_EXTENSIONS)}); "
                "move it out of the data folder."
            )
        try:
            size = entry.stat().st_size
        except OSError as err:  # a broken link
            raise undecodable_image(path, f"{type(err).__name__}: {err.strerror}") from None
        if size == 0:
            raise undecodable_image(path, "an empty file: 0 bytes")
        names.append(os.fsencode(os.path.join(relative, entry.name)))
    for entry in (e for e in entries if e.is_dir()):
        _walk(entry.path, os.path.join(relative, entry.name), names, folders)


def scan_split(split_dir: str | Path) -> Scan:
    """The class names of an ImageFolder split, its samples and the times of its folders.

    Raises:
        DataError: The folder is missing, has no class folders, or a class folder holds no image,
            a file that is not an image, or an empty file (the first in the folders' order).
    """
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DataError(f"Data folder {split_dir} does not exist; create it with one sub-folder of images per class.")
    folders = {".": os.stat(split_dir).st_mtime_ns}
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"{split_dir} has no class folders; put the images of each class in a sub-folder of it.")
    names: list[bytes] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        _walk(os.path.join(split_dir, name), name, names, folders)
        if len(names) == len(labels):
            raise DataError(f"Class folder {split_dir / name} holds no images; add images or remove the folder.")
        labels += [label] * (len(names) - len(labels))
    return Scan(classes, SampleTable.from_names(split_dir, names, labels), folders)


def check_same_classes(train_dir: Path, train: Sequence[str], other_dir: Path, other: Sequence[str]) -> None:
    """Refuses two splits whose class folders differ: their label indices would not match."""
    if list(train) == list(other):
        return
    only = {train_dir: sorted(set(train) - set(other)), other_dir: sorted(set(other) - set(train))}
    parts = [f"only in {d}: {', '.join(names[:10])}{' ...' * (len(names) > 10)}" for d, names in only.items() if names]
    raise DataError(
        f"{train_dir} and {other_dir} have different class folders ({'; '.join(parts)}); "
        "both splits need the same class folders."
    )


def scan_root(root: Path, index_dir: Path | None = None) -> tuple[list[str], dict[str, SampleTable]]:
    """The classes of ``root/train`` and the samples of each split (``train``, ``val``, and ``test`` when present),
    read from the index files in ``index_dir`` where the folders did not change (``None``: scanned every time).

    Raises:
        DataError: ``root`` or a split is missing or malformed, or the splits' class folders differ.
    """
    if not root.is_dir():
        raise DataError(f"Data root {root} does not exist; point --data.root at a folder with train/ and val/.")
    train = cached_scan(root / "train", index_dir, scan_split)
    splits = {"train": train.samples}
    for split in ("val", "test") if (root / "test").is_dir() else ("val",):
        other = cached_scan(root / split, index_dir, scan_split)
        check_same_classes(root / "train", train.classes, root / split, other.classes)
        splits[split] = other.samples
    return train.classes, splits


def scan_predict(folder: Path) -> SampleTable:
    """The images under ``folder`` (searched recursively), each with its position as its label, for prediction.

    Raises:
        DataError: The folder is missing or holds no image, or holds a file that is not an image or is empty.
    """
    if not folder.is_dir():
        raise DataError(f"Prediction folder {folder} does not exist.")
    names: list[bytes] = []
    _walk(str(folder), "", names, {})
    if not names:
        raise DataError(f"Prediction folder {folder} holds no images.")
    return SampleTable.from_names(folder, names, range(len(names)))
