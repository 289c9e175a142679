"""The reference's ``--prof N`` as a callback: NVTX ranges and the CUDA profiler over a window of training batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override


class Profile(pl.Callback):
    """Profiles ``steps`` training batches from batch ``start_step`` (-1: off), then ends the run. On CUDA each batch,
    forward, backward and optimizer step gets an NVTX range and the CUDA profiler runs over the window (``nsys profile
    --capture-range=cudaProfilerApi``); ``torch_trace`` also records it to ``trace.json`` in the log folder."""

    def __init__(self, start_step: int = -1, steps: int = 10, torch_trace: bool = False) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1. Got {steps}")
        self.start_step, self.steps, self.torch_trace = start_step, steps, torch_trace
        self.trace_path: Path | None = None
        self._active = False
        self._nvtx = False  # NVTX ranges: on CUDA, inside the window
        self._open_ranges = 0
        self._profiler: torch.profiler.profile | None = None
        self._step_range: torch.profiler.record_function | None = None
        self._hooks: list[Any] = []

    def _push(self, name: str) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_push(name)
            self._open_ranges += 1

    def _pop(self) -> None:
        if self._nvtx and self._open_ranges:
            torch.cuda.nvtx.range_pop()
            self._open_ranges -= 1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batch = 0
        if self.start_step >= 0 and pl_module.device.type == "cuda":
            self._hooks = [
                pl_module.register_forward_pre_hook(lambda *_: self._push("forward")),
                pl_module.register_forward_hook(lambda *_: self._pop()),
            ]

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._batch == self.start_step >= 0:
            self._active = True
            self._nvtx = pl_module.device.type == "cuda"
            if self._nvtx:
                torch.cuda.profiler.start()
            if self.torch_trace:
                activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * self._nvtx
                self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
                self._profiler.start()
            self._open_step_range()
        self._push(f"step {self._batch}")

    def _open_step_range(self) -> None:
        # "train step N" in the trace runs from the end of batch N-1, the wait for the batch included
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._active and self._profiler is not None:
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
        self._push("optimizer step")  # no hook follows the step: its range ends with the batch

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        while self._open_ranges:
            self._pop()
        self._batch += 1
        if self._active and self._batch >= self.start_step + self.steps:
            self._stop(trainer)
            trainer.should_stop = True
        elif self._active:
            self._open_step_range()

    def _stop(self, trainer: pl.Trainer) -> None:
        self._active = False
        if self._nvtx:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            self._nvtx = False
        self._open_step_range()  # inactive: closes the last one
        if self._profiler is not None:
            self._profiler.stop()
            folder = Path(trainer.log_dir or trainer.default_root_dir)
            folder.mkdir(parents=True, exist_ok=True)
            name = f"trace-rank{trainer.global_rank}.json" if trainer.world_size > 1 else "trace.json"
            self.trace_path = folder / name
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
