"""The console's step lines, each epoch's throughput, the learning rates: none waits for the GPU mid-epoch."""

from __future__ import annotations

import logging
import math
import time
import warnings
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from typing_extensions import override

from lit_imagenet.compat import batches_that_stepped, writes_log_line
from lit_imagenet.training.readback import sync_device


def _drop_tip(record: logging.LogRecord) -> bool:
    """Drops Lightning's "Tip: ... litlogger" line, which advertises a service."""
    return "litlogger" not in record.getMessage()


def quiet_third_party() -> None:
    """Silences third-party warnings and lines the user cannot act on, each matched by message and module."""
    # Lightning's deprecated ``LeafSpec`` use in its own code: nothing the user can change.
    warnings.filterwarnings(
        "ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
        r"pytorch_lightning\.utilities\._pytree",
    )  # fmt: skip
    # The "state won't be reloaded" note about another run's folder concerns nothing this run writes.
    warnings.filterwarnings("ignore", r"The dirpath has changed from", UserWarning, r"pytorch_lightning\.callbacks")
    # Printed where --seed_everything is unset (predict): "Seed set to 0" follows anyway, and predict draws nothing.
    warnings.filterwarnings("ignore", r"No seed found, seed set to", module=r"lightning_fabric\.utilities\.seed")
    # Printed on every machine with srun: SLURM runs start through scripts/, a run started by hand runs where it is.
    warnings.filterwarnings(
        "ignore", r"The `srun` command is available on your system but is not used",
        module=r"lightning_fabric\.plugins\.environments\.slurm",
    )  # fmt: skip
    # An advertisement on every command, in the logger that also says which devices the run uses (kept).
    tips = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    if _drop_tip not in tips.filters:
        tips.addFilter(_drop_tip)


def console_print(trainer: pl.Trainer, line: str) -> None:
    """Prints ``line`` on a line of its own, above the progress bar where there is one."""
    bar = trainer.progress_bar_callback
    if bar is not None and bar.is_enabled and hasattr(bar, "print"):
        bar.print(line)
    else:
        print(line, flush=True)


_VALIDATION = (
    ("val/top1", "top-1"), ("val/top5", "top-5"), ("val/loss", "loss"),
    ("val_ema/top1", "EMA top-1"), ("val_ema/top5", "EMA top-5"),
)  # fmt: skip


class _EpochImages(pl.Callback):
    """Counts a training epoch's images over all processes from its start, or from a resume part-way through it."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device(pl_module)
        self._start, self._images = time.perf_counter(), 0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += int(batch[0].shape[0]) * trainer.world_size
        self._counted(pl_module)

    def _counted(self, pl_module: pl.LightningModule) -> None:
        """Called after each training batch is counted."""


class ConsoleLog(_EpochImages):
    """Prints one line every ``log_every_n_steps`` batches, as NVIDIA apex's ImageNet example did.

    ``Epoch 3 [120/5005] step 15135 | 0.124 s/step | 8,260 images/s | loss 2.3141 | top1 0.4844 | top5 0.7266``
    (images/s of all processes, also logged as ``train/images_per_sec``), written without synchronising the GPU;
    after each validation: ``Epoch 3 validation: top-1 0.9611, top-5 1.0000, loss 0.1234 (2.1 s)`` (and the EMA's
    top-1 and top-5 where the model keeps one).

    Args:
        enabled: Set to ``False`` for no lines (the progress bar stays; the metric is still logged).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pending: tuple[str, int] | None = None  # the line's start, and the step its figures are logged at
        self._looping = False  # a loop has started, with its progress bar

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._batches, self._pending, self._looping = 0, None, True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._batches += 1
        if writes_log_line(trainer):
            total = trainer.num_training_batches
            where = f"Epoch {trainer.current_epoch} [{batch_idx + 1}/{total if math.isfinite(total) else '?'}]"
            self._pending = (f"{where} step {trainer.global_step}", batches_that_stepped(trainer))

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer)
        self._validation_start = time.perf_counter()
        self._looping = True

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        seconds = time.perf_counter() - self._validation_start
        metrics = trainer.callback_metrics  # on every rank: computing the epoch's metrics may be a collective
        if not (self.enabled and trainer.is_global_zero) or "val/top1" not in metrics:
            return
        where = f"Validation of {trainer.ckpt_path}" if trainer.ckpt_path else "Validation"
        if trainer.state.fn == "fit":
            where = f"Epoch {trainer.current_epoch} validation"
        shown = [f"{name} {float(metrics[key]):.4f}" for key, name in _VALIDATION if key in metrics]
        console_print(trainer, f"{where}: {', '.join(shown)} ({seconds:.1f} s)")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        bar = trainer.progress_bar_callback
        if self._looping and trainer.is_global_zero and bar is not None and bar.is_enabled:
            print(flush=True)  # the bar may be part-way through its line: the error's line starts on its own

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._looping = True

    on_predict_start = on_test_start = on_sanity_check_start

    def _write(self, trainer: pl.Trainer, *_: Any) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        now = time.perf_counter()
        seconds = max(now - self._start, 1e-9)
        rate, batches = self._images / seconds, max(self._batches, 1)
        self._start, self._images, self._batches = now, 0, 0
        # On every rank: at an epoch's end this computes the epoch metrics, a collective.
        metrics = trainer.callback_metrics
        if not trainer.is_global_zero:
            return
        metrics["train/images_per_sec"] = torch.tensor(rate)
        for logger in trainer.loggers:
            logger.log_metrics({"train/images_per_sec": rate}, step=pending[1])
        if not self.enabled:
            return
        shown = [pending[0], f"{seconds / batches:.3f} s/step", f"{rate:,.0f} images/s"]
        for key, name in (("train/loss_step", "loss"), ("train/top1_step", "top1"), ("train/top5_step", "top5")):
            if key in metrics:
                shown.append(f"{name} {float(metrics[key]):.4f}")
        console_print(trainer, " | ".join(shown))

    # Lightning logs a batch's step figures after its on_train_batch_end: its line is written at the next hook.
    on_train_batch_start = on_train_epoch_end = on_train_end = _write


#: The batches of an epoch that its steady figure leaves out: the first pay for cuDNN's choices, the workers' start and
#: the first allocations, which weigh in a short epoch and not in ImageNet's 5,005 steps.
STEADY_FROM_BATCH = 10


class Throughput(_EpochImages):
    """Reports each training epoch's images per second over all processes, and peak GPU memory.

    The line also gives the steady pace, from the epoch's 11th batch to its last, where the epoch has 11 batches or
    more: ``Epoch 0: 4,210 images/s over all processes (76,800 images in 18.2 s); 4,520 images/s from batch 11 to
    the last, peak GPU memory 21.3 GiB``. On a GPU that pace is timed with CUDA events, which the GPU reaches when it
    has done the batch's work, so that no batch waits for it.
    """

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)
        super().on_train_epoch_start(trainer, pl_module)
        # (time, images so far) after batch STEADY_FROM_BATCH, and after the latest batch since
        self._batches, self._first, self._last = 0, None, None

    @override
    def _counted(self, pl_module: pl.LightningModule) -> None:
        self._batches += 1
        if self._batches < STEADY_FROM_BATCH:
            return
        if pl_module.device.type == "cuda":
            mark: Any = torch.cuda.Event(enable_timing=True)
            mark.record()
        else:
            mark = time.perf_counter()
        if self._batches == STEADY_FROM_BATCH:
            self._first = (mark, self._images)
        else:
            self._last = (mark, self._images)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device(pl_module)
        seconds = time.perf_counter() - self._start
        steady = ""
        if self._first is not None and self._last is not None:
            (first, first_images), (last, last_images) = self._first, self._last
            between = first.elapsed_time(last) / 1000 if isinstance(first, torch.cuda.Event) else last - first
            rate = (last_images - first_images) / max(between, 1e-9)
            steady = f"; {rate:,.0f} images/s from batch {STEADY_FROM_BATCH + 1} to the last"
        memory = ""
        if pl_module.device.type == "cuda":
            memory = f", peak GPU memory {torch.cuda.max_memory_allocated(pl_module.device) / 2**30:.2f} GiB"
        rank_zero_info(
            f"Epoch {trainer.current_epoch}: {self._images / max(seconds, 1e-9):,.0f} images/s over all "
            f"processes ({self._images:,} images in {seconds:.1f} s){steady}{memory}"
        )


class LearningRateLog(pl.Callback):
    """Logs each optimizer's learning rates on Lightning's log steps, or at the start of each epoch.

    The names are ``LearningRateMonitor``'s (``lr-SGD``, ``lr-SGD/pg1``...); unlike it, this never waits for the GPU.

    Args:
        logging_interval: ``step``: on Lightning's log steps; ``epoch``: at the start of each training epoch.
        log_momentum: Also log each group's momentum (``betas[0]`` for Adam) as ``lr-SGD-momentum``...
    """

    def __init__(self, logging_interval: str = "step", log_momentum: bool = False) -> None:
        if logging_interval not in ("step", "epoch"):
            raise ValueError(f"logging_interval must be 'step' or 'epoch'. Got {logging_interval!r}")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum

    def _log(self, trainer: pl.Trainer) -> None:
        kinds = [type(opt).__name__ for opt in trainer.optimizers]
        figures: dict[str, float] = {}
        for index, (opt, kind) in enumerate(zip(trainer.optimizers, kinds)):
            base = f"lr-{kind}" + (f"-{kinds[:index].count(kind) + 1}" if kinds.count(kind) > 1 else "")
            for number, group in enumerate(opt.param_groups, start=1):
                name = f"{base}/{group.get('name', f'pg{number}')}" if len(opt.param_groups) > 1 else base
                figures[name] = float(group["lr"])
                if self.log_momentum:
                    momentum = group["betas"][0] if "betas" in group else group.get("momentum", 0.0)
                    figures[f"{name}-momentum"] = float(momentum)
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
