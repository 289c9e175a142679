"""Callbacks for using a trained model: the writer of predictions to a CSV file."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.callbacks import BasePredictionWriter
from typing_extensions import override

from lit_imagenet.callbacks.console import console_print


class PredictionWriter(BasePredictionWriter):
    """Writes the top classes of every predicted image to a CSV file, one row per image in file order.

    Columns: ``path``, then ``class_1``, ``prob_1``, ... ``class_k``, ``prob_k``, most probable first. Takes
    ``predict_step``'s ``{"probs": (N, classes), "index": (N,)}``; under DDP rank 0 writes every rank's rows.

    Args:
        output: The CSV file. ``None``: ``predictions.csv`` in the run folder of ``--ckpt_path`` (else the
            trainer's root or log folder, else the working directory).
        top_k: How many of the most probable classes to write per image.
    """

    def __init__(self, output: str | None = None, top_k: int = 5) -> None:
        super().__init__(write_interval="batch")
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1. Got {top_k}")
        self.output = output
        self.top_k = top_k
        #: Where the last prediction run wrote its CSV (set on rank 0).
        self.path: Path | None = None

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rows: list[tuple[int, list[int], list[float]]] = []

    @override
    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        if not isinstance(prediction, dict) or "probs" not in prediction or "index" not in prediction:
            raise ValueError("PredictionWriter needs predict_step to return {'probs': ..., 'index': ...}.")
        probs = prediction["probs"].detach()
        values, classes = probs.topk(min(self.top_k, probs.shape[1]), dim=1)  # on the device: k columns come back
        self._rows += zip(prediction["index"].tolist(), classes.tolist(), values.float().tolist())

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows, self._rows = self._rows, []
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            parts: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(parts, rows)
            rows = [row for part in parts for row in part]
        rows.sort()
        # On every rank: the trainer's log folder is broadcast from rank 0, a collective.
        folder = trainer.log_dir if trainer.logger is not None and trainer.log_dir else "."
        path = Path(self.output) if self.output is not None else Path(folder) / "predictions.csv"
        if not trainer.is_global_zero:
            return
        if not hasattr(trainer.datamodule, "samples"):
            raise ValueError("PredictionWriter needs a data module with samples('predict') to name the files.")
        samples = trainer.datamodule.samples("predict")
        names = getattr(pl_module.hparams, "class_names", None) or None
        path.parent.mkdir(parents=True, exist_ok=True)
        k = len(rows[0][1]) if rows else 0
        header = ["path"] + [col for i in range(1, k + 1) for col in (f"class_{i}", f"prob_{i}")]
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(header)
            for index, classes, values in rows:
                cells: list[Any] = [samples[index][0]]
                for c, v in zip(classes, values):
                    cells += [names[c] if names else str(c), f"{v:.6f}"]
                writer.writerow(cells)
        self.path = path
        console_print(trainer, f"Predictions for {len(rows)} images: {path}")
