"""Learning-rate multipliers per optimizer step: NVIDIA apex's ImageNet example's rule, and warmup then cosine."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lit_imagenet.errors import ConfigError


def check_warmup(method: str, decay: float | None) -> None:
    """Raises ``ConfigError`` for a warmup method other than ``linear``/``constant``, or a decay out of (0, 1]."""
    if method not in ("linear", "constant"):
        raise ConfigError(f"--model.warmup_method must be linear or constant, not {method!r}.")
    if method == "constant" and decay is None:
        raise ConfigError("--model.warmup_method constant needs --model.warmup_decay (torchvision's default: 0.01).")
    if decay is not None and not 0 < decay <= 1:
        raise ConfigError(f"--model.warmup_decay must be in (0, 1], not {decay}.")


def scaled_lr(lr_per_256: float, global_batch: int) -> float:
    """The optimizer's base learning rate for ``global_batch`` images per step (the linear scaling rule)."""
    return lr_per_256 * global_batch / 256.0


class _Warmup:
    """What both schedules share: ``steps_per_epoch``, and the warmup over the first ``warmup_epochs``. A plain
    object, so ``LambdaLR`` saves its attributes."""

    def __init__(self, steps_per_epoch: int, warmup_epochs: int, method: str, decay: float | None) -> None:
        if warmup_epochs < 0:
            raise ValueError(f"warmup_epochs must not be negative. Got {warmup_epochs}")
        check_warmup(method, decay)
        self.steps_per_epoch, self.warmup_epochs = int(steps_per_epoch), int(warmup_epochs)
        self.warmup_method, self.warmup_decay = method, decay

    def warmup(self, steps_done: int, ramp_start: int) -> float:
        """The warmup's factor for the next step: without ``warmup_decay``, ``(ramp_start + steps_done) / warmup
        steps``; with it, torchvision's: ``linear`` from ``warmup_decay`` to 1, ``constant`` ``warmup_decay``."""
        steps = self.warmup_epochs * self.steps_per_epoch
        if self.warmup_decay is None:
            return (ramp_start + steps_done) / steps
        if self.warmup_method == "constant":
            return self.warmup_decay
        return self.warmup_decay + (1.0 - self.warmup_decay) * steps_done / steps


class WarmupMultiStep(_Warmup):
    """The reference's multiplier for the next step, given the steps taken: ``gamma ** (milestones reached)``, times
    the warmup while ``epoch < warmup_epochs``."""

    def __init__(
        self,
        steps_per_epoch: int,
        warmup_epochs: int = 5,
        milestones: Sequence[int] = (30, 60, 80),
        gamma: float = 0.1,
        warmup_method: str = "linear",
        warmup_decay: float | None = None,
    ) -> None:
        if list(milestones) != sorted(milestones):
            raise ValueError(f"milestones must be in increasing order. Got {list(milestones)}")
        super().__init__(steps_per_epoch, warmup_epochs, warmup_method, warmup_decay)
        self.milestones = [int(m) for m in milestones]
        self.gamma = float(gamma)

    def __call__(self, steps_done: int) -> float:
        epoch = steps_done // self.steps_per_epoch
        value = self.gamma ** sum(1 for m in self.milestones if epoch >= m)
        if epoch < self.warmup_epochs:
            value *= self.warmup(steps_done, 2)
        return value


class WarmupCosine(_Warmup):
    """The multiplier for the next step, given the steps taken: the warmup, then half a cosine down to 0 at the end of
    ``max_epochs``."""

    def __init__(
        self,
        steps_per_epoch: int,
        max_epochs: int,
        warmup_epochs: int = 0,
        warmup_method: str = "linear",
        warmup_decay: float | None = None,
    ) -> None:
        if not 0 <= warmup_epochs < max_epochs:
            raise ConfigError(
                f"The cosine schedule decays after the warmup: --model.warmup_epochs ({warmup_epochs}) must be "
                f"below --trainer.max_epochs ({max_epochs}); lower it or train longer."
            )
        super().__init__(steps_per_epoch, warmup_epochs, warmup_method, warmup_decay)
        self.max_epochs = int(max_epochs)

    def __call__(self, steps_done: int) -> float:
        warmup = self.warmup_epochs * self.steps_per_epoch
        if steps_done < warmup:
            return self.warmup(steps_done, 1)
        total = self.max_epochs * self.steps_per_epoch
        progress = min(1.0, (steps_done - warmup) / (total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
