"""lit_imagenet: train and fine-tune torchvision classifiers on ImageFolder data with PyTorch Lightning.

The package's folders are its layers, each importing only from those below it
(``tests/test_layout.py`` checks it)::

    cli, export        the command lines: train.py, python -m lit_imagenet.export
    callbacks/         what watches and keeps a run: checkpoints, pre-emption, guard, console, logs
    training/          the LightningModule and its parts: network, metrics, optimizer, schedule,
                       precision plugins, DDP strategies
    data/              from the folder to the batch: the scan and its index, decoding, crops,
                       samplers, datasets, nvJPEG, DALI, the prefetcher, the DataModule
    compat, errors     private attributes of Lightning and torch; the user's errors

From Python, the pieces the command line puts together::

    dm = ImageFolderDataModule("data/shapes", batch_size=64, workers=2, crop_size=64, val_resize=72)
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, class_names=dm.classes)
    pl.Trainer(max_epochs=8, callbacks=default_callbacks(), logger=RunLogger("runs")).fit(model, dm)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit_imagenet.callbacks import PredictionWriter, RunLogger, default_callbacks
    from lit_imagenet.callbacks.console import LearningRateLog, Throughput
    from lit_imagenet.data.datamodule import ImageFolderDataModule
    from lit_imagenet.data.prefetch import CUDAPrefetch
    from lit_imagenet.data.synthetic import make_shapes
    from lit_imagenet.errors import ConfigError, DataError, UserError
    from lit_imagenet.training.module import ImageClassifier

# Each public name's module, imported when the name is first used: ``python -m lit_imagenet.data.synthetic``
# then runs a module that the package has not imported already.
_PUBLIC = {
    "CUDAPrefetch": "data.prefetch",
    "ConfigError": "errors",
    "DataError": "errors",
    "ImageClassifier": "training.module",
    "ImageFolderDataModule": "data.datamodule",
    "LearningRateLog": "callbacks.console",
    "PredictionWriter": "callbacks",
    "RunLogger": "callbacks",
    "Throughput": "callbacks.console",
    "UserError": "errors",
    "default_callbacks": "callbacks",
    "make_shapes": "data.synthetic",
}

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


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
