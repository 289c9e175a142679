"""``python -m lit_imagenet.export CHECKPOINT OUT_DIR``: a trained classifier for use without this project."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from lit_imagenet.data.presets import IMAGENET_MEAN, IMAGENET_STD
from lit_imagenet.training.models import build_model, extract_state_dict


def load_network(checkpoint_path: str | Path, weights: Literal["raw", "ema"] = "raw") -> tuple[nn.Module, dict]:
    """The torchvision network of a checkpoint of this project (eval mode, on the CPU), with its trained (``raw``)
    or averaged (``ema``) weights, and its hyperparameters."""
    path = Path(checkpoint_path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {path} does not exist; give the .ckpt file written by training.")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    if not hparams or "arch" not in hparams or "state_dict" not in ckpt:
        raise ValueError(f"{path} is not a checkpoint of this project (no hyperparameters); export needs one.")
    if weights not in ("raw", "ema"):
        raise ValueError(f"weights must be 'raw' or 'ema'. Got {weights!r}")
    state = {k.removeprefix("ema.module."): v for k, v in ckpt["state_dict"].items() if k.startswith("ema.module.")}
    if weights == "ema" and not state:
        raise ValueError(f"{path} holds no EMA weights (trained with --model.ema_decay 0); export its raw weights.")
    network = build_model(hparams["arch"], hparams["num_classes"])
    network.load_state_dict(extract_state_dict(state if weights == "ema" else ckpt, str(path)))
    return network.eval(), dict(hparams)


def export(
    checkpoint_path: str, out_dir: str, image_size: int = 224, weights: Literal["raw", "ema"] = "raw"
) -> dict[str, Path]:
    """Writes the network of ``checkpoint_path`` (a ``.ckpt`` of ``train.py fit``) to ``out_dir`` as
    ``<arch>_state_dict.pth`` (torchvision's keys), ``<arch>.pt2`` (a ``torch.export`` program for any batch of
    ``image_size`` squared images: the training crop size) and ``<arch>.json`` (classes, input size, mean and std);
    returns their paths under the keys ``state_dict``, ``program`` and ``metadata``. ``weights``: the trained
    (``raw``) or averaged (``ema``, of a run with ``--model.ema_decay``) weights."""
    network, hparams = load_network(checkpoint_path, weights)
    arch, out = hparams["arch"], Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ends = {"state_dict": "_state_dict.pth", "program": ".pt2", "metadata": ".json"}
    paths = {key: out / f"{arch}{end}" for key, end in ends.items()}
    torch.save(network.state_dict(), paths["state_dict"])
    example, batch = torch.randn(2, 3, image_size, image_size), torch.export.Dim("batch", min=1, max=4096)
    with torch.no_grad():
        program = torch.export.export(network, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, paths["program"])
    metadata = {
        "arch": arch,
        "weights": weights,
        "num_classes": hparams["num_classes"],
        "class_names": hparams.get("class_names"),
        "input": f"float32 (N, 3, {image_size}, {image_size}), RGB in [0, 1] normalised with mean and std",
        "mean": list(IMAGENET_MEAN),
        "std": list(IMAGENET_STD),
    }
    paths["metadata"].write_text(json.dumps(metadata, indent=2))
    for path in paths.values():
        print(f"Wrote {path}", flush=True)
    return paths


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(export)
