"""Watching a run: console lines, throughput, learning rates, logs, curves and profiling windows.

None of these waits for the GPU during an epoch: what they accumulate stays on the device or on the
host, and what they read back was copied to the host a while before (``lit_imagenet.host``), so the
GPU never runs out of queued work because of them. ``Throughput`` synchronises at an epoch's start
and end only.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only
from torch import Tensor
from typing_extensions import override

from lit_imagenet.compat import batches_that_stepped, logger_prefix, writes_log_line
from lit_imagenet.host import sync_device


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
        self.history: list[dict[str, float]] = []
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
        self.history.append(record)
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


class RunLogger(CSVLogger):
    """A ``CSVLogger`` that also writes TensorBoard event files into the same version folder.

    ``metrics.csv``, ``hparams.yaml`` and ``events.out.tfevents.*`` end up side by side in
    ``save_dir/name/version_N``: ``tensorboard --logdir runs`` and a spreadsheet read the same run.

    Args:
        save_dir: Folder of the logs. ``None``: ``--trainer.default_root_dir`` on the command line, else ``runs``.
        name: Sub-folder of the run's versions.
        version: Version number or folder name; ``None``: the next free ``version_N``.
        prefix: Prefix of every metric name.
        flush_logs_every_n_steps: Write ``metrics.csv`` every this many steps.
        tensorboard: Set to ``False`` for the CSV file only.
    """

    def __init__(
        self,
        save_dir: str | None = None,
        name: str = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        tensorboard: bool = True,
    ) -> None:
        super().__init__("runs" if save_dir is None else save_dir, name, version, prefix, flush_logs_every_n_steps)
        self.tensorboard = tensorboard
        self._tb: TensorBoardLogger | None = None

    @property
    def tb(self) -> TensorBoardLogger | None:
        """The TensorBoard logger writing into this logger's version folder (``None`` when off)."""
        if self.tensorboard and self._tb is None:
            self._tb = TensorBoardLogger(
                self.save_dir, name=self.name, version=self.version, prefix=logger_prefix(self), default_hp_metric=False
            )
        return self._tb if self.tensorboard else None

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any = None) -> None:
        super().log_hyperparams(params)
        if self.tb is not None:
            self.tb.log_hyperparams(params)

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        if self.tb is not None:
            self.tb.log_metrics(metrics, step)

    @override
    @rank_zero_only
    def save(self) -> None:
        super().save()
        if self._tb is not None:
            self._tb.experiment.flush()

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._tb is not None:
            self._tb.finalize(status)


_CURVES = (
    ("loss", ("train/loss_step", "val/loss")),
    ("top-1", ("train/top1_step", "val/top1")),
    ("top-5", ("train/top5_step", "val/top5")),
    ("learning rate", ("lr-SGD",)),
    ("images/s", ("train/images_per_sec",)),
)


def plot_curves(metrics_csv: str | Path, out: str | Path) -> Path:
    """Draws loss, top-1, top-5, learning rate and images/s against the step from a ``metrics.csv``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend to switch
    from matplotlib.figure import Figure

    series: dict[str, list[tuple[float, float]]] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for key, value in row.items():
                if key != "step" and value:
                    series.setdefault(key, []).append((float(step), float(value)))
    fig = Figure(figsize=(4 * len(_CURVES), 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (title, keys) in zip(fig.subplots(1, len(_CURVES)), _CURVES):
        for key in keys:
            points = series.get(key) or next((v for k, v in series.items() if k.startswith(key)), [])
            if points:
                ax.plot(*zip(*points), label=key, marker="." if key.startswith("val/") else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize="small")
    out = Path(out)
    fig.savefig(out, dpi=80)
    return out


class TrainingCurves(pl.Callback):
    """At the end of ``fit``, saves ``training_curves.png`` (loss, top-1, top-5, LR, images/s) next to ``metrics.csv``.

    Args:
        enabled: Set to ``False`` for no picture.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path: Path | None = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.enabled and trainer.is_global_zero):
            return
        logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if logger is None:
            return
        logger.save()
        metrics = Path(logger.experiment.metrics_file_path)
        if metrics.is_file():
            self.path = plot_curves(metrics, Path(logger.log_dir) / "training_curves.png")
            rank_zero_info(f"Training curves: {self.path}")


class Profile(pl.Callback):
    """The reference's ``--prof N``: profile ``steps`` training batches from batch ``start_step``, then stop.

    On CUDA each batch, forward, backward and optimizer step gets an NVTX range and the CUDA profiler
    is started for the window (``nsys profile --capture-range=cudaProfilerApi python train.py ...``
    records just that). With ``torch_trace`` the PyTorch profiler records the same window (CPU and,
    on CUDA, GPU activity) to ``trace.json`` in the log folder, for chrome://tracing or Perfetto.
    The run ends after the window. On CPU the NVTX ranges and CUDA profiler are skipped.

    Args:
        start_step: First profiled batch of the run (from 0); -1 turns profiling off.
        steps: Number of profiled batches.
        torch_trace: Also record a PyTorch profiler trace of the window.
    """

    def __init__(self, start_step: int = -1, steps: int = 10, torch_trace: bool = False) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1. Got {steps}")
        self.start_step = start_step
        self.steps = steps
        self.torch_trace = torch_trace
        self.trace_path: Path | None = None
        self._batch = 0
        self._cuda = False
        self._active = False
        self._in_optimizer_step = False
        self._profiler: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = None
        self._hooks: list[Any] = []

    def _push(self, name: str) -> None:
        if self._active and self._cuda:
            torch.cuda.nvtx.range_push(name)

    def _pop(self) -> None:
        if self._active and self._cuda:
            torch.cuda.nvtx.range_pop()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch = 0
        self._cuda = pl_module.device.type == "cuda"
        if self.start_step >= 0 and self._cuda:
            self._hooks = [
                pl_module.register_forward_pre_hook(lambda *_: self._push("forward")),
                pl_module.register_forward_hook(lambda *_: self._pop()),
            ]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.start_step < 0 or self._batch != self.start_step:
            self._push(f"step {self._batch}")
            return
        self._active = True
        if self._cuda:
            torch.cuda.profiler.start()
        if self.torch_trace:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self._cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
        self._push(f"step {self._batch}")
        self._open_step_range()

    def _close_step_range(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None

    def _open_step_range(self) -> None:
        # "train step N" in the trace: from the end of batch N-1 to the end of batch N, the wait for the
        # batch included (the first profiled one starts at its own batch start)
        self._close_step_range()
        if self._profiler is not None and self._batch < self.start_step + self.steps:
            self._step_range = torch.profiler.record_function(f"train step {self._batch}")
            self._step_range.__enter__()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._push("backward")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pop()

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self._push("optimizer step")
        self._in_optimizer_step = self._active and self._cuda

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._in_optimizer_step:  # no hook follows the optimizer step: its range ends with the batch
            self._pop()
            self._in_optimizer_step = False
        self._pop()
        self._batch += 1
        if self._active and self._batch >= self.start_step + self.steps:
            self._stop(trainer)
            trainer.should_stop = True
        elif self._active:
            self._open_step_range()

    def _stop(self, trainer: pl.Trainer) -> None:
        self._active = False
        if self._cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
        self._close_step_range()
        if self._profiler is not None:
            self._profiler.stop()
            folder = Path(trainer.log_dir or trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            self.trace_path = folder / (
                f"trace-rank{trainer.global_rank}.json" if trainer.world_size > 1 else "trace.json"
            )
            self._profiler.export_chrome_trace(str(self.trace_path))
            self._profiler = None
            rank_zero_info(f"Profiler trace: {self.trace_path}")
        rank_zero_info(f"Profiled batches {self.start_step} to {self.start_step + self.steps - 1}; stopping the run.")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._active:
            self._stop(trainer)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
