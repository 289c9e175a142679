"""The choices of ``--data.decoder``, and the dataset and collation behind each.

``pil`` and ``torchvision`` decode in the loader workers and collate uint8 batches (``collate_uint8``);
``nvjpeg`` leaves the JPEGs it picks encoded for the GPU (``collate_encoded``); ``dali`` reads the
files in its own pipeline (``lit_imagenet.dali``), in the order of a sampler built on the ``pil``
dataset; ``auto`` stands for one of them (``dali.choose_decoder``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from lit_imagenet.datasets import EncodedImageFolderDataset, ImageFolderDataset, collate_uint8
from lit_imagenet.decoding import load_rgb, load_rgb_tensor
from lit_imagenet.gpu_decode import collate_encoded

DECODERS = ("pil", "torchvision", "nvjpeg", "dali", "auto")


def decoder_dataset(
    decoder: str,
    samples: Sequence[tuple[str, int]],
    transform: Callable[[Any], Any],
    memory_format: torch.memory_format,
    train: bool,
    *,
    crop_size: int,
    crop_scale: tuple[float, float],
    val_resize: int,
    gpu_share: float,
) -> tuple[ImageFolderDataset, Callable[..., Any]]:
    """The dataset of ``samples`` for ``decoder`` (``auto`` resolved), and the collate function of its batches.

    ``crop_size`` to ``gpu_share`` are those of ``EncodedImageFolderDataset``, which ``nvjpeg`` uses.
    """
    if decoder == "nvjpeg":
        dataset = EncodedImageFolderDataset(samples, transform, train, crop_size, crop_scale, val_resize, gpu_share)
        return dataset, partial(collate_encoded, memory_format=memory_format)
    loader = load_rgb_tensor if decoder == "torchvision" else load_rgb
    return ImageFolderDataset(samples, transform, loader), partial(collate_uint8, memory_format=memory_format)
