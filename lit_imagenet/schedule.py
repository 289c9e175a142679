"""The learning-rate rule of NVIDIA apex's ImageNet example, as a per-step multiplier.

The base rate is given per 256 images and scaled by the global batch. For the first
``warmup_epochs`` it ramps up linearly, recomputed at every optimizer step; after that it is
multiplied by ``gamma`` once for each milestone epoch reached. The defaults (5 warmup epochs,
milestones 30, 60, 80) give the schedule the example used for ResNet-50 in 90 epochs.
"""

from __future__ import annotations

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
    It is a plain object with
       numeric attributes, so ``LambdaLR`` saves and restores it with its state dict.

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
