"""Checkpoints for long runs: atomic writes, rolling step checkpoints, a save on pre-emption, ``--ckpt_path last``.

``AtomicCheckpointIO`` writes each checkpoint to a temporary file in the target folder, fsyncs it
and renames it over the target, so a crash, a kill or a full disk during the write leaves the
previous checkpoint intact; the next process's first save into that folder removes what a killed write left.
``StepCheckpoint`` saves ``last-step.ckpt`` every N optimizer steps and
when the process receives SIGTERM (Lightning turns SIGTERM into ``SIGTERMException`` at the end of
the current batch; this callback saves before the process exits). ``--ckpt_path last`` picks the
newest ``last*.ckpt`` of a run; ``find_last_checkpoint`` extends that to every version of the logs.

On SLURM's requeue signal (``lit_imagenet.callbacks.preemption``) every process stops after the same
training step and ``StepCheckpoint`` saves ``last-step.ckpt`` there.
"""

from __future__ import annotations

import base64
import errno
import os
import re
import signal
import time
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
from lit_imagenet.callbacks.preemption import REQUEUE_SIGNAL, RequeueSignal
from lit_imagenet.compat import last_checkpoint_saved, save_last_checkpoint

#: The name of a checkpoint's temporary file while it is written: ``.NAME.XXXXXXXX.tmp`` (``_unfinished_file``).
_UNFINISHED = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.tmp")
#: When this process began (close enough: before any checkpoint of its own was begun).
_STARTED = time.time()
#: The folders this process has removed unfinished writes from: a file a process left there before this one began
#: is found by the first listing, so a folder is listed once, not at every save.
_SWEPT: set[str] = set()


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the file, and the previous one is kept."""


def remove_unfinished_writes(folder: str) -> list[tuple[str, int]]:
    """Removes the temporary files of checkpoint writes in ``folder`` that a process ended before it finished them
    (killed mid-write: SIGKILL after a pre-emption's grace period, say), with one line each; the paths and sizes.

    Only a file last written before this process began is taken to be such a file: one written since may be a
    write under way in another process.
    """
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        if not _UNFINISHED.fullmatch(entry.name):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if not entry.is_file(follow_symlinks=False) or info.st_mtime >= _STARTED:
                continue
            os.remove(entry.path)
        except OSError:
            continue
        removed.append((entry.path, info.st_size))
        rank_zero_info(
            f"Removed {entry.path} ({info.st_size:,} bytes): the unfinished write of a checkpoint, by a process "
            "that ended during it."
        )
    return removed


def _unfinished_file(path: str) -> tuple[int, str]:
    """A new file ``.NAME.XXXXXXXX.tmp`` beside ``path``, open for writing: the descriptor and the name.

    Its mode is what the umask gives a new file (as Lightning's writer and ``torch.save`` to a path give), not the
    owner-only mode of ``tempfile.mkstemp``: a checkpoint in a group's shared folder stays readable by the group.
    """
    folder, name = os.path.split(path)
    while True:
        tag = base64.b32encode(os.urandom(5)).decode().lower()  # 8 characters of a-z and 2-7
        tmp = os.path.join(folder, f".{name}.{tag}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), tmp
        except FileExistsError:
            continue


def _fsync_dir(folder: str) -> None:
    # The rename is durable only once the directory entry is on disk; not every system allows this.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves checkpoints all-or-nothing on local disks: temporary file, fsync, ``os.replace``.

    Lightning's own writer first serialises the whole checkpoint into memory (a second copy of it),
    then writes through an fsspec transaction, whose temporary file for a local path can lie on
    another file system than the target, where the final move is a copy, not an atomic rename; it
    does not fsync. Here ``torch.save`` streams into a hidden ``.NAME.XXXX.tmp`` in the target's own
    folder, which is fsynced and then renamed over the target, so a process killed mid-write, or a
    full disk, leaves the previous checkpoint intact. The temporary file that a killed process left
    is removed by the next process's first save into that folder (``remove_unfinished_writes``). Remote paths (``s3://``
    ...) use Lightning's writer.
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`. Please implement your custom `CheckpointIO`"
                " to define how you'd like to use `storage_options`."
            )
        if "://" in str(path) and not str(path).startswith("file://"):
            super().save_checkpoint(checkpoint, path)
            return
        path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        if folder not in _SWEPT:
            remove_unfinished_writes(folder)
            _SWEPT.add(folder)
        fd, tmp = _unfinished_file(path)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            try:
                os.remove(tmp)
            except OSError:
                pass
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CheckpointWriteError(
                    err.errno,
                    f"No space left to write checkpoint {path} ({os.strerror(err.errno)}); the previous checkpoint "
                    "there is kept. Free disk space or point --trainer.default_root_dir at a larger disk, then resume.",
                ) from None
            raise
        _fsync_dir(folder)


def use_atomic_checkpoint_io(trainer: pl.Trainer) -> None:
    """Makes the trainer's strategy write checkpoints with ``AtomicCheckpointIO``.

    Only Lightning's default writer is replaced: a ``CheckpointIO`` given with ``--trainer.plugins``
    (an async or remote writer, say) is left as it is.
    """
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
    """Makes the run write its checkpoints with ``AtomicCheckpointIO`` (``use_atomic_checkpoint_io``), from ``setup``.

    For a ``Trainer`` made by hand; the command line installs the writer itself.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        use_atomic_checkpoint_io(trainer)


class StepCheckpoint(ModelCheckpoint):
    """Saves ``last-step.ckpt`` every ``every_n_train_steps`` optimizer steps, on SIGTERM and on SLURM's requeue signal.

    The file is overwritten each time (it is the rolling "where was I" of a long run, next to the
    best and ``last`` checkpoints of the ``checkpoint`` callback); ``--ckpt_path last`` resumes from
    whichever of them is newest, mid-epoch included. When ``catch_requeue_signal`` has taken the
    requeue signal, every process asks after each optimizer step whether any of them has received
    it (one all-reduce of a flag), so that all stop after the same step.

    Args:
        every_n_train_steps: Save every this many optimizer steps; 0 saves only on a signal.
        save_on_sigterm: Save when the process gets SIGTERM (pre-emption, ``scancel``, a cluster's
            time limit) before it exits.
        dirpath: Folder of the checkpoint; ``None``: the ``checkpoints`` folder of the run's logs.
    """

    CHECKPOINT_NAME_LAST = "last-step"

    def __init__(self, every_n_train_steps: int = 0, save_on_sigterm: bool = True, dirpath: str | None = None) -> None:
        if every_n_train_steps < 0:
            raise ValueError(f"every_n_train_steps must not be negative. Got {every_n_train_steps}")
        super().__init__(
            dirpath=dirpath,
            monitor=None,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            enable_version_counter=False,
        )
        self.save_on_sigterm = save_on_sigterm
        self._requeue = False
        self._requeue_asked_at = -1

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._requeue = preemption.requeue_handler_installed()
        if self._requeue and (stage != "fit" or not preemption.slurm_requeues(trainer)):
            # Not training, or auto-requeue turned off: the signal does what Lightning makes of it.
            signal.signal(REQUEUE_SIGNAL, signal.SIG_DFL)
            self._requeue = False

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # Without it, a run resumed from the last step of an epoch would save checkpoints that look like
        # the end of an epoch, and a run resumed from one of them would do that epoch again from its start.
        compat.count_epoch_as_started(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # Once per optimizer step (not between the batches it accumulates), on every process alike.
        if not self._requeue or trainer.global_step == self._requeue_asked_at:
            return
        self._requeue_asked_at = trainer.global_step
        if trainer.strategy.reduce_boolean_decision(preemption.requeue_signalled(), all=False):
            raise RequeueSignal()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not (self.save_on_sigterm and isinstance(exception, SIGTERMException)):
            return
        if trainer.sanity_checking or trainer.global_step == 0:
            return
        saved = last_checkpoint_saved(self)
        if saved is None or saved[1] != trainer.global_step:  # not saved at this very step already
            save_last_checkpoint(self, trainer)
        cause = "Requeue signal" if isinstance(exception, RequeueSignal) else "SIGTERM"
        rank_zero_info(f"{cause}: saved {self.last_model_path} at step {trainer.global_step}.")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # ModelCheckpoint writes its "last" file at the end of training if it has not yet; the end of a
        # run is the ``checkpoint`` callback's last.ckpt already, so this one would be a second copy.
        pass


def find_last_checkpoint(root: str | os.PathLike[str]) -> str | None:
    """The newest ``last*.ckpt`` under ``root`` (every logger version of a run), or ``None``."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [p for p in root.rglob("last*.ckpt") if p.is_file()]
    if not found:
        return None
    return str(max(found, key=lambda p: p.stat().st_mtime_ns))
