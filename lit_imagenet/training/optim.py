"""The optimizer (SGD, AdamW, RMSprop), its parameter groups, and the loader's figures that its rates depend on."""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from lit_imagenet.training.models import BATCH_NORMS


def global_batch_size(trainer: pl.Trainer) -> int:
    """Images per optimizer step over all processes: batch x processes x gradient accumulation."""
    batch_size = getattr(trainer.train_dataloader, "batch_size", None)
    if not batch_size:
        raise ValueError("The training loader has no batch_size; the learning rate is scaled by it.")
    return batch_size * trainer.world_size * trainer.accumulate_grad_batches


def steps_per_epoch(trainer: pl.Trainer) -> int:
    """Optimizer steps in one epoch of the training loader (as limited by the trainer)."""
    batches = trainer.num_training_batches
    if math.isinf(batches):
        raise ValueError("The training loader has no length; the warmup and step schedule are counted in epochs.")
    return max(1, math.ceil(batches / trainer.accumulate_grad_batches))


#: torchvision's normalisation layers, whose parameters take ``norm_weight_decay``.
NORM_CLASSES: tuple[type[nn.Module], ...] = (*BATCH_NORMS, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
                                            nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)  # fmt: skip


def parameter_groups(
    network: nn.Module,
    head_name: str,
    backbone_lr_scale: float,
    weight_decay: float,
    norm_weight_decay: float | None = None,
    bias_weight_decay: float | None = None,
) -> list[dict[str, Any]]:
    """The head's groups then the backbone's, each with its ``lr_scale`` (1, ``backbone_lr_scale``) and
    ``weight_decay``: biases (``bias_weight_decay`` set) and norm layers' parameters (``norm_weight_decay`` set) get
    groups of their own, as torchvision's ``set_weight_decay`` sorts them; empty groups are left out."""
    sorted_params: dict[tuple[str, str], list[nn.Parameter]] = {}
    for module_name, module in network.named_modules():
        part = "head" if module_name == head_name or module_name.startswith(f"{head_name}.") else "backbone"
        for name, param in module.named_parameters(recurse=False):
            bias = bias_weight_decay is not None and name == "bias"
            norm = norm_weight_decay is not None and isinstance(module, NORM_CLASSES)
            kind = "bias" if bias else "norm" if norm else "other"
            sorted_params.setdefault((part, kind), []).append(param)
    decays = {"other": weight_decay, "norm": norm_weight_decay, "bias": bias_weight_decay}
    scales = {"head": 1.0, "backbone": backbone_lr_scale}
    return [
        {"params": sorted_params[part, kind], "lr_scale": scales[part], "weight_decay": decays[kind]}
        for part in ("head", "backbone")
        for kind in ("other", "norm", "bias")
        if sorted_params.get((part, kind))
    ]


def build_optimizer(
    name: str, groups: list[dict[str, Any]], lr: float, momentum: float, weight_decay: float, fused: bool
) -> torch.optim.Optimizer:
    """``sgd`` (momentum), ``adamw`` or ``rmsprop`` (torchvision's: ``eps=0.0316``, ``alpha=0.9``, momentum) over
    ``groups``, each at ``lr * lr_scale``; ``fused`` for SGD and AdamW (RMSprop has no fused kernel)."""
    groups = [{**group, "lr": lr * group["lr_scale"]} for group in groups]
    extra: dict[str, Any] = {"fused": True} if fused and name != "rmsprop" else {}
    if name == "sgd":
        optimizer = torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, **extra)
        if fused and momentum != 0:
            # Fused SGD makes its buffers with empty_like, left garbage by a first step the gradient scaler skips.
            for group in groups:
                for p in group["params"]:
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return optimizer
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, **extra)
    return torch.optim.RMSprop(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, eps=0.0316, alpha=0.9)


def fused_by_default(name: str, device_type: str, apex: bool, gradient_clip_val: float | None) -> bool:
    """Whether ``name`` runs fused when not told: SGD and AdamW on CUDA, but under apex AMP (which manages the
    optimizer) or with gradient clipping (Lightning refuses to clip for an optimizer that unscales by itself)."""
    return name in ("sgd", "adamw") and device_type == "cuda" and not apex and not gradient_clip_val
