"""lit_imagenet: train and fine-tune torchvision classifiers on ImageFolder data with PyTorch Lightning.

The package's layers, each importing only from those below it (``tests/test_layout.py`` checks it)::

    cli, export        the command lines: train.py, python -m lit_imagenet.export
    callbacks/         what watches and keeps a run: checkpoints, pre-emption, guard, console, logs
    training/          the LightningModule and its parts: network, metrics, optimizer, schedule, precision, DDP
    data/              from the folder to the batch: the index, decoders, crops, samplers, DALI, the prefetcher
    compat, errors     private attributes of Lightning and torch; the user's errors

From Python, the pieces the command line puts together::

    dm = ImageFolderDataModule("data/shapes", batch_size=64, workers=2, crop_size=64, val_resize=72)
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, class_names=dm.classes)
    pl.Trainer(max_epochs=8, callbacks=default_callbacks(), logger=RunLogger("runs")).fit(model, dm)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lit_imagenet.callbacks import PredictionWriter, RunLogger, default_callbacks
from lit_imagenet.callbacks.console import LearningRateLog, Throughput
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.prefetch import CUDAPrefetch
from lit_imagenet.errors import ConfigError, DataError, UserError
from lit_imagenet.training.module import ImageClassifier

if TYPE_CHECKING:
    from lit_imagenet.data.synthetic import make_shapes

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
    # Imported on first use: ``python -m lit_imagenet.data.synthetic`` runs that module, which must not be loaded yet.
    if name == "make_shapes":
        from lit_imagenet.data.synthetic import make_shapes

        return make_shapes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
