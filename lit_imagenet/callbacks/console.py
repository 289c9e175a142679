"""Watching a run from the console: the step lines, each epoch's throughput, the learning rates.

None of these waits for the GPU during an epoch: what they accumulate stays on the device or on the
host, and what they read back was copied to the host a while before
(``lit_imagenet.training.readback``), so the GPU never runs out of queued work because of them.
``Throughput`` synchronises at an epoch's start and end only.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from typing_extensions import override

from lit_imagenet.compat import batches_that_stepped, writes_log_line
from lit_imagenet.training.readback import sync_device


class _EpochMeter(pl.Callback):
    """A callback that starts measuring at the start of each training epoch (``on_train_epoch_start``)."""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed part-way through an epoch gets no on_train_epoch_start for that epoch.
        self.on_train_epoch_start(trainer, pl_module)


class ConsoleLog(_EpochMeter):
    """Prints one line every ``log_every_n_steps`` batches, as NVIDIA apex's ImageNet example did.

    ``Epoch 3 [120/5005] step 15135 | 0.124 s/step | 8,260 images/s | loss 2.3141 | top1 0.4844 | top5 0.7266``:
    time per batch and images per second (over all processes) since the previous line, and the
    loss, top-1 and top-5 of that batch (``ImageClassifier``'s ``train/*_step`` figures). The images
    per second are also logged as ``train/images_per_sec``, at that batch's step.

    The GPU is not synchronised for it: the line is written once the module has logged the batch's
    figures (at the start of the next batch, or at the end of the epoch or of the run). The model
    reads them back when the GPU has finished that batch's forward pass, so the clock follows the
    GPU's progress while the rest of the queued work goes on. A module that logs no step figures
    gets host times, which average out over many lines.

    Args:
        enabled: Set to ``False`` for no lines (the progress bar stays; the metric is still logged).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._start = 0.0
        self._images = 0
        self._batches = 0
        self._pending: dict[str, Any] | None = None

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device(pl_module)
        self._start, self._images, self._batches = time.perf_counter(), 0, 0
        self._pending = None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += int(batch[0].shape[0]) * trainer.world_size
        self._batches += 1
        if writes_log_line(trainer):
            total = trainer.num_training_batches
            self._pending = {
                "where": f"Epoch {trainer.current_epoch} [{batch_idx + 1}/{total if math.isfinite(total) else '?'}]"
                f" step {trainer.global_step}",
                # the step Lightning writes this batch's figures at
                "step": batches_that_stepped(trainer),
            }

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._write(trainer)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        now = time.perf_counter()
        seconds = max(now - self._start, 1e-9)
        rate = self._images / seconds
        batches = max(self._batches, 1)
        self._start, self._images, self._batches = now, 0, 0
        # Read on every rank: at the end of an epoch this computes the epoch metrics, which synchronises
        # them across ranks. Read on rank 0 alone, those collectives met the other ranks' next ones (the
        # NonFiniteGuard's all-reduce): the ranks then exchanged wrong data, or waited for each other.
        metrics = trainer.callback_metrics
        if not trainer.is_global_zero:
            return
        metrics["train/images_per_sec"] = torch.tensor(rate)
        for logger in trainer.loggers:
            logger.log_metrics({"train/images_per_sec": rate}, step=pending["step"])
        if not self.enabled:
            return
        shown = [pending["where"], f"{seconds / batches:.3f} s/step", f"{rate:,.0f} images/s"]
        for key, name in (("train/loss_step", "loss"), ("train/top1_step", "top1"), ("train/top5_step", "top5")):
            if key in metrics:
                shown.append(f"{name} {float(metrics[key]):.4f}")
        line = " | ".join(shown)
        bar = trainer.progress_bar_callback
        if bar is not None and bar.is_enabled and hasattr(bar, "print"):
            bar.print(line)
        else:
            print(line, flush=True)


class Throughput(_EpochMeter):
    """Reports each training epoch's images per second over all processes, and peak GPU memory.

    The average covers the whole epoch, epoch start included, which is the figure that counts for
    a whole run; the GPU is synchronised only at the start and the end of the epoch. (The rate
    between log steps is ``ConsoleLog``'s ``train/images_per_sec``.)
    """

    def __init__(self) -> None:
        self._epoch_start = 0.0
        self._epoch_images = 0

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
        memory = f", peak GPU memory {record['peak_memory_gib']:.2f} GiB" if "peak_memory_gib" in record else ""
        rank_zero_info(
            f"Epoch {trainer.current_epoch}: {record['images_per_sec']:,.0f} images/s over all processes "
            f"({self._epoch_images:,} images in {seconds:.1f} s){memory}"
        )


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
