"""Callbacks: the GPU prefetcher's switch, and a throughput meter."""

from __future__ import annotations

import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from typing_extensions import override


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


class Throughput(pl.Callback):
    """Measures training images per second over all processes, and peak GPU memory.

    Every ``log_every_n_steps`` batches it logs ``train/images_per_sec`` for the steps since the last log
    (synchronising the GPU only then), and at the end of each epoch it reports the epoch's average,
    epoch start included, which is the figure that counts for a whole run.
    """

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self._epoch_start = 0.0
        self._epoch_images = 0
        self._window_start = 0.0
        self._window_images = 0

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(pl_module)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        self._epoch_start = self._window_start = time.perf_counter()
        self._epoch_images = self._window_images = 0

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        images = int(batch[0].shape[0]) * trainer.world_size
        self._epoch_images += images
        self._window_images += images
        if (batch_idx + 1) % trainer.log_every_n_steps == 0:
            self._sync(pl_module)
            now = time.perf_counter()
            rate = self._window_images / max(now - self._window_start, 1e-9)
            pl_module.log("train/images_per_sec", rate, on_step=True, on_epoch=False, rank_zero_only=True)
            self._window_start, self._window_images = now, 0

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._sync(pl_module)
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
