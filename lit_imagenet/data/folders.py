"""The ImageFolder layout: the class folders of a split, their images, and the checks made before training.

``root`` holds ``train/`` and ``val/`` (and optionally ``test/``), each with one folder of images
per class. The folders are scanned when the data module is built, so a missing split, an empty
class folder, an empty file or one that is not an image, or train and val splits with different
classes stop the run before any training starts, with a ``DataError`` naming the thing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from lit_imagenet.errors import DataError, undecodable_image

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def image_files(folder: Path) -> list[Path]:
    """Every image under ``folder``, sorted; an empty file or a non-image is an error (hidden files are not data)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not _is_hidden(d))
        for name in sorted(filenames):
            if _is_hidden(name):
                continue
            path = Path(dirpath) / name
            if path.suffix.lower() not in IMAGE_EXTENSIONS:
                raise DataError(
                    f"{path} is not an image file (expected one of {', '.join(IMAGE_EXTENSIONS)}); "
                    "move it out of the data folder."
                )
            try:
                size = path.stat().st_size
            except OSError as err:  # a broken link
                raise undecodable_image(path, f"{type(err).__name__}: {err.strerror}") from None
            if size == 0:
                raise undecodable_image(path, "an empty file: 0 bytes")
            found.append(path)
    return found


def scan_split(split_dir: str | Path) -> tuple[list[str], list[tuple[str, int]]]:
    """The class names of an ImageFolder split and its ``(path, class index)`` samples.

    Raises:
        DataError: The folder is missing, has no class folders, or a class folder holds no image,
            a file that is not an image, or an empty file.
    """
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DataError(f"Data folder {split_dir} does not exist; create it with one sub-folder of images per class.")
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not _is_hidden(e.name))
    if not classes:
        raise DataError(f"{split_dir} has no class folders; put the images of each class in a sub-folder of it.")
    samples: list[tuple[str, int]] = []
    for index, name in enumerate(classes):
        files = image_files(split_dir / name)
        if not files:
            raise DataError(f"Class folder {split_dir / name} holds no images; add images or remove the folder.")
        samples.extend((str(p), index) for p in files)
    return classes, samples


def check_same_classes(train_dir: Path, train: Sequence[str], other_dir: Path, other: Sequence[str]) -> None:
    """Refuses two splits whose class folders differ: their label indices would not match."""
    if list(train) == list(other):
        return
    only_train = sorted(set(train) - set(other))
    only_other = sorted(set(other) - set(train))
    parts = []
    if only_train:
        parts.append(f"only in {train_dir}: {', '.join(only_train[:10])}{' ...' if len(only_train) > 10 else ''}")
    if only_other:
        parts.append(f"only in {other_dir}: {', '.join(only_other[:10])}{' ...' if len(only_other) > 10 else ''}")
    raise DataError(
        f"{train_dir} and {other_dir} have different class folders ({'; '.join(parts)}); "
        "both splits need the same class folders."
    )


def scan_root(root: Path) -> tuple[list[str], dict[str, list[tuple[str, int]]]]:
    """The classes of ``root/train`` and the samples of each split: ``train``, ``val`` and ``test`` when present.

    Raises:
        DataError: ``root`` or a split is missing or malformed, or the splits' class folders differ.
    """
    if not root.is_dir():
        raise DataError(f"Data root {root} does not exist; point --data.root at a folder with train/ and val/.")
    splits: dict[str, list[tuple[str, int]]] = {}
    classes, splits["train"] = scan_split(root / "train")
    for split in ("val", "test"):
        if split == "test" and not (root / split).is_dir():
            continue
        other, samples = scan_split(root / split)
        check_same_classes(root / "train", classes, root / split, other)
        splits[split] = samples
    return classes, splits


def scan_predict(folder: Path) -> list[tuple[str, int]]:
    """The images under ``folder`` (searched recursively), each with its position as its label, for prediction.

    Raises:
        DataError: The folder is missing or holds no image, or holds a file that is not an image or is empty.
    """
    if not folder.is_dir():
        raise DataError(f"Prediction folder {folder} does not exist.")
    files = image_files(folder)
    if not files:
        raise DataError(f"Prediction folder {folder} holds no images.")
    return [(str(p), i) for i, p in enumerate(files)]
