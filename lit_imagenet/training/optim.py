"""SGD as the reference set it up, and its schedule; ``restart_schedule`` sets the rates once the loader is built."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytorch_lightning as pl
import torch
from torch import nn

from lit_imagenet.training.schedule import WarmupCosine, WarmupMultiStep


def global_batch_size(trainer: pl.Trainer) -> int:
    """Images per optimizer step over all processes: batch x processes x gradient accumulation."""
    loader = trainer.train_dataloader
    batch_size = getattr(loader, "batch_size", None)
    if not batch_size:
        raise ValueError("The training loader has no batch_size; the learning rate is scaled by it.")
    return batch_size * trainer.world_size * trainer.accumulate_grad_batches


def steps_per_epoch(trainer: pl.Trainer) -> int:
    """Optimizer steps in one epoch of the training loader (as limited by the trainer)."""
    batches = trainer.num_training_batches
    if math.isinf(batches):
        raise ValueError("The training loader has no length; the warmup and step schedule are counted in epochs.")
    return max(1, math.ceil(batches / trainer.accumulate_grad_batches))


def build_sgd(
    head: list[nn.Parameter],
    backbone: list[nn.Parameter],
    lr: float,
    backbone_lr_scale: float,
    momentum: float,
    weight_decay: float,
    fused: bool,
) -> torch.optim.SGD:
    """SGD over two parameter groups: the head's (first) at ``lr``, the backbone's at ``lr * backbone_lr_scale``."""
    groups = [{"params": head, "lr": lr}, {"params": backbone, "lr": lr * backbone_lr_scale}]
    optimizer = torch.optim.SGD(
        groups, lr=lr, momentum=momentum, weight_decay=weight_decay, **({"fused": True} if fused else {})
    )
    if fused and momentum != 0:
        # Fused SGD makes its buffers with empty_like, left garbage by a first step the gradient scaler skips.
        for group in groups:
            for p in group["params"]:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return optimizer


def make_schedule(
    kind: str, steps_per_epoch: int, max_epochs: int | None, warmup_epochs: int, milestones: Sequence[int], gamma: float
) -> WarmupMultiStep | WarmupCosine:
    """The rate multiplier per step: ``step`` (warmup, then ``gamma`` at each milestone) or ``cosine``."""
    if kind == "cosine":
        if max_epochs is None or max_epochs < 1:
            raise ValueError("The cosine schedule decays over trainer.max_epochs; set --trainer.max_epochs.")
        return WarmupCosine(steps_per_epoch, max_epochs, warmup_epochs)
    return WarmupMultiStep(steps_per_epoch, warmup_epochs, milestones, gamma)


def restart_schedule(
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    base_lrs: Sequence[float],
    schedule: Callable[[], Callable[[int], float]],
) -> None:
    """Gives each parameter group a new base rate and a fresh ``schedule()``, and sets its rate to match."""
    scheduler.base_lrs = list(base_lrs)
    # Afresh: a resumed LambdaLR holds the checkpoint's schedules, whose settings this run may have changed.
    scheduler.lr_lambdas = [schedule() for _ in scheduler.lr_lambdas]
    optimizer = scheduler.optimizer
    for group, base, lam in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * lam(scheduler.last_epoch)
