"""The learning-rate rule of NVIDIA apex's ImageNet example, as a per-step multiplier.

The base rate is given per 256 images and scaled by the global batch. For the first
``warmup_epochs`` it ramps up linearly, recomputed at every optimizer step; after that it is
multiplied by ``gamma`` once for each milestone epoch reached. The defaults (5 warmup epochs,
milestones 30, 60, 80) give the schedule the example used for ResNet-50 in 90 epochs.

``WarmupCosine`` is the short schedule for fine-tuning: the same warmup, then a cosine decay to 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def scaled_lr(lr_per_256: float, global_batch: int) -> float:
    """The optimizer's base learning rate for ``global_batch`` images per step (the linear scaling rule)."""
    if global_batch < 1:
        raise ValueError(f"The global batch size must be at least 1. Got {global_batch}")
    return lr_per_256 * global_batch / 256.0


class WarmupMultiStep:
    """Multiplier of the base learning rate at a given optimizer step.

    Calling it with the number of optimizer steps already taken (0 for the first step) gives the
    factor for the next step. Inside epoch ``e`` (of ``steps_per_epoch`` steps), the ``k``-th step
    (counting from 1, as the example counted it) gets::

        gamma ** (milestones reached by e)
        * (1 + k + e * steps_per_epoch) / (warmup_epochs * steps_per_epoch)   # only while e < warmup_epochs

    It is a plain object with numeric attributes, so ``LambdaLR`` saves and restores it with its
    state dict.

    Args:
        steps_per_epoch: Optimizer steps in one epoch.
        warmup_epochs: Epochs of linear warmup; 0 turns warmup off.
        milestones: Epochs at which the rate is multiplied by ``gamma``.
        gamma: The multiplier applied at each milestone.
    """

    def __init__(
        self,
        steps_per_epoch: int,
        warmup_epochs: int = 5,
        milestones: Sequence[int] = (30, 60, 80),
        gamma: float = 0.1,
    ) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1. Got {steps_per_epoch}")
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must not be negative. Got {warmup_epochs}")
        if list(milestones) != sorted(milestones):
            raise ValueError(f"milestones must be in increasing order. Got {list(milestones)}")
        self.steps_per_epoch = int(steps_per_epoch)
        self.warmup_epochs = int(warmup_epochs)
        self.milestones = [int(m) for m in milestones]
        self.gamma = float(gamma)

    def factor(self, epoch: int, step_in_epoch: int) -> float:
        """The multiplier for the ``step_in_epoch``-th step (from 1) of ``epoch`` (from 0)."""
        decays = sum(1 for m in self.milestones if epoch >= m)
        value = self.gamma**decays
        if epoch < self.warmup_epochs:
            value *= (1 + step_in_epoch + epoch * self.steps_per_epoch) / (self.warmup_epochs * self.steps_per_epoch)
        return value

    def __call__(self, steps_done: int) -> float:
        epoch, index = divmod(steps_done, self.steps_per_epoch)
        return self.factor(epoch, index + 1)


class WarmupCosine:
    """Multiplier of the base learning rate for fine-tuning: linear warmup, then cosine decay to 0.

    Calling it with the number of optimizer steps already taken (0 for the first step) gives the
    factor for the next step. Warmup is a linear ramp that reaches 1 at the last warmup step (its
    ``n``-th step gets ``n / warmup_steps``; ``WarmupMultiStep`` keeps the reference's ramp, one step
    ahead of this one); after it the factor follows half a cosine from 1 down to 0, reached after the last step of
    ``max_epochs`` epochs. Like ``WarmupMultiStep`` it is a plain object with numeric attributes,
    so ``LambdaLR`` saves and restores it with its state dict. ``LambdaLR`` applies it to every
    parameter group, so groups with different base rates keep their ratio.

    Args:
        steps_per_epoch: Optimizer steps in one epoch.
        max_epochs: Length of the run in epochs; the rate reaches 0 at its end.
        warmup_epochs: Epochs of linear warmup; 0 turns warmup off.
    """

    def __init__(self, steps_per_epoch: int, max_epochs: int, warmup_epochs: int = 0) -> None:
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1. Got {steps_per_epoch}")
        if max_epochs < 1:
            raise ValueError(f"The cosine schedule needs max_epochs of at least 1. Got {max_epochs}")
        if not 0 <= warmup_epochs < max_epochs:
            raise ValueError(
                f"warmup_epochs must be at least 0 and less than max_epochs ({max_epochs}). Got {warmup_epochs}"
            )
        self.steps_per_epoch = int(steps_per_epoch)
        self.max_epochs = int(max_epochs)
        self.warmup_epochs = int(warmup_epochs)

    def __call__(self, steps_done: int) -> float:
        warmup = self.warmup_epochs * self.steps_per_epoch
        if steps_done < warmup:
            return (steps_done + 1) / warmup
        total = self.max_epochs * self.steps_per_epoch
        progress = min(1.0, (steps_done - warmup) / (total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
