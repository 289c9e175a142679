"""Callbacks: the GPU prefetcher's switch, a throughput meter, the learning-rate log, and the writer of predictions."""

from __future__ import annotations

import csv
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import BasePredictionWriter
from pytorch_lightning.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lit_imagenet.compat import batches_that_stepped, writes_log_line


class CUDAPrefetch(pl.Callback):
    """Turns on the side-stream prefetcher of ``lit_imagenet.prefetch`` when the run is on a CUDA device.

    Lightning creates the loaders and draws their first batch before any epoch-start hook runs, so
    the device is handed to the data module in ``setup``; the data module's ``PrefetchLoader`` then
    copies and normalises each batch on a side stream, one step ahead. On other devices nothing
    changes and the model normalises the uint8 batches itself. A data module takes part by having a
    ``prefetch_device`` attribute.

    Args:
        enabled: Set to ``False`` to transfer batches the plain way, on the default stream.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "prefetch_device"):
            return
        device = trainer.strategy.root_device
        datamodule.prefetch_device = device if self.enabled and device.type == "cuda" else None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        datamodule = trainer.datamodule
        if datamodule is not None and hasattr(datamodule, "prefetch_device"):
            datamodule.prefetch_device = None


def sync_device(pl_module: pl.LightningModule) -> None:
    """Waits for the module's GPU, so that a host clock measures the work queued so far."""
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)


def copy_to_host(tensor: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """Starts copying ``tensor`` to host memory, without waiting for the GPU.

    Returns the copy and, for a CUDA tensor, an event recorded right after it on the tensor's
    current stream: call ``event.synchronize()`` before reading the copy. That wait lasts until the
    GPU has done the work queued before the copy, not the work queued since, so a value read a
    little later (after the step's backward pass and optimizer step were queued) costs the GPU no
    idle time, where ``.item()`` or ``.cpu()`` would wait for the whole queue.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.clone(), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(tensor.device)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return host, event


def read_host_copy(copy: tuple[Tensor, torch.cuda.Event | None]) -> Tensor:
    """The value of a ``copy_to_host`` copy, once the GPU has written it."""
    host, ready = copy
    if ready is not None:
        ready.synchronize()
    return host


class LearningRateLog(pl.Callback):
    """Logs each optimizer's learning rates on Lightning's log steps, or at the start of each epoch.

    The names are those of Lightning's ``LearningRateMonitor``: ``lr-SGD``, or ``lr-SGD/pg1``,
    ``lr-SGD/pg2``... when the optimizer has several parameter groups (a group's ``name`` entry
    replaces ``pgN``), with ``-1``, ``-2``... after the optimizer's name when several optimizers share
    it. Unlike ``LearningRateMonitor``, which copies each rate to the GPU at every log step (a copy
    that waits for all the GPU's queued work), it keeps the figures on the host.

    Args:
        logging_interval: ``step``: on the batches after which Lightning writes its step logs (every
            ``log_every_n_steps`` optimizer steps); ``epoch``: at the start of each training epoch.
        log_momentum: Also log each group's momentum (``betas[0]`` for Adam-like optimizers) as
            ``lr-SGD-momentum``, ``lr-SGD/pg1-momentum``...
    """

    def __init__(self, logging_interval: str = "step", log_momentum: bool = False) -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"logging_interval must be 'step' or 'epoch'. Got {logging_interval!r}")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum

    def rates(self, trainer: pl.Trainer) -> dict[str, float]:
        """The current rates (and momenta), by name."""
        optimizers = trainer.optimizers
        kinds = [type(opt).__name__ for opt in optimizers]
        figures: dict[str, float] = {}
        for index, (opt, kind) in enumerate(zip(optimizers, kinds)):
            base = f"lr-{kind}" + (f"-{kinds[:index].count(kind) + 1}" if kinds.count(kind) > 1 else "")
            groups = opt.param_groups
            for number, group in enumerate(groups, start=1):
                name = f"{base}/{group.get('name', f'pg{number}')}" if len(groups) > 1 else base
                figures[name] = float(group["lr"])
                if self.log_momentum:
                    momentum = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                    figures[f"{name}-momentum"] = float(momentum)
        return figures

    def _log(self, trainer: pl.Trainer) -> None:
        figures = self.rates(trainer)
        if not figures:
            return
        trainer.callback_metrics.update({name: torch.tensor(value) for name, value in figures.items()})
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=batches_that_stepped(trainer))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.logging_interval == "step" and writes_log_line(trainer):
            self._log(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.logging_interval == "epoch":
            self._log(trainer)


class Throughput(pl.Callback):
    """Reports each training epoch's images per second over all processes, and peak GPU memory.

    The average covers the whole epoch, epoch start included, which is the figure that counts for
    a whole run; the GPU is synchronised only at the start and the end of the epoch. (The rate
    between log steps is ``ConsoleLog``'s ``train/images_per_sec``.)
    """

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self._epoch_start = 0.0
        self._epoch_images = 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed part-way through an epoch gets no on_train_epoch_start for that epoch.
        self.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device(pl_module)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._epoch_start = time.perf_counter()
        self._epoch_images = 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._epoch_images += int(batch[0].shape[0]) * trainer.world_size

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device(pl_module)
        seconds = time.perf_counter() - self._epoch_start
        record = {
            "epoch": float(trainer.current_epoch),
            "images": float(self._epoch_images),
            "seconds": seconds,
            "images_per_sec": self._epoch_images / max(seconds, 1e-9),
        }
        if pl_module.device.type == "cuda":
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
        self.history.append(record)
        memory = f", peak GPU memory {record['peak_memory_gib']:.2f} GiB" if "peak_memory_gib" in record else ""
        rank_zero_info(
            f"Epoch {trainer.current_epoch}: {record['images_per_sec']:,.0f} images/s over all processes "
            f"({self._epoch_images:,} images in {seconds:.1f} s){memory}"
        )


class PredictionWriter(BasePredictionWriter):
    """Writes the top classes of every predicted image to a CSV file, one row per image in file order.

    The columns are ``path``, then ``class_1``, ``prob_1``, ... ``class_k``, ``prob_k`` (``k`` is
    ``top_k`` capped at the number of classes), most probable first. The model's ``predict_step``
    returns ``{"probs": (N, classes), "index": (N,)}``, where ``index`` is the position of each image
    in the data module's ``samples("predict")``; class names come from the model's ``class_names``
    (stored in its checkpoints), or are the class indices when it has none.

    Under DDP each process keeps the rows of its own images and rank 0 gathers them all
    (``torch.distributed.all_gather_object``) and writes the one file, so no shared disk is needed.

    Args:
        output: The CSV file to write. ``None``: ``predictions.csv`` in the trainer's log folder,
            or in the working directory when there is no logger.
        top_k: How many of the most probable classes to write per image.
    """

    def __init__(self, output: str | None = None, top_k: int = 5) -> None:
        super().__init__(write_interval="batch")
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1. Got {top_k}")
        self.output = output
        self.top_k = top_k
        self._rows: list[tuple[int, list[int], list[float]]] = []
        #: Where the last prediction run wrote its CSV (set on rank 0).
        self.path: Path | None = None

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._rows = []

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
        for index, cls, val in zip(prediction["index"].tolist(), classes.tolist(), values.float().tolist()):
            self._rows.append((int(index), cls, val))

    def _gathered_rows(self, trainer: pl.Trainer) -> list[tuple[int, list[int], list[float]]]:
        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return self._rows
        parts: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(parts, self._rows)
        return [row for part in parts for row in part]

    def _default_path(self, trainer: pl.Trainer) -> Path:
        folder = trainer.log_dir if trainer.logger is not None and trainer.log_dir else "."
        return Path(folder) / "predictions.csv"

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows = sorted(self._gathered_rows(trainer))
        self._rows = []
        # On every rank: the trainer's log folder is broadcast from rank 0, a collective.
        path = Path(self.output) if self.output is not None else self._default_path(trainer)
        if not trainer.is_global_zero:
            return
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "samples"):
            raise ValueError("PredictionWriter needs a data module with samples('predict') to name the files.")
        samples = datamodule.samples("predict")
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
        print(f"Predictions for {len(rows)} images: {path}", flush=True)
