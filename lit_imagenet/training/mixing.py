"""MixUp and CutMix of a training batch (torchvision's ``transforms.v2``), drawn from a seed."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms import v2

from lit_imagenet.errors import ConfigError


def batch_mixer(mixup_alpha: float, cutmix_alpha: float, num_classes: int) -> v2.Transform | None:
    """``v2.MixUp`` and/or ``v2.CutMix`` for the alphas above 0, one of the two at random when both are (as
    torchvision's reference does); ``None`` when neither is."""
    if mixup_alpha < 0 or cutmix_alpha < 0:
        alphas = f"{mixup_alpha}, {cutmix_alpha}"
        raise ConfigError(f"--model.mixup_alpha and cutmix_alpha must be at least 0, not {alphas}.")
    kinds = ((v2.MixUp, mixup_alpha), (v2.CutMix, cutmix_alpha))
    mixers: list[v2.Transform] = [kind(alpha=alpha, num_classes=num_classes) for kind, alpha in kinds if alpha > 0]
    if len(mixers) < 2:
        return mixers[0] if mixers else None
    return v2.RandomChoice(mixers)


def mix_seed(*keys: int) -> int:
    """A 63-bit seed for the draws of one batch, from integers (the data seed, rank, epoch, batch)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0]) >> 1


def mix_batch(mixer: v2.Transform, images: Tensor, targets: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """``mixer(images, targets)``: the mixed batch and its soft targets ``(N, classes)``, drawn from torch's CPU
    generator seeded by ``seed`` (v2 draws its mixing weight, box and choice there for batches on any device); the
    process's generator is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return mixer(images, targets)
