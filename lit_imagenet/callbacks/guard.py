"""The non-finite-loss guard: stops a run whose loss stays NaN or infinite, naming the last good checkpoint."""

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
    """Stops the run, on every rank together, when the loss has been NaN or infinite for ``max_consecutive`` batches:
    up to twice ``check_every_n_steps`` (``None``: Lightning's log steps) batches later, since the count is read back a
    check later (``DelayedMax``). The error names the newest checkpoint before the bad run."""

    def __init__(self, max_consecutive: int = 20, check_every_n_steps: int | None = None) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be at least 1. Got {max_consecutive}")
        if check_every_n_steps is not None and check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps must be at least 1. Got {check_every_n_steps}")
        self.max_consecutive, self.check_every_n_steps = max_consecutive, check_every_n_steps

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # On the device: consecutive non-finite losses, the step they began at, where a run over the limit began.
        self._state = torch.tensor([0, -1, -1], dtype=torch.int64, device=pl_module.device)
        self._max = DelayedMax(1, pl_module.device)
        self._batches = 0
        self._saved: dict[str, int] = {}  # checkpoint path -> the latest global step saved to it

    def _note_checkpoints(self, trainer: pl.Trainer) -> None:
        for cb in trainer.checkpoint_callbacks:
            if isinstance(cb, ModelCheckpoint) and (saved := last_checkpoint_saved(cb)):
                path, step = saved
                self._saved[path] = max(step, self._saved.get(path, step))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self._note_checkpoints(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, Tensor):  # every rank takes part in the same checks, whatever its batch gave
            loss = torch.zeros((), device=self._state.device)
        bad = ~torch.isfinite(loss.detach().to(self._state.device))
        # The step before this batch's optimizer step: a checkpoint saved at it holds good weights.
        step = trainer.global_step - (0 if accumulates_gradients(trainer) else 1)
        consecutive, run_start, tripped_at = self._state.unbind()
        new_start = torch.where(bad & (consecutive == 0), step, run_start)
        new_count = torch.where(bad, consecutive + 1, 0)
        new_tripped = torch.where((new_count >= self.max_consecutive) & (tripped_at < 0), new_start, tripped_at)
        self._state.copy_(torch.stack([new_count, new_start, new_tripped]))
        self._batches += 1
        every = self.check_every_n_steps
        if (self._batches % every == 0) if every else writes_log_line(trainer):
            result = self._max.step(self._state[2:3])
            if result is not None:
                self._raise_if_tripped(trainer, result[0])

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._raise_if_tripped(trainer, self._max.now(self._state[2:3])[0])

    def _raise_if_tripped(self, trainer: pl.Trainer, start: int) -> None:
        if start < 0:
            return
        self._note_checkpoints(trainer)
        # A rolling file rewritten after the bad run began holds bad weights.
        good = max([(s, p) for p, s in self._saved.items() if s <= start and Path(p).is_file()], default=None)
        where = "no checkpoint was saved before it"
        if good:
            where = f"the last checkpoint before it is {good[1]} (step {good[0]}); resume with --ckpt_path PATH"
        raise NonFiniteLossError(
            f"The training loss was NaN or infinite for {self.max_consecutive} consecutive batches from global step "
            f"{start}; {where}, and lower the learning rate or check the data."
        )
