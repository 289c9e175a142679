"""torchvision classifiers by name, with weights from torchvision or a local file, split into head and backbone."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torchvision
from torch import Tensor, nn

_PREFIXES = ("model.", "module.", "_orig_mod.")
_FILE_ENDS = (".pt", ".pth", ".ckpt", ".tar", ".bin")
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def classifier_name(model: nn.Module) -> str:
    """Dotted name of the model's final ``nn.Linear``, the classifier head."""
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(model).__name__} has no nn.Linear classifier head to replace.")
    return names[-1]


def extract_state_dict(obj: object, source: str = "the weights file") -> dict[str, Tensor]:
    """The network's parameters from a loaded file, with ``model.``/``module.``/``_orig_mod.`` prefixes removed."""
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
        if any(str(k).startswith("model.") for k in obj):  # this project's checkpoint: the network only
            obj = {k: v for k, v in obj.items() if str(k).startswith("model.")}
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError(f"{source} holds no state dict of tensors; give a state dict or a checkpoint.")
    state: dict[str, Tensor] = {}
    for key, value in obj.items():
        while key.startswith(_PREFIXES):
            key = key.partition(".")[2]
        state[key] = value
    return state


def load_weights_file(model: nn.Module, path: str | Path) -> None:
    """Loads a state dict or checkpoint file into ``model``, but the head's keys of another shape. Anything else that
    does not fit raises ``ValueError`` naming the keys."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Weights file {path} does not exist; give a torchvision weights name or a file path.")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(f"Cannot load weights file {path} safely ({err}); it must be a file of tensors.") from None
    state = extract_state_dict(obj, str(path))
    own, head = model.state_dict(), classifier_name(model) + "."
    skipped = [key for key in state if key in own and state[key].shape != own[key].shape]
    for key in skipped:
        if not key.startswith(head):
            raise ValueError(
                f"{path}: {key} has shape {tuple(state[key].shape)} but the model needs {tuple(own[key].shape)}; "
                "was it saved from another architecture?"
            )
        del state[key]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in skipped]
    if missing or unexpected:
        pairs = (("missing", missing), ("unexpected", unexpected))
        detail = [f"{kind} {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}" for kind, keys in pairs if keys]
        raise ValueError(f"{path} does not fit {type(model).__name__} ({'; '.join(detail)}); check --model.arch.")


def build_model(arch: str, num_classes: int, weights: str | None = None) -> nn.Module:
    """The torchvision classifier ``arch`` (``resnet50``) with ``num_classes`` outputs and ``weights``: ``None``
    (random), a torchvision weights name (``IMAGENET1K_V2``, ``DEFAULT``, ``ResNet50_Weights.IMAGENET1K_V2``) or a file.
    """
    names = sorted(torchvision.models.list_models(module=torchvision.models))
    if arch not in names:
        raise ValueError(f"Unknown architecture {arch!r}; choose one of torchvision's: {', '.join(names)}.")
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1. Got {num_classes}")
    if weights is None or Path(weights).exists() or "/" in weights or weights.endswith(_FILE_ENDS):
        model = torchvision.models.get_model(arch, num_classes=num_classes)
        if weights is not None:
            load_weights_file(model, weights)
        return model
    try:
        tv_weights = torchvision.models.get_model_weights(arch)[weights.split(".")[-1]]  # DEFAULT: an alias member
    except (KeyError, ValueError):
        choices = ", ".join(["DEFAULT", *(w.name for w in torchvision.models.get_model_weights(arch))])
        raise ValueError(f"{arch} has no torchvision weights {weights!r}; use one of {choices} or a path.") from None
    model = torchvision.models.get_model(arch, weights=tv_weights)
    name = classifier_name(model)
    old = model.get_submodule(name)
    if old.out_features != num_classes:  # a new head for this number of classes
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, nn.Linear(old.in_features, num_classes, bias=old.bias is not None))
    return model


def backbone_parameters(network: nn.Module, head_name: str) -> list[nn.Parameter]:
    """Parameters of the network but its classifier head, the submodule ``head_name``."""
    head = {id(p) for p in network.get_submodule(head_name).parameters()}
    return [p for p in network.parameters() if id(p) not in head]


def set_backbone_frozen(network: nn.Module, head_name: str, frozen: bool, training: bool) -> None:
    """Stops (or restarts) training of all but the head: no gradients, batch norms in eval mode (else ``training``)."""
    for p in backbone_parameters(network, head_name):
        p.requires_grad_(not frozen)
    for name, m in network.named_modules():
        if isinstance(m, BATCH_NORMS) and not (name + ".").startswith(head_name + "."):
            m.train(not frozen and training)
