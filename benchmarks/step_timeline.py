"""Where the time of ``fit``'s training epochs goes, from CUDA events and the host clock, without a profiler.

A callback for ``train.py fit``::

    python train.py fit --config configs/resnet50.yaml ... --trainer.callbacks+=benchmarks.step_timeline.StepTimeline

(with the repository on ``PYTHONPATH``). PyTorch's profiler doubles the host's time per step of ``fit``
with ``dali``, so its traces cannot say whether the host, the loader or the GPU
limits a run without it. This callback costs a few microseconds a hook: at each training batch's start,
before its backward pass, before its optimizer step and at its end it reads the host clock and records
a CUDA event on the current stream (the training step's).
At the epoch's end, after one synchronisation, every event is placed on the host's clock through one
recorded on the idle GPU at the epoch's start, and each step N gets:

* ``kernels_ms``: the GPU's time from step N's start event to its end event: the step's own work
  (forward, backward, optimizer) as the GPU ran it, slowed by whatever shared the GPU meanwhile;
* ``gap_ms`` (from the second step): the GPU's time from step N-1's end event to step N's start event,
  in which the training stream ran nothing of the steps. ``host_wait_ms`` is the part of it before the
  host recorded step N's start event (the GPU waited for the host); ``queued_wait_ms`` the rest, spent
  on what the host queued on the stream between the steps (the loader's next batch, taken by then,
  with its wait on the loader's stream);
* ``host_ms`` (from the second step): the host's time from step N-1's end hook to step N's, and
  ``between_ms`` of it, from step N-1's end hook to step N's start hook (Lightning's loop and the
  fetch of batch N+1);
* ``lead_ms``: how long after the host recorded step N's start event the GPU reached it (the host's
  lead over the GPU; near 0 when the GPU waits for the host);
* for each phase of the step, ``forward`` (start to backward), ``backward`` (to the optimizer step) and
  ``optimizer`` (to the end): ``PHASE_ms`` on the GPU, ``host_PHASE_ms`` on the host, and the lead at
  the mark that ends it (``lead_backward_ms``, ``lead_optimizer_ms``, ``lead_end_ms``).

The epoch's time splits exactly into ``head_s`` (epoch start to the GPU's start of the first step),
``steps_s`` (the first step's start to the last one's end, on the GPU: the kernels and the gaps) and
``tail_s`` (the last step's end on the GPU to the epoch's end: validation, checkpoints, the loader's
end of epoch). Each process writes ``step_timeline-rank{R}.json`` (the per-step rows and each epoch's
sums and medians) in the trainer's ``default_root_dir`` or ``out``, and rank 0 prints one line an
epoch. On a CPU the "GPU" times are the host's, at the hooks.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from typing_extensions import override

from lit_imagenet.training.readback import sync_device

# The marks a step's phases begin at, and the phases' names; each phase ends at the next mark, the last at "end".
PHASES = {"start": "forward", "backward": "backward", "optimizer": "optimizer"}


def summarise(rows: list[dict[str, float]], epoch_s: float, head_s: float, tail_s: float) -> dict[str, Any]:
    """Sums and medians of one epoch's step rows (as ``StepTimeline`` makes them), in milliseconds."""

    def column(key: str) -> list[float]:
        return [row[key] for row in rows if key in row]

    summary: dict[str, Any] = {
        "steps": len(rows),
        "images": sum(int(row["images"]) for row in rows),
        "epoch_s": epoch_s,
        "head_s": head_s,
        "steps_s": epoch_s - head_s - tail_s,
        "tail_s": tail_s,
    }
    keys = ["kernels_ms", "gap_ms", "host_wait_ms", "queued_wait_ms", "host_ms", "between_ms", "lead_ms"]
    keys += sorted({key for row in rows for key in row} - set(keys) - {"images"})
    for key in keys:
        values = column(key)
        summary[key] = {
            "sum": sum(values),
            "median": statistics.median(values) if values else None,
            "max": max(values) if values else None,
        }
    return summary


class StepTimeline(pl.Callback):
    """Times each training step on the GPU and on the host; see the module's docstring.

    Args:
        out: Folder for ``step_timeline-rank{R}.json`` (default: the trainer's ``default_root_dir``).
    """

    def __init__(self, out: str | None = None) -> None:
        self.out = out
        self.epochs: list[dict[str, Any]] = []
        self._marks: list[tuple[str, float, Any, int]] = []  # (kind, host seconds, event or None, images)
        self._epoch_start = 0.0
        self._reference: tuple[float, Any] | None = None

    def _mark(self, kind: str, pl_module: pl.LightningModule, images: int = 0) -> None:
        now = time.perf_counter()
        event = None
        if pl_module.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((kind, now, event, images))

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed part-way through an epoch gets no on_train_epoch_start for that epoch.
        self.on_train_epoch_start(trainer, pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device(pl_module)
        self._marks = []
        self._reference = None
        if pl_module.device.type == "cuda":
            # The GPU is idle: the event runs as it is recorded, between the two clock readings.
            before = time.perf_counter()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._reference = ((before + time.perf_counter()) / 2, event)
        self._epoch_start = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._mark("start", pl_module)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self._mark("backward", pl_module)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._mark("optimizer", pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._mark("end", pl_module, int(batch[0].shape[0]))

    def _device_time(self, host: float, event: Any) -> float:
        if self._reference is None or event is None:
            return host
        at, reference = self._reference
        return at + reference.elapsed_time(event) / 1000

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        sync_device(pl_module)
        epoch_end = time.perf_counter()
        marks = [(kind, host, self._device_time(host, event), images) for kind, host, event, images in self._marks]
        rows: list[dict[str, float]] = []
        previous: tuple[float, float] | None = None  # the last step's end: host, device
        step: dict[str, tuple[float, float]] = {}
        for kind, at_host, at_device, images in marks:
            if kind == "start":
                step = {}
            step[kind] = (at_host, at_device)
            if kind != "end" or "start" not in step:
                continue
            (host, device), (end_host, end_device) = step["start"], step["end"]
            row = {
                "images": float(images),
                "kernels_ms": (end_device - device) * 1000,
                "lead_ms": (device - host) * 1000,
            }
            marked = [name for name in PHASES if name in step] + ["end"]
            for begin, following in zip(marked, marked[1:]):
                row[f"{PHASES[begin]}_ms"] = (step[following][1] - step[begin][1]) * 1000
                row[f"host_{PHASES[begin]}_ms"] = (step[following][0] - step[begin][0]) * 1000
                row[f"lead_{following}_ms"] = (step[following][1] - step[following][0]) * 1000
            if previous is not None:
                gap = device - previous[1]
                host_wait = min(gap, max(0.0, host - previous[1]))
                row.update(
                    gap_ms=gap * 1000,
                    host_wait_ms=host_wait * 1000,
                    queued_wait_ms=(gap - host_wait) * 1000,
                    host_ms=(end_host - previous[0]) * 1000,
                    between_ms=(host - previous[0]) * 1000,
                )
            rows.append(row)
            previous = (end_host, end_device)
        starts = [device for kind, _, device, _ in marks if kind == "start"]
        head = (starts[0] - self._epoch_start) if starts else epoch_end - self._epoch_start
        tail = (epoch_end - previous[1]) if previous else 0.0
        summary = summarise(rows, epoch_end - self._epoch_start, head, tail)
        self.epochs.append({"epoch": trainer.current_epoch, "summary": summary, "rows": rows})
        self._marks = []
        folder = Path(self.out or trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"step_timeline-rank{trainer.global_rank}.json").write_text(json.dumps(self.epochs, indent=1))
        if trainer.is_global_zero:
            print(_line(trainer.current_epoch, summary), flush=True)


def _line(epoch: int, s: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        median = s[key]["median"]
        return "-" if median is None else f"{median:.2f}"

    return (
        f"Step timeline, epoch {epoch}: {s['epoch_s']:.3f} s = head {s['head_s']:.3f} + steps {s['steps_s']:.3f}"
        f" + tail {s['tail_s']:.3f}; {s['steps']} steps, sums: kernels {s['kernels_ms']['sum'] / 1000:.3f} s,"
        f" gaps {s['gap_ms']['sum'] / 1000:.3f} s (host {s['host_wait_ms']['sum'] / 1000:.3f},"
        f" queued {s['queued_wait_ms']['sum'] / 1000:.3f}); medians (ms): kernels {ms('kernels_ms')},"
        f" gap {ms('gap_ms')}, host per step {ms('host_ms')}, between steps {ms('between_ms')}, lead {ms('lead_ms')};"
        + "".join(
            f" {phase} {ms(f'{phase}_ms')} (host {ms(f'host_{phase}_ms')}, lead after {ms(f'lead_{end}_ms')})"
            for phase, end in (("forward", "backward"), ("backward", "optimizer"), ("optimizer", "end"))
            if f"{phase}_ms" in s
        )
    )
