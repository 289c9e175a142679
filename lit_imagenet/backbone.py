"""A classifier as its head (the final ``nn.Linear``) and its backbone (the rest), and freezing the backbone.

Fine-tuning can train the head alone for the first epochs (``freeze_backbone_epochs``) and the
backbone at a smaller rate (``backbone_lr_scale``): both need the network's parameters in these two
parts, the head named by ``lit_imagenet.models.classifier_name``.
"""

from __future__ import annotations

from torch import nn


def head_parameters(network: nn.Module, head_name: str) -> list[nn.Parameter]:
    """Parameters of the classifier head, the submodule ``head_name``."""
    return list(network.get_submodule(head_name).parameters())


def backbone_parameters(network: nn.Module, head_name: str) -> list[nn.Parameter]:
    """Parameters of the network but its classifier head."""
    head = {id(p) for p in head_parameters(network, head_name)}
    return [p for p in network.parameters() if id(p) not in head]


def _backbone_batchnorms(network: nn.Module, head_name: str) -> list[nn.Module]:
    prefix = head_name + "."
    return [
        m
        for name, m in network.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not (name + ".").startswith(prefix)
    ]


def set_backbone_frozen(network: nn.Module, head_name: str, frozen: bool, training: bool) -> None:
    """Stops (or restarts) training of everything but the classifier head.

    Frozen parameters get no gradients, so SGD leaves them as they are (weight decay included),
    and the batchnorm layers are put in eval mode so that their running statistics, which the
    pretrained weights came with, are used and kept. Unfrozen, they follow ``training``.
    """
    for p in backbone_parameters(network, head_name):
        p.requires_grad_(not frozen)
    for m in _backbone_batchnorms(network, head_name):
        m.train(not frozen and training)
