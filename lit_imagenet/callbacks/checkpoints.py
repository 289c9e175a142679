"""Checkpoints for long runs: atomic writes, rolling step checkpoints, saves on SIGTERM and SLURM's requeue signal."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_imagenet import compat
from lit_imagenet.callbacks import preemption
from lit_imagenet.callbacks.preemption import RequeueSignal

#: A checkpoint's temporary file while it is written (``_unfinished_file``).
_UNFINISHED = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")
#: When this process began: a temporary file older than this was left by a process killed mid-write.
_STARTED = time.time()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the file, and the previous one is kept."""


def remove_unfinished_writes(folder: str) -> None:
    """Removes, with one line each, the temporary files older than this process (a newer one may be another's write)
    that processes killed mid-write left in ``folder``."""
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in (e for e in entries if _UNFINISHED.fullmatch(e.name) and e.is_file(follow_symlinks=False)):
            with contextlib.suppress(OSError):
                if (info := entry.stat(follow_symlinks=False)).st_mtime < _STARTED:
                    os.remove(entry.path)
                    rank_zero_info(f"Removed {entry.path} ({info.st_size:,} bytes): the unfinished write of a "
                                   "checkpoint, by a process that ended during it.")  # fmt: skip


def _unfinished_file(path: str) -> tuple[int, str]:
    """A new file ``.NAME.XXXXXXXX.tmp`` beside ``path``, open for writing, with the mode the umask gives (unlike
    ``tempfile.mkstemp``'s owner-only one); returns the descriptor and the name."""
    folder, name = os.path.split(path)
    while True:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
        with contextlib.suppress(FileExistsError):
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves local checkpoints all-or-nothing (temporary file, fsync, ``os.replace``); remote paths use Lightning's.

    Raises:
        CheckpointWriteError: The disk or quota is full.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or ("://" in str(path) and not str(path).startswith("file://")):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        remove_unfinished_writes(folder)
        fd, tmp = _unfinished_file(path)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CheckpointWriteError(
                    err.errno,
                    f"No space left to write checkpoint {path} ({os.strerror(err.errno)}); the previous checkpoint "
                    "there is kept. Free disk space or point --trainer.default_root_dir at a larger disk, then resume.",
                ) from None
            raise
        # The rename is durable only once the directory entry is on disk; not every system allows this.
        with contextlib.suppress(OSError):
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def use_atomic_checkpoint_io(trainer: pl.Trainer) -> None:
    """Makes the trainer write checkpoints with ``AtomicCheckpointIO``, unless the user gave a ``CheckpointIO``."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()


#: The ``checkpoint`` callback's settings (``--checkpoint.*``): the best by validation top-1, and ``last.ckpt``.
BEST_CHECKPOINT: dict[str, Any] = {
    "monitor": "val/top1",
    "mode": "max",
    "save_last": True,
    "filename": "epoch{epoch:03d}-top1{val/top1:.4f}",
    "auto_insert_metric_name": False,
}


class AtomicCheckpoints(pl.Callback):
    """Makes a ``Trainer`` made by hand write its checkpoints with ``AtomicCheckpointIO``."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        use_atomic_checkpoint_io(trainer)


class BestCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is written at every training epoch's end, also when the
    best did not improve (a resume from a stale ``last.ckpt`` would train an epoch again)."""

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After the epoch's validation, wherever Lightning saves; an epoch cut before any (max_steps, max_time) has no
        # best to rank, only the last.ckpt below, and no warning that the metric is missing.
        if self.monitor is None or self.monitor in trainer.callback_metrics:
            super().on_train_epoch_end(trainer, pl_module)
        if not self.save_last or trainer.sanity_checking or trainer.fast_dev_run:
            return
        saved = compat.last_checkpoint_saved(self)
        if saved is None or saved[1] != trainer.global_step:
            compat.save_last_checkpoint(self, trainer)


class StepCheckpoint(ModelCheckpoint):
    """Overwrites ``last-step.ckpt`` every ``train_time_interval`` (or ``every_n_train_steps``), on SIGTERM and on
    SLURM's requeue signal (every process then stops after the same optimizer step).

    Args:
        every_n_train_steps: Save every this many optimizer steps instead of every ``train_time_interval``; 0: by time.
        train_time_interval: Time between saves (``H:MM:SS``), checked on optimizer steps (log steps under DDP);
            ``None`` with ``every_n_train_steps`` 0: only on a signal.
        save_on_sigterm: Save when the process gets SIGTERM, before it exits.
        dirpath: Folder of the checkpoint; ``None``: the ``checkpoints`` folder of the run's logs.
    """

    CHECKPOINT_NAME_LAST = "last-step"

    def __init__(
        self,
        every_n_train_steps: int = 0,
        train_time_interval: timedelta | None = timedelta(minutes=15),
        save_on_sigterm: bool = True,
        dirpath: str | None = None,
    ) -> None:
        if train_time_interval is not None and train_time_interval <= timedelta(0):
            raise ValueError(f"train_time_interval must be positive. Got {train_time_interval}")
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            # Lightning takes one of the two: a step count given replaces the time.
            train_time_interval=None if every_n_train_steps else train_time_interval,
            enable_version_counter=False,
        )
        self.save_on_sigterm = save_on_sigterm
        self._by_steps = every_n_train_steps > 0
        self._requeue_asked_at = -1

    @property
    @override
    def state_key(self) -> str:
        # One per trainer; Lightning's key holds the interval, so a resume with another would lose the state.
        return type(self).__qualname__

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._requeue = preemption.requeues_on_signal(trainer, stage)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        # Else a run resumed from an epoch's last step saves checkpoints that look like an epoch's end.
        compat.count_epoch_as_started(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning's clock check broadcasts rank 0's decision, which waits for the GPU under DDP: on log steps only.
        if self._by_steps or trainer.world_size == 1 or trainer.global_step % max(1, trainer.log_every_n_steps) == 0:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # Once per optimizer step (not between the batches it accumulates), on every process alike.
        if not self._requeue or trainer.global_step == self._requeue_asked_at:
            return
        self._requeue_asked_at = trainer.global_step
        if trainer.strategy.reduce_boolean_decision(preemption.requeue_signalled(), all=False):
            raise RequeueSignal()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        signalled = self.save_on_sigterm and isinstance(exception, SIGTERMException)
        if not signalled or trainer.sanity_checking or trainer.global_step == 0:
            return
        saved = compat.last_checkpoint_saved(self)
        if saved is None or saved[1] != trainer.global_step:  # not saved at this very step already
            compat.save_last_checkpoint(self, trainer)
        cause = "Requeue signal" if isinstance(exception, RequeueSignal) else "SIGTERM"
        rank_zero_info(f"{cause}: saved {self.last_model_path} at step {trainer.global_step}.")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # the end of a run is the ``checkpoint`` callback's last.ckpt already


def find_last_checkpoint(*roots: str | os.PathLike[str]) -> str | None:
    """The newest ``last*.ckpt`` under ``roots`` (every logger version of a run), or ``None``."""
    found = [p for root in roots for p in Path(root).rglob("last*.ckpt") if p.is_file()]
    return str(max(found, key=lambda p: p.stat().st_mtime_ns)) if found else None
