"""Decoding images on the CPU, a file's bytes, its header size. Every failure raises ``DataError`` naming the file."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchvision.io import ImageReadMode, decode_image, read_file

from lit_imagenet.data.forking import forks_skip_parent_garbage
from lit_imagenet.data.index import SampleTable
from lit_imagenet.errors import DataError, undecodable_image


def load_rgb(path: str) -> Image.Image:
    """Opens an image as 8-bit RGB (grayscale, palette, CMYK and alpha images included)."""
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            if img.mode == "P" and "transparency" in img.info:
                img = img.convert("RGBA")
            return img.convert("RGB")
    except Exception as err:  # PIL raises many types for bad files; all mean the same to the user
        raise undecodable_image(path, f"{type(err).__name__}: {err}") from None


def load_rgb_tensor(path: str) -> Tensor:
    """Decodes an image with ``torchvision.io`` into a uint8 ``(3, H, W)`` tensor (PIL for other formats)."""
    if Path(path).suffix.lower() not in (".jpg", ".jpeg", ".png", ".webp"):
        return torch.from_numpy(np.asarray(load_rgb(path), dtype=np.uint8).copy()).permute(2, 0, 1)
    return decode_rgb_bytes(read_bytes(path), path)


def verify_image_files(paths: Sequence[str], workers: int = 8) -> None:
    """Decodes every image once, in threads, and raises ``DataError`` for the first that fails."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for _ in pool.map(load_rgb, paths):  # each image dropped once decoded
            pass


def read_bytes(path: str) -> Tensor:
    """A file's bytes as a uint8 tensor."""
    try:
        return read_file(path)
    except Exception as err:
        raise undecodable_image(path, f"{type(err).__name__}: {err}") from None


def decode_rgb_bytes(data: Tensor, path: str) -> Tensor:
    """An encoded JPEG, PNG or WebP decoded on the CPU by ``torchvision.io``, as uint8 ``(3, H, W)`` RGB."""
    try:
        img = decode_image(data, mode=ImageReadMode.RGB)
    except Exception as err:  # torchvision raises RuntimeError or ValueError, by format
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else 'empty'}"
        raise undecodable_image(path, reason) from None
    if img.dtype != torch.uint8:  # 16-bit PNG
        img = (img.to(torch.int32) >> 8).to(torch.uint8)
    return img


def image_size(path: str, data: Tensor | None = None) -> tuple[int, int]:
    """``(height, width)`` from the header of an image file, or of its bytes ``data``; EXIF orientation not applied."""
    try:
        with Image.open(path if data is None else io.BytesIO(data.numpy().tobytes())) as img:  # reads the header
            width, height = img.size
    except Exception as err:  # PIL raises many types for bad files; all mean the same to the user
        raise undecodable_image(path, f"{type(err).__name__}: {err}") from None
    return height, width


class _HeaderSizes(torch.utils.data.IterableDataset):
    """``(indices, int32 (N, 2) sizes)`` for chunks of an order of samples; zeros where a header cannot be read."""

    def __init__(self, samples: SampleTable, order: np.ndarray, chunk: int) -> None:
        self.samples, self.order, self.chunk = samples, order, chunk

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start in range(0, len(self.order), self.chunk):
            indices = self.order[start : start + self.chunk]
            sizes = np.zeros((len(indices), 2), dtype=np.int32)
            for k, path in enumerate(self.samples.paths(indices)):
                with contextlib.suppress(DataError):  # left 0: read again by ``get``, which raises
                    sizes[k] = image_size(path)
            yield indices, sizes


class ImageSizes:
    """The ``(height, width)`` of a table's images, read from their headers when first needed (or by a worker process,
    ``AHEAD`` chunks ahead of ``get``, after ``read_ahead``), and kept."""

    #: Headers a chunk of the reading worker's holds, and chunks it may read ahead of their use.
    CHUNK, AHEAD = 256, 16

    def __init__(self, samples: SampleTable) -> None:
        self.samples = samples
        self.sizes = np.zeros((len(samples), 2), dtype=np.int32)  # 0: not read yet
        self._chunks: Iterator[tuple[np.ndarray, np.ndarray]] | None = None
        self._lead = 0  # samples taken from the worker, less those asked for since ``read_ahead``

    def get(self, indices: np.ndarray) -> np.ndarray:
        """The ``(height, width)`` of samples ``indices``, as an int32 ``(N, 2)`` array."""
        indices = np.asarray(indices, dtype=np.int64)
        self._lead -= len(indices)
        while self._chunks is not None and self._lead < 0:
            try:
                taken, sizes = next(self._chunks)
            except (StopIteration, RuntimeError):  # all read, or the worker went away: the rest is read here
                self._chunks = None
                break
            found = sizes[:, 0] > 0
            self.sizes[taken[found]] = sizes[found]
            self._lead += len(taken)
        for i in np.unique(indices[self.sizes[indices, 0] == 0]).tolist():
            self.sizes[i] = image_size(self.samples.path(i))
        return self.sizes[indices]

    def read_ahead(self, order: np.ndarray, start: int = 0) -> None:
        """Stops the last read-ahead; a worker reads the headers of ``order[start:]`` not read yet, for ``get``."""
        self.stop()
        order = np.asarray(order[start:], dtype=np.int64)
        order = order[self.sizes[order, 0] == 0]
        self._lead = start
        if len(order):
            loader = torch.utils.data.DataLoader(
                _HeaderSizes(self.samples, order, self.CHUNK), batch_size=None, num_workers=1,
                prefetch_factor=self.AHEAD, collate_fn=lambda x: x,
            )  # fmt: skip
            with forks_skip_parent_garbage():
                self._chunks = iter(loader)

    def stop(self) -> None:
        """Stops the reading ahead, if it runs, and its worker."""
        self._chunks = None


def gpu_decodable(data: Tensor) -> bool:
    """Whether the bytes look like a JPEG (the only format decoded on the GPU)."""
    return data.numel() > 3 and bytes(data[:3].tolist()) == b"\xff\xd8\xff"
