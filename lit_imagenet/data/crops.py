"""The crop rule of every decoder: RandomResizedCrop's boxes drawn from a sample's seed (so every decoder crops a
seed alike), and evaluation's centre crop."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10


class CropBox(NamedTuple):
    """A region of a source image, in pixels."""

    top: int
    left: int
    height: int
    width: int


def uniform_draws(seeds: Sequence[int] | np.ndarray, count: int, first: int = 0) -> np.ndarray:
    """Per sample, ``count`` uniform numbers in [0, 1) fixed by its augmentation seed: draws ``first + 1`` to
    ``first + count`` of the seed's SplitMix64 stream, as a float64 ``(N, count)`` array."""
    seeds_u = np.asarray(seeds, dtype=np.uint64).reshape(-1)
    steps = np.arange(first + 1, first + count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):  # SplitMix64: wrapping 64-bit arithmetic is the point
        x = seeds_u[:, None] + steps[None, :]
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def crop_draws(seeds: Sequence[int] | np.ndarray, scale: tuple[float, float]) -> np.ndarray:
    """Per sample, from its seed (``uniform_draws``), a float64 ``(N, 23)`` array: ten area fractions in ``scale``, ten
    log-uniform aspect ratios (width / height) in ``CROP_RATIO``, then uniforms for the top, the left and the flip."""
    u = uniform_draws(seeds, 2 * CROP_TRIES + 3)  # area fractions, aspect ratios, top, left, flip
    t = CROP_TRIES
    out = u.copy()
    out[:, :t] = scale[0] + (scale[1] - scale[0]) * u[:, :t]
    low, high = math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1])
    out[:, t : 2 * t] = np.exp(low + (high - low) * u[:, t : 2 * t])
    return out


def crop_windows(sizes: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """RandomResizedCrop's boxes for ``(N, 2)`` heights and widths ``sizes`` and rows of ``crop_draws``: the first try
    that fits, placed at random, else the largest centred box with an aspect ratio in ``CROP_RATIO``. An int32
    ``(N, 4)`` array of ``(top, left, height, width)``."""
    t = CROP_TRIES
    height, width = sizes[:, 0:1].astype(np.float64), sizes[:, 1:2].astype(np.float64)
    area = height * width
    s, r = draws[:, :t], draws[:, t : 2 * t]
    w = np.floor(np.sqrt(area * s * r) + 0.5)
    h = np.floor(np.sqrt(area * s / r) + 0.5)
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    found = fits.any(axis=1)
    first, rows = fits.argmax(axis=1), np.arange(len(sizes))  # the first try that fits
    height, width = height[:, 0], width[:, 0]
    out_w = np.where(found, w[rows, first], np.minimum(width, np.floor(height * CROP_RATIO[1] + 0.5)))
    out_h = np.where(found, h[rows, first], np.minimum(height, np.floor(width / CROP_RATIO[0] + 0.5)))
    top = np.where(found, np.floor(draws[rows, 2 * t] * (height - out_h + 1)), (height - out_h) // 2)
    left = np.where(found, np.floor(draws[rows, 2 * t + 1] * (width - out_w + 1)), (width - out_w) // 2)
    return np.stack([top, left, out_h, out_w], axis=1).astype(np.int32)


def flips(draws: np.ndarray) -> np.ndarray:
    """Which samples of ``crop_draws`` are mirrored, as int32 0 or 1."""
    return (draws[:, 2 * CROP_TRIES + 2] < 0.5).astype(np.int32)


def crop_and_flip(height: int, width: int, seed: int | None, scale: tuple[float, float]) -> tuple[CropBox, bool]:
    """The crop box and flip of a sample with augmentation ``seed`` (``None``: drawn from torch's generator)."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    draws = crop_draws([seed], scale)
    box = crop_windows(np.array([[height, width]]), draws)[0].tolist()
    return CropBox(*box), bool(flips(draws)[0])


def eval_geometry(sizes: np.ndarray, resize: int, crop: int) -> tuple[np.ndarray, np.ndarray]:
    """torchvision's ``Resize(resize)`` then ``CenterCrop(crop)`` of images of ``(N, 2)`` heights and widths ``sizes``:
    float32 ``(N, 2)`` arrays of the resized ``(width, height)`` and of the crop's position as
    ``crop_mirror_normalize`` takes it, ``(x, y)`` in [0, 1] of ``side - crop``."""
    height, width = sizes[:, 0].astype(np.float64), sizes[:, 1].astype(np.float64)
    wide = width >= height
    new_h = np.where(wide, resize, np.floor(resize * height / width))
    new_w = np.where(wide, np.floor(resize * width / height), resize)
    pos_x = np.round((new_w - crop) / 2) / np.maximum(new_w - crop, 1)
    pos_y = np.round((new_h - crop) / 2) / np.maximum(new_h - crop, 1)
    return np.stack([new_w, new_h], 1).astype(np.float32), np.stack([pos_x, pos_y], 1).astype(np.float32)


def center_crop_box(height: int, width: int, resize: int, crop: int) -> CropBox:
    """The source region that ``Resize(resize)`` then ``CenterCrop(crop)`` keep, in source pixels."""
    new_w, new_h = eval_geometry(np.array([[height, width]]), resize, crop)[0][0].tolist()
    scale_h, scale_w = height / new_h, width / new_w
    src_top, src_left = round(round((new_h - crop) / 2.0) * scale_h), round(round((new_w - crop) / 2.0) * scale_w)
    src_h = max(1, min(height - src_top, int(round(crop * scale_h))))
    src_w = max(1, min(width - src_left, int(round(crop * scale_w))))
    return CropBox(src_top, src_left, src_h, src_w)
