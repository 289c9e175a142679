"""A callback that ``benchmarks/startup.py --probe`` adds to a run: when its first batches came and went, and where the
main process's host memory lies.

It appends one JSON line per event to ``path``, each with the wall clock (``time.time()``), so that the benchmark,
which knows when it launched the run, turns them into seconds from launch:

* the set-up of the fit, by Lightning's hooks: ``setup`` (the data module is set up: the decoder's line has been
  printed), ``fit_start`` (the network is on its device with its optimizer and precision), ``train_start`` (the
  hyperparameters are logged, a checkpoint given is restored, the loaders are made and the sanity check is done)
  and ``epoch_start`` (each of the first two training epochs);
* ``batch_start`` and ``batch_end`` of each of the first ``first_steps`` training batches: the first
  ``batch_start`` is when the loader handed over the first batch;
* ``memory`` at the end of steps 20, 50, 100, 200, 300, 390 and every 500th after: the main process's PSS from
  ``/proc/self/smaps``, split by what is mapped (``shared memory``: the loader workers' batches in ``/dev/shm`` or
  memfd files; ``device``: mappings of ``/dev/nvidia*``; ``files``: libraries and other files; ``anonymous``: the
  heap and the rest), and the page-locked host memory that torch's caching host allocator holds for batches that
  wait to be copied to the GPU (``torch.cuda.host_memory_stats``, its byte counts, current and peak), on CUDA.

The events are host times: a step's CUDA work may still run after its ``batch_end``.

    python train.py fit ... '--trainer.callbacks+={"class_path": "benchmarks.probe.StartupProbe",
                                                   "init_args": {"path": "probe.jsonl"}}'
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

# Not at step 10, a restart's last, nor at 400, a first run's, whose line ends the run: reading smaps takes a
# large process tens of milliseconds, which would land in the benchmark's times.
MEMORY_STEPS = (20, 50, 100, 200, 300, 390)


def pss_by_kind(smaps: str = "/proc/self/smaps", field: str = "Pss") -> dict[str, float]:
    """A process's PSS in GiB, split by what its mappings map: shared memory, device files, other files, anonymous.

    ``field`` names another of smaps' sizes to add up instead (``Rss``: resident memory).
    """
    kinds = {"shared memory": 0, "device": 0, "files": 0, "anonymous": 0}
    kind = "anonymous"
    with open(smaps) as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):  # a mapping's header: address range, perms, offset, device, inode, path
                fields = line.split(None, 5)
                path = fields[5].strip() if len(fields) > 5 else ""
                if path.startswith(("/dev/shm/", "/memfd:", "memfd:")):
                    kind = "shared memory"
                elif path.startswith("/dev/"):
                    kind = "device"
                elif path.startswith("/"):
                    kind = "files"
                else:
                    kind = "anonymous"
            elif first == f"{field}:":
                kinds[kind] += int(line.split()[1])
    return {k: round(v / 2**20, 3) for k, v in kinds.items()}


def pinned_bytes() -> dict[str, int]:
    """The caching host allocator's byte counts (current and peak), or nothing where CUDA is not in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.host_memory_stats()
    return {k: int(v) for k, v in stats.items() if "bytes" in k and k.endswith((".current", ".peak"))}


class StartupProbe(pl.Callback):
    """Writes the run's first batches and its main process's memory to ``path``, one JSON line per event.

    Args:
        path: The file the events are appended to.
        first_steps: The training batches whose start and end are written.
        memory_steps: The steps after which the memory is written (and every 500th); default ``MEMORY_STEPS``.
    """

    def __init__(self, path: str, first_steps: int = 12, memory_steps: list[int] | None = None) -> None:
        self.path = Path(path)
        self.first_steps = first_steps
        self.memory_steps = set(MEMORY_STEPS if memory_steps is None else memory_steps)
        self._batches = 0
        self._epochs = 0
        self._memory_step = -1  # the last step whose memory was written

    def _write(self, event: str, **fields: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero and stage == "fit":
            self._write("setup", step=trainer.global_step)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._write("fit_start", step=trainer.global_step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self._write("train_start", step=trainer.global_step)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and self._epochs < 2:
            self._write("epoch_start", step=trainer.global_step, epoch=trainer.current_epoch)
        self._epochs += 1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if trainer.is_global_zero and self._batches < self.first_steps:
            self._write("batch_start", step=trainer.global_step, batch=batch_idx)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if not trainer.is_global_zero:
            return
        step = trainer.global_step
        if self._batches < self.first_steps:
            self._write("batch_end", step=step, batch=batch_idx)
        self._batches += 1
        if step != self._memory_step and (step in self.memory_steps or (step > 0 and step % 500 == 0)):
            self._memory_step = step
            self._write("memory", step=step, main_pss_gib=pss_by_kind(), pinned=pinned_bytes())
