"""ImageNet presets: the normalisation constants, ``Uint8Normalize``, and the CPU decoders' transforms."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchvision import transforms
from torchvision.transforms import v2 as transforms_v2
from torchvision.transforms.v2 import functional as F

from lit_imagenet.data.augment import Augment, augment_image, policy_transform
from lit_imagenet.data.crops import crop_and_flip

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Uint8Normalize(nn.Module):
    """Turns uint8 images into normalised floats, ``(x / 255 - mean) / std``, in their memory format; ``mean`` and
    ``std`` are per channel, of images scaled to [0, 1]."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__()
        mean_t = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
        std_t = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
        self.register_buffer("scale", (1.0 / (255.0 * std_t)).float(), persistent=False)
        self.register_buffer("shift", (-mean_t / std_t).float(), persistent=False)

    def forward(self, images: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        if images.dtype != torch.uint8:
            raise ValueError(f"Expected uint8 images. Got {images.dtype}")
        if images.ndim != 4 or images.shape[1] != self.scale.shape[1]:
            raise ValueError(f"Expected images of shape (N, {self.scale.shape[1]}, H, W). Got {tuple(images.shape)}")
        return images.to(dtype=dtype).mul_(self.scale.to(dtype)).add_(self.shift.to(dtype))


class TrainCrop:
    """RandomResizedCrop (area fraction in ``scale``) to ``size`` squared and a horizontal flip from the sample's seed,
    then ``augment`` from the same seed, on PIL images or uint8 tensors (an erased PIL crop comes back as a tensor)."""

    def __init__(self, size: int, scale: tuple[float, float], augment: Augment | None = None) -> None:
        self.size, self.scale = size, scale
        self.augment = Augment() if augment is None else augment
        self.policy = policy_transform(self.augment)

    def __call__(self, img: Any, seed: int | None = None) -> Any:
        height, width = F.get_size(img)
        box, flip = crop_and_flip(height, width, seed, self.scale)
        out = F.resized_crop(img, box.top, box.left, box.height, box.width, [self.size, self.size], antialias=True)
        out = F.horizontal_flip(out) if flip else out
        # PIL crops stay PIL for the policy: transforms.v2 runs it faster on them than on their tensors.
        return augment_image(out, seed, self.augment, self.policy) if self.augment else out


def eval_transform(resize: int, crop_size: int, tensors: bool) -> Callable[[Any], Any]:
    """Resize of the short side, then centre crop; on PIL images or (``tensors``) on uint8 tensors."""
    # transforms.v2 resizes uint8 tensors as uint8, several times faster than v1, which converts them to float.
    t = transforms_v2 if tensors else transforms
    return t.Compose([t.Resize(resize), t.CenterCrop(crop_size)])
