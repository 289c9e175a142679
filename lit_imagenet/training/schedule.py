"""Learning-rate multipliers per optimizer step: NVIDIA apex's ImageNet example's rule, and warmup then cosine."""

from __future__ import annotations

import math
from collections.abc import Sequence


def scaled_lr(lr_per_256: float, global_batch: int) -> float:
    """The optimizer's base learning rate for ``global_batch`` images per step (the linear scaling rule)."""
    if global_batch < 1:
        raise ValueError(f"The global batch size must be at least 1. Got {global_batch}")
    return lr_per_256 * global_batch / 256.0


class WarmupMultiStep:
    """The reference's multiplier: called with the optimizer steps taken, the factor for the next step. The ``k``-th
    step (from 1) of epoch ``e`` gets ``gamma ** (milestones reached by e)``, times ``(1 + k + e * steps_per_epoch) /
    (warmup_epochs * steps_per_epoch)`` while ``e < warmup_epochs``. A plain object, so ``LambdaLR`` saves it."""

    def __init__(
        self, steps_per_epoch: int, warmup_epochs: int = 5, milestones: Sequence[int] = (30, 60, 80), gamma: float = 0.1
    ) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1. Got {steps_per_epoch}")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must not be negative. Got {warmup_epochs}")
        if list(milestones) != sorted(milestones):
            raise ValueError(f"milestones must be in increasing order. Got {list(milestones)}")
        self.steps_per_epoch, self.warmup_epochs = int(steps_per_epoch), int(warmup_epochs)
        self.milestones = [int(m) for m in milestones]
        self.gamma = float(gamma)

    def __call__(self, steps_done: int) -> float:
        epoch = steps_done // self.steps_per_epoch
        value = self.gamma ** sum(1 for m in self.milestones if epoch >= m)
        if epoch < self.warmup_epochs:
            value *= (2 + steps_done) / (self.warmup_epochs * self.steps_per_epoch)
        return value


class WarmupCosine:
    """Linear warmup to 1 (its ``n``-th step gets ``n / warmup_steps``), then half a cosine down to 0 at the end
    of ``max_epochs``; called with the optimizer steps taken, the factor for the next step."""

    def __init__(self, steps_per_epoch: int, max_epochs: int, warmup_epochs: int = 0) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1. Got {steps_per_epoch}")
        if max_epochs < 1:
            raise ValueError(f"The cosine schedule needs max_epochs of at least 1. Got {max_epochs}")
        if not 0 <= warmup_epochs < max_epochs:
            raise ValueError(f"warmup_epochs must be in [0, max_epochs={max_epochs}). Got {warmup_epochs}")
        self.steps_per_epoch, self.warmup_epochs = int(steps_per_epoch), int(warmup_epochs)
        self.max_epochs = int(max_epochs)

    def __call__(self, steps_done: int) -> float:
        warmup = self.warmup_epochs * self.steps_per_epoch
        if steps_done < warmup:
            return (steps_done + 1) / warmup
        total = self.max_epochs * self.steps_per_epoch
        progress = min(1.0, (steps_done - warmup) / (total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
