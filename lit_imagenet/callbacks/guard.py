"""The non-finite-loss guard: stops a run whose loss stays NaN or infinite, naming the last good checkpoint.

It never waits for the GPU during an epoch: the count of bad batches stays on the device, and what
it reads back was copied to the host at its previous check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor
from typing_extensions import override

from lit_imagenet.compat import accumulates_gradients, last_checkpoint_saved, writes_log_line
from lit_imagenet.training.readback import DelayedMax


class NonFiniteLossError(RuntimeError):
    """The training loss was NaN or infinite for too many consecutive batches."""


class NonFiniteGuard(pl.Callback):
    """Stops the run when the loss has been NaN or infinite for ``max_consecutive`` batches in a row.

    With fp16 dynamic loss scaling an occasional overflow is normal (the scaler skips that step), so
    one bad batch is not an error; a long run of them means the weights or the data went bad. The
    count is kept on the device. Every ``check_every_n_steps`` batches (by default on Lightning's
    log steps) the guard starts copying it to the host, and it reads that copy at the next check,
    long after the GPU wrote it, so the guard never waits for the GPU during an epoch; at the end of
    each epoch it reads the count directly. The price is that the run stops up to twice that many
    batches after the limit was reached. The error names the global step where the bad run began
    and the newest checkpoint saved before it. Under DDP every rank takes the largest count of all
    ranks at the same batch, so all of them stop together.

    Args:
        max_consecutive: Consecutive non-finite losses that stop the run.
        check_every_n_steps: Check every this many batches; ``None``: on Lightning's log steps
            (every ``log_every_n_steps`` optimizer steps).
    """

    def __init__(self, max_consecutive: int = 20, check_every_n_steps: int | None = None) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be at least 1. Got {max_consecutive}")
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be at least 1. Got {check_every_n_steps}")
        self.max_consecutive = max_consecutive
        self.check_every_n_steps = check_every_n_steps
        # (consecutive non-finite losses, global step where that run began, where a run that reached
        # the limit began), on the device, updated in place: -1 means none.
        self._state: Tensor | None = None
        self._max: DelayedMax | None = None
        self._in_flight: int | None = None  # the slot of the previous check, not read yet
        self._batches = 0
        self._saved: dict[str, int] = {}  # checkpoint path -> the latest global step saved to it

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        device = pl_module.device
        self._state = torch.tensor([0, -1, -1], dtype=torch.int64, device=device)
        self._max = DelayedMax(1, device)
        self._in_flight = None
        self._batches = 0
        self._saved = {}

    def _note_checkpoints(self, trainer: pl.Trainer) -> None:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and (saved := last_checkpoint_saved(cb)):
                path, step = saved
                self._saved[path] = max(step, self._saved.get(path, step))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._note_checkpoints(trainer)  # host-side attributes only: saves happen at batch ends

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self._state is None:
            return
        if not isinstance(loss, Tensor):
            # Every rank must take part in the same checks, whatever its own batch gave.
            loss = torch.zeros((), device=self._state.device)
        bad = ~torch.isfinite(loss.detach().to(self._state.device))
        # The step of this batch before its optimizer step: a checkpoint saved at it holds good weights.
        step = trainer.global_step - (0 if accumulates_gradients(trainer) else 1)
        consecutive, run_start, tripped_at = self._state.unbind()
        new_start = torch.where(bad & (consecutive == 0), step, run_start)
        new_count = torch.where(bad, consecutive + 1, 0)
        new_tripped = torch.where((new_count >= self.max_consecutive) & (tripped_at < 0), new_start, tripped_at)
        self._state.copy_(torch.stack([new_count, new_start, new_tripped]))
        self._batches += 1
        every = self.check_every_n_steps
        if (self._batches % every == 0) if every else writes_log_line(trainer):
            previous = self._in_flight
            self._in_flight = self._start_check()
            if previous is not None:
                self._raise_if_tripped(trainer, self._read(previous))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._state is not None:
            self._in_flight = None  # the value read now includes it
            self._raise_if_tripped(trainer, self._read(self._start_check()))

    def _start_check(self) -> int:
        """Starts the maximum over all ranks of where a bad run that reached the limit began (-1: none): every
        rank stops together, where one raising alone would leave the others waiting in their next collective."""
        assert self._state is not None and self._max is not None
        return self._max.start(self._state[2:3])

    def _read(self, slot: int) -> int:
        assert self._max is not None
        return self._max.read(slot)[0]

    def _raise_if_tripped(self, trainer: pl.Trainer, start: int) -> None:
        if start < 0:
            return
        self._note_checkpoints(trainer)
        # A rolling file rewritten after the bad run began holds bad weights.
        good = [(s, p) for p, s in self._saved.items() if s <= start and Path(p).is_file()]
        where = (
            f"the last checkpoint before it is {max(good)[1]} (step {max(good)[0]}); resume with --ckpt_path PATH"
            if good
            else "no checkpoint was saved before it"
        )
        raise NonFiniteLossError(
            f"The training loss was NaN or infinite for {self.max_consecutive} consecutive batches from global step "
            f"{start}; {where}, and lower the learning rate or check the data."
        )
