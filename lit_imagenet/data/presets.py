"""ImageNet presets: the normalisation constants, the train and eval transforms, and the crop boxes they cut.

Every decoder cuts the same crops: the PIL and ``torchvision`` paths run the transforms built here,
and the GPU paths (nvJPEG, DALI) cut the boxes computed here with the same random draws, so a seed
gives the same crop and flip on any of them. Normalisation happens after the batch is collated as
uint8, on the GPU when there is one (``Uint8Normalize``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torchvision import transforms
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms import v2 as transforms_v2

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Uint8Normalize(nn.Module):
    """Turns uint8 images in [0, 255] into normalised floats: ``(x / 255 - mean) / std``.

    One multiply and one add with per-channel constants kept as buffers, so they move with the
    module and cost no host-to-device copy per batch. The memory format of the input is kept.

    Args:
        mean: Per-channel mean of images scaled to [0, 1].
        std: Per-channel standard deviation of images scaled to [0, 1].
    """

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"mean and std need one value per channel each. Got {len(mean)} and {len(std)}")
        if any(s <= 0 for s in std):
            raise ValueError(f"std values must be positive. Got {list(std)}")
        mean_t = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
        self.register_buffer("scale", (1.0 / (255.0 * std_t)).float(), persistent=False)
        self.register_buffer("shift", (-mean_t / std_t).float(), persistent=False)

    def forward(self, images: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        if images.dtype != torch.uint8:
            raise ValueError(f"Expected uint8 images. Got {images.dtype}")
        if images.ndim != 4 or images.shape[1] != self.scale.shape[1]:
            raise ValueError(f"Expected images of shape (N, {self.scale.shape[1]}, H, W). Got {tuple(images.shape)}")
        out = images.to(dtype=dtype)
        return out.mul_(self.scale.to(dtype)).add_(self.shift.to(dtype))


def _transforms(tensors: bool) -> Any:
    # transforms.v2 resizes uint8 tensors as uint8 (several times faster than v1, which converts
    # them to float); both draw the same random numbers, so a seed gives the same crops.
    return transforms_v2 if tensors else transforms


def train_transform(crop_size: int, crop_scale: tuple[float, float], tensors: bool) -> Callable[[Any], Any]:
    """RandomResizedCrop and horizontal flip, on PIL images or (``tensors``) on uint8 tensors."""
    t = _transforms(tensors)
    return t.Compose([t.RandomResizedCrop(crop_size, scale=crop_scale), t.RandomHorizontalFlip()])


def eval_transform(resize: int, crop_size: int, tensors: bool) -> Callable[[Any], Any]:
    """Resize of the short side, then centre crop; on PIL images or (``tensors``) on uint8 tensors."""
    t = _transforms(tensors)
    return t.Compose([t.Resize(resize), t.CenterCrop(crop_size)])


class CropBox(NamedTuple):
    """A region of a source image, in pixels."""

    top: int
    left: int
    height: int
    width: int


def random_crop_box(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float] = (3 / 4, 4 / 3)
) -> CropBox:
    """The box ``RandomResizedCrop`` would cut from an image of this size, drawn from torch's generator."""
    shape_only = torch.empty(()).expand(3, height, width)  # get_params reads only the shape
    top, left, h, w = RandomResizedCrop.get_params(shape_only, list(scale), list(ratio))  # type: ignore[arg-type]
    return CropBox(int(top), int(left), int(h), int(w))


def center_crop_box(height: int, width: int, resize: int, crop: int) -> CropBox:
    """The source region that ``Resize(resize)`` then ``CenterCrop(crop)`` keep, in source pixels."""
    short, long = (height, width) if height <= width else (width, height)
    new_long = int(resize * long / short)
    new_h, new_w = (resize, new_long) if height <= width else (new_long, resize)
    top = int(round((new_h - crop) / 2.0))
    left = int(round((new_w - crop) / 2.0))
    scale_h, scale_w = height / new_h, width / new_w
    src_top, src_left = int(round(top * scale_h)), int(round(left * scale_w))
    src_h = max(1, min(height - src_top, int(round(crop * scale_h))))
    src_w = max(1, min(width - src_left, int(round(crop * scale_w))))
    return CropBox(src_top, src_left, src_h, src_w)
