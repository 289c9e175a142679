"""lit_imagenet: train and fine-tune torchvision classifiers on ImageFolder data with PyTorch Lightning.

The package's folders are its layers, each importing only from those below it
(``tests/test_layout.py`` checks it)::

    cli, export        the command lines: train.py, python -m lit_imagenet.export
    callbacks/         what watches and keeps a run: checkpoints, pre-emption, guard, console, logs
    training/          the LightningModule and its parts: network, metrics, optimizer, schedule,
                       precision plugins, DDP strategies
    data/              from the folder to the batch: the scan and its index, decoding, crops,
                       samplers, datasets, nvJPEG, DALI, the prefetcher, the DataModule
    compat, errors     Lightning's private attributes; the user's errors

From Python, the pieces the command line puts together::

    dm = ImageFolderDataModule("data/shapes", batch_size=64, workers=2, crop_size=64, val_resize=72)
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, class_names=dm.classes)
    pl.Trainer(max_epochs=8, callbacks=default_callbacks(), logger=RunLogger("runs")).fit(model, dm)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from lit_imagenet.callbacks import PredictionWriter, RunLogger, default_callbacks
from lit_imagenet.callbacks.console import LearningRateLog, Throughput
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.prefetch import CUDAPrefetch
from lit_imagenet.data.synthetic import make_shapes
from lit_imagenet.errors import ConfigError, DataError, UserError
from lit_imagenet.training.module import ImageClassifier

__all__ = [
    "CUDAPrefetch",
    "ConfigError",
    "DataError",
    "ImageClassifier",
    "ImageFolderDataModule",
    "LearningRateLog",
    "PredictionWriter",
    "RunLogger",
    "Throughput",
    "UserError",
    "default_callbacks",
    "make_shapes",
]

# Where the modules of the package's first, flat layout went. Configs saved by earlier runs name classes by
# those paths (``lit_imagenet.monitoring.RunLogger``), and scripts import from them: both keep working.
_MOVED_MODULES = {
    "backbone": ("training.models",),
    "checkpointing": ("callbacks.checkpoints", "callbacks.preemption"),
    "dali": ("data.dali.loader", "data.dali.pipeline", "data.crops", "data.datamodule"),
    "datamodule": ("data.datamodule",),
    "datasets": ("data.datasets", "data.nvjpeg"),
    "ddp": ("training.strategies", "training.readback"),
    "decoders": ("data.datamodule",),
    "decoding": ("data.images", "data.nvjpeg"),
    "folders": ("data.folders",),
    "gpu_decode": ("data.nvjpeg",),
    "guard": ("callbacks.guard",),
    "host": ("training.readback",),
    "metrics": ("training.metrics",),
    "models": ("training.models",),
    "module": ("training.module",),
    "monitoring": ("callbacks.console", "callbacks.logs", "callbacks.profiling"),
    "optim": ("training.optim",),
    "precision": ("training.precision", "training.strategies"),
    "prefetch": ("data.prefetch",),
    "presets": ("data.presets",),
    "samplers": ("data.samplers",),
    "schedule": ("training.schedule",),
    "synthetic": ("data.synthetic",),
}
# Names the package itself exported in that layout, now found in the module that holds them.
_MOVED_NAMES = {
    "collate_uint8": "data.datasets",
    "PrefetchLoader": "data.prefetch",
    "Uint8Normalize": "data.presets",
    "WarmupMultiStep": "training.schedule",
    "scaled_lr": "training.schedule",
}


class _MovedModule(types.ModuleType):
    """An old module path whose names now live in several modules: each name is looked up in them in turn."""

    def __init__(self, name: str, targets: list[types.ModuleType]) -> None:
        super().__init__(name, f"Moved: its names are in {', '.join(t.__name__ for t in targets)}.")
        self._targets = targets

    def __getattr__(self, name: str) -> Any:
        for target in self._targets:
            if hasattr(target, name):
                return getattr(target, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")


def _register_moved_modules() -> None:
    package = sys.modules[__name__]
    for old, new in _MOVED_MODULES.items():
        targets = [importlib.import_module(f"{__name__}.{path}") for path in new]
        module = targets[0] if len(targets) == 1 else _MovedModule(f"{__name__}.{old}", targets)
        sys.modules.setdefault(f"{__name__}.{old}", module)
        setattr(package, old, sys.modules[f"{__name__}.{old}"])


def __getattr__(name: str) -> Any:
    if name in _MOVED_NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_MOVED_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_register_moved_modules()
