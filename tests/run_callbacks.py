"""Callbacks that tests add to a real ``train.py`` run through ``--config``."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist


class PoisonBatches(pl.Callback):
    """Makes one rank's network output NaN from a global step on, so that its loss is NaN.

    Args:
        rank: The global rank whose outputs are poisoned.
        from_step: The first global step (before its optimizer step) whose output is poisoned.
    """

    def __init__(self, rank: int = 0, from_step: int = 0) -> None:
        self.rank = rank
        self.from_step = from_step
        self._poison = False

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        pl_module.register_forward_hook(lambda module, args, out: out * float("nan") if self._poison else out)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._poison = trainer.global_rank == self.rank and trainer.global_step >= self.from_step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._poison = False


class RecordCollectives(pl.Callback):
    """Writes the names of the collectives each rank made during ``fit``, in order, to ``folder/rankN.txt``.

    Args:
        folder: Where to write.
    """

    NAMES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
             "gather", "scatter", "reduce", "reduce_scatter")  # fmt: skip

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.calls: list[str] = []
        self._originals: dict[str, Any] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        def recorded(name: str, original: Any) -> Any:
            @functools.wraps(original)
            def call(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return original(*args, **kwargs)

            return call

        for name in self.NAMES:
            self._originals[name] = getattr(dist, name)
            setattr(dist, name, recorded(name, self._originals[name]))

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        Path(self.folder, f"rank{trainer.global_rank}.txt").write_text("\n".join(self.calls) + "\n")
