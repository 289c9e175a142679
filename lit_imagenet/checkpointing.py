"""Checkpoints for long runs: atomic writes, rolling step checkpoints, a save on pre-emption.

``AtomicCheckpointIO`` writes each checkpoint to a temporary file in the target folder, fsyncs it
and renames it over the target, so a crash, a kill or a full disk during the write leaves the
previous checkpoint intact. ``StepCheckpoint`` saves ``last-step.ckpt`` every N optimizer steps and
when the process receives SIGTERM (Lightning turns SIGTERM into ``SIGTERMException`` at the end of
the current batch; this callback saves before the process exits). ``--ckpt_path last`` picks the
newest ``last*.ckpt`` of a run; ``find_last_checkpoint`` extends that to every version of the logs.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins.io import TorchCheckpointIO
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_imagenet import compat
from lit_imagenet.compat import last_checkpoint_saved, save_last_checkpoint
from lit_imagenet.ddp import DelayedMax


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the file, and the previous one is kept."""


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
    full disk, leaves the previous checkpoint intact. Remote paths (``s3://`` ...) use Lightning's
    writer.
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
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
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


class StepCheckpoint(ModelCheckpoint):
    """Saves ``last-step.ckpt`` every ``every_n_train_steps`` optimizer steps, and on SIGTERM.

    The file is overwritten each time (it is the rolling "where was I" of a long run, next to the
    best and ``last`` checkpoints of the ``checkpoint`` callback); ``--ckpt_path last`` resumes from
    whichever of them is newest, mid-epoch included.

    Args:
        every_n_train_steps: Save every this many optimizer steps; 0 saves only on SIGTERM.
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

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not (self.save_on_sigterm and isinstance(exception, SIGTERMException)):
            return
        if trainer.sanity_checking or trainer.global_step == 0:
            return
        saved = last_checkpoint_saved(self)
        if saved is None or saved[1] != trainer.global_step:  # not saved at this very step already
            save_last_checkpoint(self, trainer)
        rank_zero_info(f"SIGTERM: saved {self.last_model_path} at step {trainer.global_step}.")

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


class SigtermConsensus(pl.Callback):
    """Under DDP, stops every rank at the same batch when any of them gets SIGTERM.

    Lightning's own handling, which this replaces in multi-process runs, broadcasts from inside the
    signal handler and again before every batch, and a signalled rank stops at the end of its own
    batch: a rank that gets the signal one batch later than another (rank 0 forwards it to the
    ranks it started, which takes a moment; a scheduler signals each rank on its own) is then in a
    different collective from the others, and the run hangs instead of saving. The per-batch
    broadcast also makes the host wait for the GPU at every step.

    Here the signal handler only notes the signal. Every ``check_every_n_steps`` batches (by default
    on Lightning's log steps) the ranks take the maximum of their notes without waiting for the GPU
    (``DelayedMax``); when a check reports a signal, every rank marks it for Lightning at the same
    batch, so they stop together and ``StepCheckpoint`` saves ``last-step.ckpt``. The run stops up to
    twice that many batches after the signal; at the end of an epoch the check waits for the result.
    Single-process runs keep Lightning's own handling.

    Args:
        check_every_n_steps: Check every this many batches; ``None``: on Lightning's log steps.
    """

    def __init__(self, check_every_n_steps: int | None = None) -> None:
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be at least 1. Got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps
        self._active = False
        self._signalled = False
        self._flag: torch.Tensor | None = None
        self._max: DelayedMax | None = None
        self._in_flight: int | None = None
        self._batches = 0

    def _handler(self, trainer: pl.Trainer) -> Any:
        def note(signum: int, frame: Any) -> None:
            if not self._signalled:
                print(f"[rank {trainer.global_rank}] Received SIGTERM; every rank stops at the next check.",
                      file=sys.stderr, flush=True)  # fmt: skip
            self._signalled = True

        return note

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._active = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        if not self._active:
            return
        self._signalled = False
        self._flag = torch.zeros(1, dtype=torch.int64, device=pl_module.device)
        self._max = DelayedMax(1, pl_module.device)
        self._in_flight = None
        self._batches = 0
        # Lightning puts its own handlers back when the run ends.
        signal.signal(signal.SIGTERM, self._handler(trainer))
        compat.skip_sigterm_broadcast(trainer)

    def _start(self) -> int:
        assert self._flag is not None and self._max is not None
        self._flag.fill_(int(self._signalled))
        return self._max.start(self._flag)

    def _stop_if_signalled(self, trainer: pl.Trainer, slot: int) -> None:
        assert self._max is not None
        if self._max.read(slot)[0]:
            compat.mark_sigterm(trainer)  # Lightning stops every rank at the end of this batch

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        self._batches += 1
        every = self.check_every_n_steps
        if (self._batches % every == 0) if every else compat.writes_log_line(trainer):
            previous, self._in_flight = self._in_flight, self._start()
            if previous is not None:
                self._stop_if_signalled(trainer, previous)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._in_flight = None
            self._stop_if_signalled(trainer, self._start())
