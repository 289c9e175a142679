"""Callbacks that tests add to a real ``train.py`` run through ``--config``."""

from __future__ import annotations

import builtins
import functools
import json
import os
import time
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


class RecordReads(pl.Callback):
    """Logs every file under ``root`` that Python opens for reading, in this process and the loader workers it forks.

    Each line of ``folder/reads-PID.txt`` is ``TIME PID PARENT PATH`` (``TIME`` from the monotonic clock, which
    all processes of a machine share); ``TIME PID PARENT TRAIN RANK`` marks the start of training. Installed when
    the trainer is made, before any loader reads a file.

    Args:
        folder: Where to write.
        root: The folder whose files are logged.
    """

    def __init__(self, folder: str, root: str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        root = str(Path(root).resolve())
        original = builtins.open

        def log(line: str) -> None:
            with original(self.folder / f"reads-{os.getpid()}.txt", "a") as f:
                f.write(f"{time.monotonic():.6f} {os.getpid()} {os.getppid()} {line}\n")

        @functools.wraps(original)
        def opened(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, os.PathLike)) and "r" in mode and os.path.abspath(file).startswith(root):
                log(os.path.abspath(file))
            return original(file, mode, *args, **kwargs)

        builtins.open = opened
        self._log = log

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(f"TRAIN {trainer.global_rank}")


class RecordBatches(pl.Callback):
    """Writes a JSON line per training batch to ``folder/batches-rankN.jsonl``: the epoch, the batch's index in it,
    the global step before its optimizer step, its learning rate and its labels.

    Args:
        folder: Where to write.
    """

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self._lr = 0.0
        self._step = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._lr, self._step = float(trainer.optimizers[0].param_groups[0]["lr"]), trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self.folder.mkdir(parents=True, exist_ok=True)
        row = {"epoch": trainer.current_epoch, "batch": batch_idx, "step": self._step, "lr": self._lr,
               "labels": batch[1].tolist()}  # fmt: skip
        with open(self.folder / f"batches-rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


class SlowSteps(pl.Callback):
    """Makes every training batch take ``seconds`` longer, for runs stopped by the clock (``--trainer.max_time``).

    Args:
        seconds: The wait after each training batch.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        time.sleep(self.seconds)


class StopAfterStep(pl.Callback):
    """Sets ``trainer.should_stop`` after the optimizer step ``step`` (counted from 1), as an early stop does.

    Args:
        step: The global step after which the run stops.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True
