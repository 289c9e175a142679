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
    lean_imports       what train.py's launch leaves out of torchmetrics' imports

From Python, the pieces the command line puts together::

    dm = ImageFolderDataModule("data/shapes", batch_size=64, workers=2, crop_size=64, val_resize=72)
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, class_names=dm.classes)
    pl.Trainer(max_epochs=8, callbacks=default_callbacks(), logger=RunLogger("runs")).fit(model, dm)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lit_imagenet.callbacks import PredictionWriter, RunLogger, default_callbacks
    from lit_imagenet.callbacks.console import LearningRateLog, Throughput
    from lit_imagenet.data.datamodule import ImageFolderDataModule
    from lit_imagenet.data.prefetch import CUDAPrefetch
    from lit_imagenet.data.synthetic import make_shapes
    from lit_imagenet.errors import ConfigError, DataError, UserError
    from lit_imagenet.training.module import ImageClassifier

# The package's names and the module of each, imported when a name is first asked for: ``import lit_imagenet``
# itself loads neither torch nor Lightning, so that ``train.py`` can start the scan of the data folder
# (``lit_imagenet.data.prescan``) before those imports.
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


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path when it is first named, as the module (or modules) that hold its names now.

    Nothing is imported before: ``import lit_imagenet`` loads only what its own names need, and
    ``python -m lit_imagenet.data.synthetic`` finds its module not yet imported.
    """

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, old = fullname.partition(".")
        if package != __name__ or old not in _MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        old = spec.name.partition(".")[2]
        targets = [importlib.import_module(f"{__name__}.{path}") for path in _MOVED_MODULES[old]]
        if len(targets) > 1:
            return _MovedModule(spec.name, targets)
        self._specs[targets[0].__name__] = targets[0].__spec__
        return targets[0]

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the names are those of the modules it stands for. A module that now lives under
        another name keeps its own ``__spec__``, which the import system set to the old name's."""
        if module.__name__ in self._specs:
            module.__spec__ = self._specs[module.__name__]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value  # found directly from now on
        return value
    if name in _MOVED_NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_MOVED_NAMES[name]}"), name)
    if name in _MOVED_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
