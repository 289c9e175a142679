"""torchvision's recipe's training augmentations, from a sample's seed: an auto-augment policy, then random erasing.

Every decoder erases the same box for a seed (``erase_boxes``), filled with the normalisation mean (0 once normalised,
as torchvision's ``RandomErasing`` after ``Normalize``). The policy is ``transforms.v2``'s, drawn from torch's generator
seeded by the sample's seed, except on DALI, which draws its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as F

from lit_imagenet.data.crops import uniform_draws
from lit_imagenet.errors import ConfigError

Policy = Literal["ta_wide", "ra", "augmix"]
POLICIES: tuple[str, ...] = ("ta_wide", "ra", "augmix")
ERASE_SCALE = (0.02, 0.33)
ERASE_RATIO = (0.3, 3.3)
ERASE_TRIES = 10
_ERASE_STREAM = 64  # erase draws come after the crop's in a seed's SplitMix64 stream
_POLICY_SALT = 0x2545F4914F6CDD1D


@dataclass(frozen=True)
class Augment:
    """The training augmentations beyond the crop and flip.

    Args:
        policy: ``None``, ``ta_wide`` (TrivialAugmentWide), ``ra`` (RandAugment, 2 ops of ``ra_magnitude``) or
            ``augmix`` (AugMix of ``augmix_severity``).
        ra_magnitude: RandAugment's magnitude, of 31 bins.
        augmix_severity: AugMix's severity, 1 to 10.
        random_erase: The probability that a crop gets a box erased (``RandomErasing``'s ``p``).
        fill: The uint8 colour of erased pixels, per channel (the normalisation mean).
    """

    policy: Policy | None = None
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0
    fill: tuple[int, int, int] = (124, 116, 104)

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in POLICIES:
            raise ConfigError(f"auto_augment must be one of {', '.join(POLICIES)} or null. Got {self.policy!r}")
        if not 0 <= self.ra_magnitude <= 30:
            raise ConfigError(f"ra_magnitude must be in [0, 30]. Got {self.ra_magnitude}")
        if not 1 <= self.augmix_severity <= 10:
            raise ConfigError(f"augmix_severity must be in [1, 10]. Got {self.augmix_severity}")
        if not 0.0 <= self.random_erase <= 1.0:
            raise ConfigError(f"random_erase must be a probability in [0, 1]. Got {self.random_erase}")

    def __bool__(self) -> bool:
        return self.policy is not None or self.random_erase > 0

    @staticmethod
    def fill_of(mean: Sequence[float]) -> tuple[int, int, int]:
        """The uint8 colour of a normalisation ``mean`` of images in [0, 1]."""
        return tuple(int(round(255 * m)) for m in mean)  # type: ignore[return-value]


def policy_transform(augment: Augment) -> v2.Transform | None:
    """``augment``'s policy as a ``transforms.v2`` transform (bilinear, as torchvision's recipe), or ``None``."""
    bilinear = InterpolationMode.BILINEAR
    if augment.policy == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=bilinear)
    if augment.policy == "ra":
        return v2.RandAugment(magnitude=augment.ra_magnitude, interpolation=bilinear)
    if augment.policy == "augmix":
        return v2.AugMix(severity=augment.augmix_severity, interpolation=bilinear)
    return None


def erase_boxes(
    seeds: Sequence[int] | np.ndarray,
    height: int,
    width: int,
    p: float,
    scale: tuple[float, float] = ERASE_SCALE,
    ratio: tuple[float, float] = ERASE_RATIO,
) -> np.ndarray:
    """``RandomErasing``'s boxes in ``height`` x ``width`` crops, from the samples' seeds: an int32 ``(N, 4)`` array
    of ``(top, left, height, width)``; a sample drawn out by ``p``, or whose ten tries do not fit, gets a 0 x 0 box."""
    t = ERASE_TRIES
    u = uniform_draws(seeds, 2 * t + 3, first=_ERASE_STREAM)
    area = height * width * (scale[0] + (scale[1] - scale[0]) * u[:, 1 : t + 1])
    low, high = math.log(ratio[0]), math.log(ratio[1])
    aspect = np.exp(low + (high - low) * u[:, t + 1 : 2 * t + 1])
    h = np.floor(np.sqrt(area * aspect) + 0.5)
    w = np.floor(np.sqrt(area / aspect) + 0.5)
    fits = (h < height) & (w < width)
    rows = np.arange(len(u))
    first = fits.argmax(axis=1)
    chosen = (u[:, 0] < p) & fits.any(axis=1)
    out_h, out_w = h[rows, first], w[rows, first]
    top = np.floor(u[:, 2 * t + 1] * (height - out_h + 1))
    left = np.floor(u[:, 2 * t + 2] * (width - out_w + 1))
    box = np.stack([top, left, out_h, out_w], axis=1)
    box[~chosen] = 0
    return box.astype(np.int32)


def apply_policy(transform: v2.Transform, img: Any, seed: int | None) -> Any:
    """``transform(img)`` drawn from torch's generator seeded by ``seed`` (``None``: the generator as it is), on
    the CPU and, for a CUDA tensor, its device; the process's generators are left as they were."""
    if seed is None:
        return transform(img)
    cuda = isinstance(img, Tensor) and img.is_cuda
    seed = (int(seed) ^ _POLICY_SALT) & 0x7FFFFFFFFFFFFFFF  # the policy's draws apart from the crop's
    with torch.random.fork_rng(devices=[img.device] if cuda else []):
        # Only the generators that are restored: torch.manual_seed would reseed every CUDA device for good.
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(img.device):
                torch.cuda.manual_seed(seed)
        return transform(img)


def augment_image(img: Any, seed: int | None, augment: Augment, transform: v2.Transform | None = None) -> Any:
    """``augment`` from the sample's ``seed`` on a training crop (PIL, which stays PIL unless erased, or a uint8
    ``(C, H, W)`` tensor on any device); ``transform``: ``policy_transform(augment)``."""
    if transform is not None:
        img = apply_policy(transform, img, seed)
    if augment.random_erase > 0:
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        img = img.clone() if isinstance(img, Tensor) else F.pil_to_tensor(img)
        top, left, height, width = erase_boxes([seed], *img.shape[-2:], augment.random_erase)[0].tolist()
        colour = torch.tensor(augment.fill, dtype=img.dtype, device=img.device)
        img[:, top : top + height, left : left + width] = colour[:, None, None]  # a 0 x 0 box keeps the image
    return img
