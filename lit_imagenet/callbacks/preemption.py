"""Stopping a run cleanly when its machines are taken back: SLURM's requeue signal, SIGTERM under DDP, torchrun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import SLURMEnvironment
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_imagenet import compat
from lit_imagenet.training.readback import DelayedMax

#: The signal SLURM sends ahead of the time limit with ``#SBATCH --signal=SIGUSR1@SECONDS`` (Lightning's default).
REQUEUE_SIGNAL = signal.SIGUSR1
_requeue_signalled = False


class RequeueSignal(SIGTERMException):
    """SLURM's requeue signal came: every process stops after the same training step, to save and requeue."""


def _note_requeue_signal(signum: int, frame: FrameType | None) -> None:
    global _requeue_signalled
    _requeue_signalled = True


def catch_requeue_signal() -> None:
    """Under SLURM, makes the requeue signal only set a flag from now on, which ``StepCheckpoint`` acts on (Lightning's
    handler would save mid-step; finding this one, it installs none)."""
    if SLURMEnvironment.detect() and threading.current_thread() is threading.main_thread():
        signal.signal(REQUEUE_SIGNAL, _note_requeue_signal)


def requeue_signalled() -> bool:
    """Whether the requeue signal has come since ``catch_requeue_signal`` took it."""
    return _requeue_signalled


def requeues_on_signal(trainer: pl.Trainer, stage: str) -> bool:
    """Whether ``catch_requeue_signal`` took the signal and the run trains in SLURM's cluster environment, requeueing
    on ``REQUEUE_SIGNAL`` (its defaults); if not, the signal again does what Lightning makes of it."""
    if signal.getsignal(REQUEUE_SIGNAL) is not _note_requeue_signal:
        return False
    env = getattr(trainer.strategy, "cluster_environment", None)  # None with one process: the default one
    slurm = isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal == REQUEUE_SIGNAL
    if stage == "fit" and (env is None or slurm):
        return True
    signal.signal(REQUEUE_SIGNAL, signal.SIG_DFL)
    return False


def requeue_slurm_job() -> int:
    """Puts the SLURM job back in the queue (the first process does; the others wait for it, since under ``srun
    --kill-on-bad-exit=1`` one exiting first would get the job killed); returns the exit status, the same everywhere."""
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    first = dist.get_rank() == 0 if grouped else os.environ.get("SLURM_PROCID", "0") == "0"
    status = [_requeue() if first else None]
    if grouped:
        dist.broadcast_object_list(status, src=0)
    return int(status[0]) if status[0] is not None else 128 + REQUEUE_SIGNAL


def _requeue() -> int:
    """Runs ``scontrol requeue``; returns ``128 + REQUEUE_SIGNAL``, or 1 (with one line) if it failed."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        reason = str(err)
    else:
        if done.returncode == 0:
            print(f"Requeued SLURM job {job}; it resumes with --ckpt_path last when it starts again.", flush=True)
            return 128 + REQUEUE_SIGNAL
        reason = (done.stderr or done.stdout).strip() or f"exit status {done.returncode}"
    print(f"error: scontrol requeue {job} failed ({reason}); the checkpoint is saved: submit the job script again "
          "to resume from it.", file=sys.stderr, flush=True)  # fmt: skip
    return 1


def torchrun_restart_problem() -> str | None:
    """Why torchrun could not restart this run's workers after a failure (with several nodes, workers restarted on
    the agents' shared rendezvous store cannot connect), or ``None``."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return None
    nodes, restarts = int(env.get("GROUP_WORLD_SIZE", "1")), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if nodes < 2 or restarts < 1:
        return None
    return (
        f"torchrun's workers share its rendezvous store, so the {nodes} nodes cannot restart them after a failure "
        f"(--max-restarts {restarts}); export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun."
    )


class SigtermConsensus(pl.Callback):
    """Under DDP, stops every rank at the same batch when any of them gets SIGTERM.

    Lightning's handling can stop ranks at different batches (the run hangs) and waits for the GPU each batch. Here
    the ranks agree every ``check_every_n_steps`` batches without waiting for the GPU. One process keeps Lightning's.

    Args:
        check_every_n_steps: Check every this many batches; ``None``: on Lightning's log steps.
    """

    def __init__(self, check_every_n_steps: int | None = None) -> None:
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be at least 1. Got {check_every_n_steps}")
        self.check_every_n_steps = check_every_n_steps

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._max: DelayedMax | None = None
        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return
        self._signalled, self._batches = False, 0
        self._max = DelayedMax(1, pl_module.device)
        self._flag = torch.zeros(1, dtype=torch.int64, device=pl_module.device)

        def note(signum: int, frame: FrameType | None) -> None:
            if not self._signalled:
                print(f"[rank {trainer.global_rank}] Received SIGTERM; every rank stops at the next check.",
                      file=sys.stderr, flush=True)  # fmt: skip
            self._signalled = True

        signal.signal(signal.SIGTERM, note)  # Lightning puts its own handlers back when the run ends
        compat.skip_sigterm_broadcast(trainer)

    def _note(self) -> torch.Tensor:
        return self._flag.fill_(int(self._signalled))  # a kernel with a host scalar: no wait for the GPU

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._max is None:
            return
        self._batches += 1
        every = self.check_every_n_steps
        if (self._batches % every == 0) if every else compat.writes_log_line(trainer):
            result = self._max.step(self._note())
            if result and result[0]:
                compat.mark_sigterm(trainer)  # Lightning stops every rank at the end of this batch

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._max is not None and self._max.now(self._note())[0]:
            compat.mark_sigterm(trainer)
