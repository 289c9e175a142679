"""Callbacks that the multi-GPU tests add to a real ``train.py`` run through ``--config``."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl


class PoisonBatches(pl.Callback):
    """Turns the images of one rank's batches into NaN from a global step on, so that its loss is NaN.

    Args:
        rank: The global rank whose batches are poisoned.
        from_step: The first global step (before its optimizer step) whose batch is poisoned.
    """

    def __init__(self, rank: int = 0, from_step: int = 0) -> None:
        self.rank = rank
        self.from_step = from_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if trainer.global_rank == self.rank and trainer.global_step >= self.from_step:
            batch[0].mul_(float("nan"))
