"""Stopping a run cleanly when its machines are taken back: SLURM's requeue signal, SIGTERM under DDP, torchrun.

Under SLURM, ``catch_requeue_signal`` takes the requeue signal (SIGUSR1, sent ``--signal`` seconds
before the time limit) in place of Lightning's handler, which saved ``hpc_ckpt_N.ckpt`` from inside
the signal handler, wherever the step happened to be: after the forward pass had updated the
batch-norm statistics but before the optimizer step, say, so that a run resumed from it was not the
run it continued. Here the signal only sets a flag; ``StepCheckpoint``
(``lit_imagenet.callbacks.checkpoints``) stops every process after the same training step, saves
``last-step.ckpt`` there, and ``requeue_slurm_job`` puts the job back in the queue, whose next start
resumes from it with ``--ckpt_path last``; every process exits once the requeue is done, with its
status. ``SigtermConsensus`` stops every rank of a DDP run at the same batch when any of them gets
SIGTERM; ``torchrun_restart_problem`` finds a torchrun setting that
keeps torchrun from restarting a failed run.
"""

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


def catch_requeue_signal() -> bool:
    """Under SLURM, makes the requeue signal only set a flag from now on; ``StepCheckpoint`` acts on it.

    Called when the command line starts, before the data is scanned and the model built, so a signal
    that comes during start-up stops the run after its first step instead of killing the process.
    Lightning, finding a handler in place, does not install its own. Returns whether it was installed.
    """
    if not SLURMEnvironment.detect() or threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(REQUEUE_SIGNAL, _note_requeue_signal)
    return True


def requeue_handler_installed() -> bool:
    """Whether ``catch_requeue_signal``'s handler holds the requeue signal now."""
    return signal.getsignal(REQUEUE_SIGNAL) is _note_requeue_signal


def requeue_signalled() -> bool:
    """Whether the requeue signal has come since ``catch_requeue_signal`` took it."""
    return _requeue_signalled


def slurm_requeues(trainer: pl.Trainer) -> bool:
    """Whether the run's cluster environment is SLURM's, requeueing on ``REQUEUE_SIGNAL`` (its defaults)."""
    env = getattr(trainer.strategy, "cluster_environment", None)
    if env is None:  # one process: its strategy does not show the environment, taken to be the default one
        return True
    return isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal == REQUEUE_SIGNAL


def requeue_slurm_job() -> int:
    """Puts the SLURM job back in the queue (the first process does) and gives the exit status, the same on every
    process: the others wait for the first's ``scontrol requeue`` to return before they exit.

    The job runs its script again when it restarts, and the script's ``--ckpt_path last`` resumes
    from the checkpoint saved on the signal. Under ``srun --kill-on-bad-exit=1`` a process that exited first, with
    its non-zero status, would have ``srun`` kill the first one before or during its requeue.
    """
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    first = dist.get_rank() == 0 if grouped else os.environ.get("SLURM_PROCID", "0") == "0"
    status = [_requeue() if first else None]
    if grouped:
        dist.broadcast_object_list(status, src=0)
    return int(status[0]) if status[0] is not None else 128 + REQUEUE_SIGNAL


def _requeue() -> int:
    """Runs ``scontrol requeue`` on this job; the exit status of the run: ``128 + REQUEUE_SIGNAL``, or 1 (with
    one line) where the requeue failed."""
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
    print(
        f"error: scontrol requeue {job} failed ({reason}); the checkpoint is saved: submit the job script again "
        "to resume from it.",
        file=sys.stderr,
        flush=True,
    )
    return 1


def torchrun_restart_problem() -> str | None:
    """Why torchrun could not restart this run's workers after a failure, or ``None``.

    torchrun's agents share their rendezvous store with the workers (PyTorch 2.5 and later), and the
    store keeps the addresses of the group it started first; with several agents (nodes) the group
    they restart reads those and cannot connect (``Connection refused``), until ``--max-restarts``
    runs out. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each group a store of its own.
    """
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
