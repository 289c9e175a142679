"""Datasets of ``(image, label)`` samples, collated into uint8 batches to be normalised on the GPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lit_imagenet.data.images import load_rgb
from lit_imagenet.data.index import SampleTable


class ImageFolderDataset(Dataset):
    """``(image, class index)`` pairs from scanned samples, each image opened with ``load_rgb``.

    Args:
        samples: ``(path, class index)`` pairs.
        transform: Applied to each image.
        loader: Opens a path: ``load_rgb`` (a PIL image) or ``load_rgb_tensor`` (a uint8 tensor).
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        transform: Callable[[Any], Any] | None = None,
        loader: Callable[[str], Any] = load_rgb,
    ):
        self.samples = SampleTable.of(samples)  # arrays: forked workers share them without copying
        self.transform = transform
        self.loader = loader

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[Any, int]:
        """``item`` is an index, or ``(index, seed)`` from ``EpochSeededSampler`` to fix the augmentation."""
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, target = self.samples[index]
        img = self.loader(path)
        if self.transform is not None:
            img = self.transform(img) if seed is None else self.transform(img, seed)  # presets.TrainCrop takes it
        return img, target


def collate_uint8(
    batch: Sequence[tuple[Any, int]], memory_format: torch.memory_format = torch.contiguous_format
) -> list[Tensor]:
    """Stacks same-sized PIL images and uint8 ``(3, H, W)`` tensors, mixed or not, and targets into
    ``[uint8 NCHW, int64 (N,)]``."""
    targets = torch.tensor([int(t) for _, t in batch], dtype=torch.int64)
    arrays = [img.permute(1, 2, 0).numpy() if isinstance(img, Tensor) else np.asarray(img) for img, _ in batch]
    shape = arrays[0].shape
    for i, a in enumerate(arrays):
        if a.shape != shape:
            raise ValueError(f"All images of a batch need one size. Image 0 is {shape}, image {i} is {a.shape}")
    # out: NHWC in C order, which np.stack alone does not give for transposed views (uint8 tensors' HWC views)
    nhwc = torch.from_numpy(np.stack(arrays, out=np.empty((len(arrays), *shape), dtype=np.uint8)))
    return [nhwc.permute(0, 3, 1, 2).contiguous(memory_format=memory_format), targets]  # NHWC is channels_last
