"""Every private attribute of Lightning (and torch) the package reads, and every change it makes to Lightning's loop
progress, each behind one function; a missing one raises ``LightningCompatError`` naming it and the versions."""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import LayerSync
from pytorch_lightning.strategies import DDPStrategy, ParallelStrategy
from torch import nn
from torchmetrics import Metric

#: The pytorch-lightning minor versions the test suite passes with; ``setup.cfg`` allows these only.
TESTED_VERSIONS = ("2.6",)

_Method = TypeVar("_Method", bound=Callable[..., Any])
#: ``(Lightning class, hook name)`` of every private hook overridden in the modules imported so far.
PRIVATE_OVERRIDES: list[tuple[type, str]] = []


class LightningCompatError(AttributeError):
    """The installed Lightning (or torch) lacks a private attribute that the package reads."""


def _incompatible(package: str, what: str) -> LightningCompatError:
    tested = f"; it is tested with pytorch-lightning {', '.join(TESTED_VERSIONS)}" if package != "torch" else ""
    version = importlib.metadata.version(package)
    return LightningCompatError(f"{package} {version} {what} (lit_imagenet/compat.py){tested}.")


def _private(obj: Any, name: str, owner: str, package: str = "pytorch-lightning") -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _incompatible(package, f"has no {owner}.{name}, which lit_imagenet reads") from None


def untested_version_warning(version: str | None = None) -> str | None:
    """The warning for a pytorch-lightning ``version`` (``None``: the installed one) not tested, or ``None``."""
    version = pl.__version__ if version is None else version
    tested = ".".join(version.split(".")[:2]) in TESTED_VERSIONS
    return None if tested else f"warning: pytorch-lightning {version} is untested; tested: {', '.join(TESTED_VERSIONS)}"


def overrides_private(base: type) -> Callable[[_Method], _Method]:
    """Marks a method that overrides the private hook of the same name in ``base`` (``PRIVATE_OVERRIDES``)."""

    def mark(method: _Method) -> _Method:
        PRIVATE_OVERRIDES.append((base, method.__name__))
        return method

    return mark


def writes_log_line(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes step metrics after the current training batch (every ``log_every_n_steps``)."""
    return bool(_private(trainer, "_logger_connector", "Trainer").should_update_logs)


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step Lightning writes the current batch's logs at: optimizer steps taken before this batch's."""
    return int(_private(trainer.fit_loop.epoch_loop, "_batches_that_stepped", "_TrainingEpochLoop"))


def accumulates_gradients(trainer: pl.Trainer) -> bool:
    """Whether the current training batch only accumulates gradients: no optimizer step follows it."""
    return bool(_private(trainer.fit_loop.epoch_loop, "_should_accumulate", "_TrainingEpochLoop")())


def last_checkpoint_saved(callback: ModelCheckpoint) -> tuple[str, int] | None:
    """``(path, global step)`` of the checkpoint ``callback`` wrote last, or ``None`` before its first."""
    path = _private(callback, "_last_checkpoint_saved", "ModelCheckpoint")
    step = _private(callback, "_last_global_step_saved", "ModelCheckpoint")
    return (str(path), int(step)) if path else None


def save_last_checkpoint(callback: ModelCheckpoint, trainer: pl.Trainer) -> None:
    """Makes ``callback`` write its ``last`` checkpoint now, as it does at its own saving points."""
    candidates = _private(callback, "_monitor_candidates", "ModelCheckpoint")(trainer)
    _private(callback, "_save_last_checkpoint", "ModelCheckpoint")(trainer, candidates)


def ddp_kwargs(strategy: DDPStrategy) -> dict[str, Any]:
    """The keyword arguments the strategy passes to ``DistributedDataParallel``."""
    return dict(_private(strategy, "_ddp_kwargs", "DDPStrategy"))


def layer_sync(strategy: ParallelStrategy) -> LayerSync | None:
    """The strategy's batch-norm synchronisation (``--trainer.sync_batchnorm true``), or ``None``."""
    return _private(strategy, "_layer_sync", "ParallelStrategy")


def attached_trainer(module: nn.Module) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or ``None`` (``LightningModule.trainer`` raises without one)."""
    if isinstance(module, pl.LightningModule):
        return _private(module, "_trainer", "LightningModule")
    return getattr(module, "_trainer", None)


def metric_defaults(metric: Metric) -> dict[str, Any]:
    """A torchmetrics metric's states as ``reset()`` leaves them, by name (``metric`` itself keeps its states)."""
    fresh = metric.clone()
    fresh.reset()
    return dict(fresh.metric_state)


def skip_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stops this run's broadcast of rank 0's SIGTERM flag before each batch (a host sync); the caller tells ranks."""
    loop = trainer.fit_loop.epoch_loop
    _private(loop, "_broadcast_sigterm_tensor", "_TrainingEpochLoop")
    loop._broadcast_sigterm_tensor = lambda: None  # an instance attribute: this loop only


def mark_sigterm(trainer: pl.Trainer) -> None:
    """Marks the process as having received SIGTERM, as Lightning's handler does: training stops after this batch."""
    connector = _private(trainer, "_signal_connector", "Trainer")
    _private(connector, "received_sigterm", "_SignalConnector")
    connector.received_sigterm = True


def count_epoch_as_started(trainer: pl.Trainer) -> None:
    """Counts the current epoch as started if Lightning has not (after a resume from its last step), so that a
    checkpoint inside the epoch does not look like one at its end."""
    progress = trainer.fit_loop.epoch_progress
    if progress.current.started <= progress.current.processed:
        progress.increment_ready()
        progress.increment_started()


def epoch_batches_done(trainer: pl.Trainer) -> int:
    """The training batches of the current epoch that the fit loop counts as processed (restored on a resume)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def shift_epoch_batches(trainer: pl.Trainer, batches: int) -> None:
    """Moves the fit loop's batch counts of the epoch and run by ``batches`` (to a resumed run's grid of batches)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counts in (progress.current, progress.total):
        for name in ("ready", "started", "processed", "completed"):
            setattr(counts, name, getattr(counts, name) + batches)


def stop_workers(iterator: Any) -> None:
    """Stops the worker processes of a multi-process ``DataLoader`` iterator, as its own end would."""
    _private(iterator, "_shutdown_workers", "_MultiProcessingDataLoaderIter", package="torch")()


def user_inductor_cache_dir() -> str | None:
    """``TORCHINDUCTOR_CACHE_DIR`` as the user set it; ``None`` when unset or holding inductor's own default."""
    value = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if value is None:
        return None
    try:
        utils: Any = importlib.import_module("torch._inductor.runtime.cache_dir_utils")
    except ImportError:
        utils = None  # named by the error below
    default = _private(utils, "default_cache_dir", "torch._inductor.runtime.cache_dir_utils", "torch")()
    return None if os.path.abspath(value) == os.path.abspath(default) else value


def run_after_closure(plugin: pl.plugins.Precision, model: pl.LightningModule, optimizer: Any) -> None:
    """Runs a precision plugin's steps after the training closure (``on_before_optimizer_step``, clipping)."""
    _private(plugin, "_after_closure", "Precision")(model, optimizer)


def record_cut_epoch_as_unfinished(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> bool:
    """Records in ``checkpoint`` the current epoch as unfinished when it stopped before its last batch (``max_steps``,
    ``should_stop``): Lightning counts it as done, and a resumed run would skip its rest. Returns whether it did."""
    fit = checkpoint.get("loops", {}).get("fit_loop")
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    if not fit or last or epoch_batches_done(trainer) >= trainer.num_training_batches:
        return False
    try:
        current, total_counts = fit["epoch_progress"]["current"], fit["epoch_progress"]["total"]
        if current["processed"] < current["started"]:
            return False  # saved inside the epoch: unfinished already
        for counts in (current, total_counts):
            counts["processed"] = counts["completed"] = counts["started"] - 1
    except (KeyError, TypeError):
        what = "saves the fit loop's epoch progress in another form than lit_imagenet reads"
        raise _incompatible("pytorch-lightning", what) from None
    checkpoint["epoch"] = current["completed"]
    return True
