"""Datasets of ``(image, label)`` samples, and their collation into uint8 batches.

Batches are collated as uint8 ``(N, 3, H, W)`` tensors in the requested memory format, as NVIDIA
apex's ImageNet example did (its ``fast_collate``): conversion to float and normalisation happen on
the GPU (``lit_imagenet.prefetch``), not in the workers. For ``--data.decoder nvjpeg`` the samples
picked for the GPU stay encoded (``EncodedImageFolderDataset``) and are collated by
``gpu_decode.collate_encoded``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from lit_imagenet.decoding import EncodedImage, gpu_decodable, jpeg_size, load_rgb, load_rgb_tensor, read_bytes
from lit_imagenet.presets import center_crop_box, random_crop_box
from lit_imagenet.samplers import seeded_rng


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
        self.samples = list(samples)
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
            with seeded_rng(seed):
                img = self.transform(img)
        return img, target


def gpu_share_picks(index: int, share: float) -> bool:
    """Whether sample ``index`` is one of the ``share`` of the data decoded on the GPU (fixed per sample)."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    return ((index * 2654435761) & 0xFFFFFFFF) < share * 2**32  # Knuth's multiplicative hash: an even spread


class EncodedImageFolderDataset(ImageFolderDataset):
    """Samples for GPU decoding: ``(EncodedImage, class index)``, or a worker-decoded crop for the rest.

    A JPEG picked by ``gpu_share`` is only read and its header parsed; the crop box and flip are
    drawn with the same random draws as ``transform`` makes on the CPU paths (RandomResizedCrop,
    then the flip), so a seed gives the same crop either way. Other files, and the JPEGs left to the
    workers, are decoded with ``load_rgb_tensor`` and transformed here.

    Args:
        samples: ``(path, class index)`` pairs.
        transform: The CPU transform for the images decoded here.
        train: Random crop and flip (training) or resize and centre crop (evaluation).
        crop_size: Side of the output images.
        crop_scale: Range of the crop's area, as for RandomResizedCrop.
        val_resize: Short side before the evaluation centre crop.
        gpu_share: Fraction of the images decoded on the GPU.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        transform: Callable[[Any], Any],
        train: bool,
        crop_size: int,
        crop_scale: tuple[float, float],
        val_resize: int,
        gpu_share: float = 1.0,
    ) -> None:
        super().__init__(samples, transform, load_rgb_tensor)
        self.train = train
        self.crop_size = crop_size
        self.crop_scale = crop_scale
        self.val_resize = val_resize
        self.gpu_share = gpu_share

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[Any, int]:
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, target = self.samples[index]
        if not gpu_share_picks(index, self.gpu_share):
            return super().__getitem__(item)
        data = read_bytes(path)
        if not gpu_decodable(data):
            return super().__getitem__(item)
        height, width = jpeg_size(data, path)
        if not self.train:
            box = center_crop_box(height, width, self.val_resize, self.crop_size)
            return EncodedImage(data, box, self.crop_size, False, path), target
        with seeded_rng(seed):  # the draws of RandomResizedCrop, then of the flip, as on the CPU paths
            box = random_crop_box(height, width, self.crop_scale)
            flip = bool(torch.rand(1) < 0.5)
        return EncodedImage(data, box, self.crop_size, flip, path), target


def collate_uint8(
    batch: Sequence[tuple[Any, int]], memory_format: torch.memory_format = torch.contiguous_format
) -> list[Tensor]:
    """Stacks PIL images (or uint8 ``(3, H, W)`` tensors) and targets into ``[uint8 (N, 3, H, W), int64 (N,)]``.

    All images of a batch must have the same size. With ``torch.channels_last`` the images are
    written straight into an NHWC buffer, which is what channels_last means, so no copy is needed.
    """
    if not batch:
        raise ValueError("Cannot collate an empty batch.")
    targets = torch.tensor([int(t) for _, t in batch], dtype=torch.int64)
    arrays = [_hwc_uint8(img) for img, _ in batch]
    shape = arrays[0].shape
    for i, a in enumerate(arrays):
        if a.shape != shape:
            raise ValueError(f"All images of a batch need one size. Image 0 is {shape}, image {i} is {a.shape}")
    nhwc = torch.from_numpy(np.stack(arrays))
    images = nhwc.permute(0, 3, 1, 2)
    if memory_format != torch.channels_last:
        images = images.contiguous(memory_format=memory_format)
    return [images, targets]


def _hwc_uint8(img: Any) -> np.ndarray:
    if isinstance(img, Tensor):
        if img.dtype != torch.uint8 or img.ndim != 3:
            raise ValueError(f"Expected uint8 (C, H, W) image tensors. Got {img.dtype} of shape {tuple(img.shape)}")
        return img.permute(1, 2, 0).numpy()
    array = np.asarray(img, dtype=np.uint8)
    if array.ndim == 2:
        array = array[:, :, None]
    return array
