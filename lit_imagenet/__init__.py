"""lit_imagenet: train and fine-tune torchvision classifiers on ImageFolder data with PyTorch Lightning; using it from
Python: README.md; its layers and modules: docs/design.md ("Packages")."""

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
