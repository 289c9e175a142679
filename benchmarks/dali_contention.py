"""What the DALI pipeline costs the model beside it, apart from what handing its batches over costs.

On one device and in one process, each row times the same number of steps of one architecture
(``throughput.py``'s SGD step: channels_last, float16 autocast with a gradient scaler on CUDA):

* ``model-alone``: steps on a random batch already on the device (``throughput.py``'s row);
* ``pipeline-alone``: the ``--data.decoder dali`` training pipeline (``DALILoader``) iterated without
  a model, as fast as it goes;
* ``model-beside-pipeline``: the ``model-alone`` steps while another thread takes one batch from the
  pipeline per step and drops it: the pipeline does the work of a ``fit`` (its CPU threads, its GPU
  kernels, the external source in the interpreter) but no step waits for its batch;
* ``model-taking-batches``: the ``model-alone`` steps, each after the training thread has taken a batch
  from the pipeline (as a loop fed by it would), the batch left unused: the host's hand-over without
  the training stream waiting for the batch on the device;
* ``model-fed-by-pipeline``: a plain loop that trains on the pipeline's batches (no Lightning);
* ``model-fed-one-ahead``: the same loop taking the next batch before it trains on the current one, as
  Lightning's training loop does.

``model-beside-pipeline`` under ``model-alone`` is what the pipeline's work takes from the model (GPU
or CPU contention); ``model-fed-by-pipeline`` under ``model-beside-pipeline`` is what waiting for each
batch adds, and ``model-taking-batches`` says how much of that is the training thread's time in
DALI's iterator rather than the device waiting for the batch. The rows that take batches in the
training thread also report the seconds of the timed steps it spent taking them
(``host_seconds_taking``). Each row reports images/s over ``--steps`` steps after ``--warmup`` steps,
with the device synchronised at both ends, and the table is written to ``--out`` as JSON.

    python benchmarks/dali_contention.py --out runs/contention.json --arch resnet18 --threads 8
    python benchmarks/dali_contention.py --out /tmp/contention.json --smoke   # CPU, tiny: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
ROWS = (
    "model-alone",
    "pipeline-alone",
    "model-beside-pipeline",
    "model-taking-batches",
    "model-fed-by-pipeline",
    "model-fed-one-ahead",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the rows")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny data, model and step counts")
    parser.add_argument("--data", default=None, help="shapes folder (default: throughput.py's, made if missing)")
    parser.add_argument("--arch", default=None, help="default resnet18")
    parser.add_argument("--threads", type=int, default=None, help="DALI CPU threads (default 8)")
    parser.add_argument("--hw-decoder-load", type=float, default=0.65)
    parser.add_argument("--batch-size", type=int, default=None, help="default 256")
    parser.add_argument("--crop-size", type=int, default=None, help="default 224")
    parser.add_argument("--warmup", type=int, default=None, help="steps before each row's timing (default 20)")
    parser.add_argument("--steps", type=int, default=None, help="steps timed in each row (default 200)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    args = parser.parse_args(argv)
    full = {"arch": "resnet18", "threads": 8, "batch_size": 256, "crop_size": 224, "warmup": 20, "steps": 200,
            "data": "/tmp/lit_imagenet_jpeg500", "per_class": 4267, "width": 500, "height": 375}  # fmt: skip
    smoke = {"arch": "resnet18", "threads": 1, "batch_size": 4, "crop_size": 32, "warmup": 1, "steps": 3,
             "data": str(args.out.parent / "contention-data"), "per_class": 8, "width": 40, "height": 40}  # fmt: skip
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    args.num_classes, args.compile = 6, False  # the shapes folder's classes; throughput.py's step reads both
    return args


def _batches(loader: Any) -> Iterator[list[torch.Tensor]]:
    """The loader's training batches, epoch after epoch (it moves its sampler on at each epoch's end)."""
    while True:
        yield from loader


def _timed(name: str, args: argparse.Namespace, device: torch.device, step: Any, start: Any = None) -> dict[str, Any]:
    """Times ``args.steps`` calls of ``step`` after ``args.warmup``; ``start()``, if given, is called in between."""
    from throughput import _sync

    for _ in range(args.warmup):
        step()
    _sync(device)
    if start is not None:
        start()
    began = time.perf_counter()
    for _ in range(args.steps):
        step()
    _sync(device)
    seconds = time.perf_counter() - began
    rate = args.steps * args.batch_size / seconds
    shown = f"{args.steps} steps of {args.batch_size} in {seconds:.2f} s"
    print(f"{name:<24} {rate:>10,.0f} images/s ({shown})", flush=True)
    return {"row": name, "images_per_sec": round(rate, 1), "seconds": round(seconds, 4), "steps": args.steps}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The rows of ``args.rows``, in that order."""
    from throughput import _model_alone_step, _step, _training_parts

    from lit_imagenet.dali import PASS_EPOCHS, DALILoader
    from lit_imagenet.folders import scan_split
    from lit_imagenet.samplers import EpochSeededSampler

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True  # as configs/resnet50.yaml
    _, samples = scan_split(Path(args.data) / "train")
    loader = DALILoader(
        samples, args.batch_size, True, args.crop_size, args.crop_size * 8 // 7, (0.08, 1.0), args.threads,
        sampler=EpochSeededSampler(samples, seed=0), device=device if cuda else None, channels_last=True,
        dtype=torch.float16 if cuda else torch.float32, hw_decoder_load=args.hw_decoder_load,
        pass_samples=PASS_EPOCHS * len(samples),
    )  # fmt: skip
    batches = _batches(loader)
    # The pipeline is built here, outside every row, and reads PASS_EPOCHS epochs: more than the rows take,
    # so that no row holds a build.
    next(batches)
    parts = _training_parts(args.arch, args, device)
    model_step = _model_alone_step(parts, args, device)
    model, optimizer, scaler, criterion = parts

    taking = [0.0]  # seconds the training thread spent in DALI's iterator since the row's timing began

    def start_taking() -> None:
        taking[0] = 0.0

    def take() -> list[torch.Tensor]:
        began = time.perf_counter()
        batch = next(batches)
        taking[0] += time.perf_counter() - began
        return batch

    def fed_step() -> None:
        images, targets = take()
        _step(model, optimizer, scaler, criterion, images, targets, device)

    def taking_step() -> None:
        take()
        model_step()

    pending: list[list[torch.Tensor]] = []

    def one_ahead_step() -> None:
        current = pending.pop() if pending else take()
        pending.append(take())
        _step(model, optimizer, scaler, criterion, *current, device)

    takers = {
        "model-taking-batches": taking_step,
        "model-fed-by-pipeline": fed_step,
        "model-fed-one-ahead": one_ahead_step,
    }
    rows = []
    for name in args.rows:
        if name == "model-alone":
            rows.append(_timed(name, args, device, model_step))
        elif name == "pipeline-alone":
            rows.append(_timed(name, args, device, lambda: next(batches)))
        elif name in takers:
            row = _timed(name, args, device, takers[name], start=start_taking)
            rows.append({**row, "host_seconds_taking": round(taking[0], 4)})
        else:
            rows.append(_beside(name, args, device, model_step, batches))
    return rows


def _beside(name: str, args: argparse.Namespace, device: torch.device, model_step: Any, batches: Iterator) -> dict:
    """``model_step`` timed while another thread takes, and drops, one batch from ``batches`` per step.

    The row's ``batches_dropped`` counts them (warm-up steps included) once the thread has caught up.
    """
    asked = threading.Semaphore(0)
    stop = threading.Event()
    failure: list[BaseException] = []
    dropped = [0]

    def drain() -> None:
        try:
            while True:
                if asked.acquire(timeout=0.05):
                    next(batches)
                    dropped[0] += 1
                elif stop.is_set():
                    return  # asked to stop, and every batch asked for taken
        except BaseException as err:  # reported by the main thread
            failure.append(err)

    def step() -> None:
        model_step()
        asked.release()

    thread = threading.Thread(target=drain, name="dali-drain", daemon=True)
    thread.start()
    try:
        row = _timed(name, args, device, step)
    finally:
        stop.set()
        thread.join()
    if failure:
        raise failure[0]
    return {**row, "batches_dropped": dropped[0]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
    sys.path.insert(0, str(REPO / "benchmarks"))
    from lit_imagenet.synthetic import make_shapes

    args.data = str(
        make_shapes(
            args.data,
            train_per_class=args.per_class,
            val_per_class=2 if args.smoke else 500,
            width=args.width,
            height=args.height,
            num_classes=args.num_classes,
            quality=90,
            processes=1 if args.smoke else (os.cpu_count() or 1),
        )  # fmt: skip
    )
    rows = measure(args)
    alone = {r["row"]: r["images_per_sec"] for r in rows}.get("model-alone")
    for row in rows:
        row["ratio_to_model_alone"] = round(row["images_per_sec"] / alone, 3) if alone else None
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device, "settings": settings, "rows": rows}, indent=2) + "\n")
    print(f"Wrote {args.out}")


if __name__ == "__main__":
    main()
