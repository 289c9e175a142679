"""Training throughput of the model alone, of a hand-written loop like the reference's, and of ``fit``.

For each architecture, on one generated folder of JPEGs (``lit_imagenet.data.synthetic.make_shapes``,
~500x375 at quality 90 by default), it measures side by side:

* ``model-alone``: a hand-written loop on a random uint8 batch already on the device, normalised
  on the device at each step (channels_last, float16 autocast with a gradient scaler on CUDA,
  float32 on CPU; SGD, fused on CUDA as ``fit`` uses it). The ceiling for the rows that load data.
* ``fit-synthetic``: the project's ``fit`` (``benchmarks/fit_synthetic.py``: the same command line
  with ``SyntheticDataModule``) doing the same work as ``model-alone``: random uint8 batches made
  on the GPU, same steps per epoch, no validation or checkpoint. What Lightning costs.
* ``loop``: the reference's training loop written out by hand: ``ImageFolderDataset`` (PIL decoding,
  RandomResizedCrop, flip) in a ``DataLoader`` with ``collate_uint8`` (channels_last), persistent
  workers and pinned memory, the project's ``CUDAPrefetcher`` (side-stream copy and normalisation),
  ``torch.autocast`` with ``torch.amp.GradScaler``, and SGD with the recipe's hyperparameters (at a
  constant learning rate). On CPU the batches are normalised with ``Uint8Normalize``.
* ``fit-<decoder>``: ``train.py fit --config configs/resnet50.yaml`` in a subprocess, one row per
  ``--data.decoder`` (``nvjpeg@0.4`` means ``--data.decoder nvjpeg --data.gpu_share 0.4``; ``dali``
  needs NVIDIA DALI installed, and ``--workers`` is then its thread count), with 2 validation batches
  and the checkpoint save in each epoch, as a real run has.

Every row is timed over whole epochs with the host clock, epoch start included, and the GPU
synchronised at each epoch's start and end; the row reports the last epoch (``--epochs``, 2 by
default: the first one pays for cuDNN's autotuning, compilation and starting the workers). Peak
memory is the largest ``torch.cuda.max_memory_allocated`` of that epoch (memory nvJPEG allocates
for itself is not counted there; CUDA graphs take their memory pool as they are recorded, in the
first epoch, so later epochs' peaks of ``cudagraphs`` rows leave it out). ``model-alone`` and
``loop`` run on one device; ``--devices 1 2``
runs every ``fit`` row on 1 and on 2 GPUs (DDP). The ratio column divides each row's images/s by
the ``model-alone`` images/s of the same architecture and mode. ``--compile MODE ...`` runs the rows
once per mode of the network: ``eager``, ``default`` (compiled) and ``cudagraphs`` (compiled and
replayed as CUDA graphs) and ``background`` (eager until a background compile ends), the ``fit`` rows
with ``--model.compile`` set to match; without it the rows run the recipe's mode (its ``compile: auto``:
``background`` on CUDA, eager on a CPU), the ``fit`` rows with the recipe's own ``--model.compile``. A
``fit`` row that compiles in the background on one GPU runs until its switch to the compiled network and
reports its first epoch wholly after it (``switch`` in its record: the child's seconds, the step, the
first compiled step's seconds, the graphs found in the caches), then stops; its ``model-alone`` row is
the compiled network. Every row's process keeps inductor's caches in
``OUT/compile_cache`` (unless ``TORCHINDUCTOR_CACHE_DIR`` names another folder); the ``fit`` rows'
network is not the model alone's graph, so each row's first epoch still compiles much of it. The
table is printed and written to ``OUT/throughput.json``
(with the hardware and versions) and ``OUT/throughput.png``.

    python benchmarks/throughput.py --out runs/throughput --devices 1 2
    python benchmarks/throughput.py --out runs/throughput-r50 --archs resnet50 --decoders nvjpeg nvjpeg@0.5
    python benchmarks/throughput.py --out runs/throughput-dali --skip loop --decoders dali nvjpeg
    python benchmarks/throughput.py --out /tmp/tp --smoke   # CPU, tiny sizes, well under a minute

``--timeline`` adds ``benchmarks/step_timeline.py``'s callback to the ``fit`` rows: each keeps, as ``timeline``,
that callback's summary of the epoch it reports (the GPU's time in the steps' kernels and between them, and
how far the host ran ahead), which says whether the GPU, the host or the loader held the row.

``--row-timeout S`` stops a ``fit`` row (its whole process group: DDP ranks and loader workers too) after
S seconds; it then reports the epochs it finished, or none.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
EPOCH_LINE = re.compile(r"Epoch (\d+): ([\d,.]+) images/s .*?(?:peak GPU memory ([\d.]+) GiB)?$")
LR_PER_256, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-4  # configs/resnet50.yaml
#: ``--compile``'s modes, and the ``--model.compile`` value of each.
COMPILE_MODES = {"eager": "false", "default": "true", "cudagraphs": "cudagraphs", "background": "background"}
#: A background compile's switch (``--model.compile background``, the recipe's ``auto`` on one GPU), and its failure.
SWITCH_LINE = re.compile(
    r"^Compiled the network from the caches of its background compile \(([\d.]+) s\) at step (\d+) "
    r"and ran its first compiled step in ([\d.]+) s: (\d+) of (\d+) graphs"
)
BACKGROUND_MAX_EPOCHS = 500
TIMELINE = "benchmarks.step_timeline.StepTimeline"
TIMELINE_LINE = re.compile(r"^Step timeline, epoch (\d+):")
NO_SWITCH_LINE = re.compile(r"^Compile: (eager|default) \((the background compile|too little free memory)")
DECODER = re.compile(r"^(pil|torchvision|nvjpeg|dali)(?:@([01](?:\.\d+)?))?$")


def _decoder(text: str) -> str:
    match = DECODER.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not pil, torchvision, nvjpeg, nvjpeg@SHARE (0 to 1) or dali")
    if match.group(2) is not None and (match.group(1) != "nvjpeg" or not 0 <= float(match.group(2)) <= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: only nvjpeg takes a GPU share, between 0 and 1")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny data and model steps: checks the script")
    parser.add_argument("--data", default=None, help="shapes folder (default /tmp/lit_imagenet_jpeg500)")
    parser.add_argument("--archs", nargs="+", default=None, help="default resnet50 resnet18 (smoke: resnet18)")
    parser.add_argument("--decoders", nargs="*", type=_decoder, default=["pil", "torchvision", "nvjpeg"],
                        help="fit rows: pil, torchvision, nvjpeg, nvjpeg@SHARE (the GPU's share), or dali; "
                             "given with no value: no fit row on JPEGs")  # fmt: skip
    parser.add_argument("--devices", type=int, nargs="+", default=[1], help="GPU counts of the fit rows (DDP if > 1)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["model-alone", "fit-synthetic", "loop"],
                        help="leave out these rows (model-alone is needed for the ratios)")  # fmt: skip
    parser.add_argument("--compile", nargs="*", default=None, choices=list(COMPILE_MODES),
                        help="the network's modes, each a set of rows (model-alone, fit rows): eager, default "
                             "(torch.compile), cudagraphs (compiled and replayed as CUDA graphs, torch.compile's "
                             "reduce-overhead), background (eager until a background compile ends, then compiled); "
                             "--compile alone: default (default: the recipe's mode, background on a GPU)")  # fmt: skip
    parser.add_argument("--cpus-per-gpu", type=int, default=None,
                        help="run each row on the first N CPUs per GPU it uses, of those the script may use "
                             "(default: all of them)")  # fmt: skip
    parser.add_argument("--row-timeout", type=float, default=None,
                        help="stop a fit row after this many seconds; it reports the epochs it finished")  # fmt: skip
    parser.add_argument("--workers", type=int, default=None, help="loader workers per process (default 15)")
    parser.add_argument("--batch-size", type=int, default=None, help="per device (default 256)")
    parser.add_argument("--crop-size", type=int, default=None, help="default 224")
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs of every row; the last is reported (default 2)"
    )
    parser.add_argument("--model-steps", type=int, default=None,
                        help="steps per epoch of model-alone, fit-synthetic (default: the JPEG folder's)")  # fmt: skip
    parser.add_argument("--width", type=int, default=None, help="image width (default 500)")
    parser.add_argument("--height", type=int, default=None, help="image height (default 375)")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--train-per-class", type=int, default=None, help="default 4267 (6 classes: 25,602)")
    parser.add_argument("--val-per-class", type=int, default=None, help="default 500")
    parser.add_argument("--num-classes", type=int, default=None, help="default 6")
    parser.add_argument("--timeline", action="store_true",
                        help="time each fit row's steps with benchmarks/step_timeline.py; the row keeps the summary of "
                             "the epoch it reports")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more train.py arguments for the fit rows, after --")
    args = parser.parse_args(argv)
    # None: the recipe's mode, the fit rows with the recipe's own --model.compile.
    args.modes = [None] if args.compile is None else list(dict.fromkeys(args.compile or ["default"]))
    args.compile = None  # the mode of the rows being run, one of args.modes
    args.recipe_mode = False  # whether the fit rows leave --model.compile to the recipe
    # The CPUs this process may use when it starts (``taskset`` narrows them), before a row narrows them further.
    args.start_cpus = (
        sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    )
    full = {"archs": ["resnet50", "resnet18"], "workers": 15, "batch_size": 256, "crop_size": 224, "epochs": 2,
            "width": 500, "height": 375, "train_per_class": 4267, "val_per_class": 500, "num_classes": 6,
            "data": "/tmp/lit_imagenet_jpeg500"}  # fmt: skip
    smoke = {"archs": ["resnet18"], "workers": 0, "batch_size": 4, "crop_size": 32, "epochs": 1,
             "width": 40, "height": 40, "train_per_class": 8, "val_per_class": 2, "num_classes": 3,
             "data": str(args.out / "data")}  # fmt: skip
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model_steps is None:
        args.model_steps = -(-args.num_classes * args.train_per_class // args.batch_size)
    if min(args.devices) < 1:
        parser.error(f"--devices must be at least 1. Got {args.devices}")
    if args.epochs < 1 or args.model_steps < 1:
        parser.error("--epochs and --model-steps must be at least 1")
    return args


def recipe_mode(device: torch.device) -> str:
    """The mode of the network that ``configs/resnet50.yaml`` trains on ``device``: one of ``COMPILE_MODES``."""
    import yaml

    asked = yaml.safe_load((REPO / "configs" / "resnet50.yaml").read_text()).get("model", {}).get("compile", False)
    if asked == "auto":  # on several GPUs (DDP) the run itself compiles at its first step instead, and says so
        return "background" if device.type == "cuda" else "eager"
    return {False: "eager", True: "default"}.get(asked, asked)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _training_parts(arch: str, args: argparse.Namespace, device: torch.device) -> tuple[Any, ...]:
    from lit_imagenet.training.models import build_model
    from lit_imagenet.training.schedule import scaled_lr

    model = build_model(arch, args.num_classes).to(device, memory_format=torch.channels_last).train()
    if args.compile in ("default", "cudagraphs", "background"):  # a background compile's network, once switched
        model.compile(dynamic=False, mode="reduce-overhead" if args.compile == "cudagraphs" else None)
    cuda = device.type == "cuda"
    optimizer = torch.optim.SGD(
        model.parameters(), lr=scaled_lr(LR_PER_256, args.batch_size), momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
        **({"fused": True} if cuda else {}),
    )  # fmt: skip
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)
    return model, optimizer, scaler, nn.CrossEntropyLoss().to(device)


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    criterion: nn.Module,
    images: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
) -> None:
    with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
        loss = criterion(model(images), targets)
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()


def _timed_epochs(name: str, args: argparse.Namespace, device: torch.device, run_epoch: Any) -> dict[str, Any]:
    """Runs ``run_epoch()`` (which returns its image count) ``args.epochs`` times; the last epoch is reported."""
    epochs = []
    for epoch in range(args.epochs):
        _sync(device)
        _reset_memory(device)
        began = time.perf_counter()
        count = run_epoch()
        _sync(device)
        seconds = time.perf_counter() - began
        epochs.append({"epoch": epoch, "images": count, "seconds": seconds, "images_per_sec": count / seconds,
                       "peak_memory_gib": _peak_memory(device)})  # fmt: skip
        print(f"  {name} epoch {epoch}: {count / seconds:,.0f} images/s ({count:,} images in {seconds:.1f} s)")
    last = epochs[-1]
    return {"images_per_sec": last["images_per_sec"], "peak_memory_gib": last["peak_memory_gib"], "epochs": epochs}


def _model_alone_step(parts: tuple[Any, ...], args: argparse.Namespace, device: torch.device) -> Any:
    """One SGD step of ``_training_parts``' model on a random uint8 batch already on the device, normalised there."""
    from lit_imagenet.data.presets import Uint8Normalize

    model, optimizer, scaler, criterion = parts
    normalize = Uint8Normalize().to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch_size, 3, args.crop_size, args.crop_size)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
    images = images.contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=generator)

    graphed = args.compile == "cudagraphs"

    def step() -> None:
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        _step(model, optimizer, scaler, criterion, normalize(images), targets, device)

    return step


def model_alone(arch: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """SGD steps on a random uint8 batch already on the device, normalised there at each step."""
    step = _model_alone_step(_training_parts(arch, args, device), args, device)

    def run_epoch() -> int:
        for _ in range(args.model_steps):
            step()
        return args.model_steps * args.batch_size

    return _timed_epochs(f"model-alone {arch}{_mode_suffix(args)}", args, device, run_epoch)


def hand_loop(arch: str, args: argparse.Namespace, device: torch.device, root: Path) -> dict[str, Any]:
    """The reference's loop: uint8 collation, pinned memory, side-stream prefetch, native AMP, SGD."""
    from torch.utils.data import DataLoader
    from torchvision import transforms

    from lit_imagenet.data.datasets import ImageFolderDataset, collate_uint8
    from lit_imagenet.data.folders import scan_split
    from lit_imagenet.data.images import load_rgb
    from lit_imagenet.data.prefetch import CUDAPrefetcher
    from lit_imagenet.data.presets import Uint8Normalize

    cuda = device.type == "cuda"
    samples = scan_split(root / "train").samples
    transform = transforms.Compose([transforms.RandomResizedCrop(args.crop_size), transforms.RandomHorizontalFlip()])
    loader = DataLoader(
        ImageFolderDataset(samples, transform, load_rgb),
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        collate_fn=partial(collate_uint8, memory_format=torch.channels_last),
        pin_memory=cuda,
        persistent_workers=args.workers > 0,
        drop_last=False,
    )
    model, optimizer, scaler, criterion = _training_parts(arch, args, device)
    normalize = Uint8Normalize().to(device)

    def run_epoch() -> int:
        count = 0
        if cuda:
            batches = CUDAPrefetcher(iter(loader), device, normalize)
        else:
            batches = ((normalize(images), targets) for images, targets in loader)
        for images, targets in batches:
            if args.compile == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()
            _step(model, optimizer, scaler, criterion, images, targets, device)
            count += int(images.shape[0])
        return count

    return _timed_epochs(f"loop {arch}", args, device, run_epoch)  # the workers stop with the loader


def _cpus(args: argparse.Namespace, gpus: int) -> set[int] | None:
    """The CPUs a row with ``gpus`` GPUs may use under ``--cpus-per-gpu`` (``None``: all)."""
    if args.cpus_per_gpu is None:
        return None
    return set(args.start_cpus[: args.cpus_per_gpu * gpus])


def _background(args: argparse.Namespace, devices: int) -> bool:
    """Whether a fit row's run trains eagerly until a background compile ends (on several GPUs it compiles at once)."""
    return args.compile == "background" and devices == 1


def _run_fit(name: str, cmd: list[str], args: argparse.Namespace, gpus: int, out: Path | None = None) -> dict[str, Any]:
    """Runs a ``fit`` row; reports its last epoch or, where it compiles in the background, its first epoch wholly
    after the switch to the compiled network, stopping the run there (or where it says it stays eager). With
    ``--timeline`` the row's ``timeline`` is the step timeline's summary of that epoch, read from ``out``."""
    cpus = _cpus(args, gpus)
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    background = _background(args, gpus)
    # A session of its own, so that a row stopped by --row-timeout takes its DDP ranks and workers with it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            preexec_fn=pin, start_new_session=True)  # fmt: skip
    stopped = {"timed_out": False, "at_switch": False}

    def stop(reason: str) -> None:
        if proc.poll() is None:
            stopped[reason] = True
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(args.row_timeout, stop, ("timed_out",)) if args.row_timeout else None
    if timer is not None:
        timer.start()
    lines: list[str] = []
    switch: dict[str, Any] | None = None
    epochs: list[tuple[str, str, str | None]] = []
    timed: set[int] = set()  # the epochs whose step timeline was written
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            line = line.rstrip("\n")
            if (match := EPOCH_LINE.search(line)) is not None:
                epochs.append(match.groups())
            if (match := TIMELINE_LINE.match(line)) is not None:
                timed.add(int(match.group(1)))
            if background and switch is None and (match := SWITCH_LINE.match(line)) is not None:
                child, step, first, found, graphs = match.groups()
                switch = {"child_seconds": float(child), "step": int(step), "first_compiled_step_seconds": float(first),
                          "graphs_found": int(found), "graphs": int(graphs), "epoch": len(epochs)}  # fmt: skip
            elif background and switch is None and NO_SWITCH_LINE.match(line):
                switch = {"stays": line}
                stop("at_switch")
            if switch is not None and "epoch" in switch and epochs and int(epochs[-1][0]) > switch["epoch"]:
                if not args.timeline or int(epochs[-1][0]) in timed:  # its timeline is written after its line
                    stop("at_switch")  # the first epoch wholly after the switch has ended
        proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
    text = "".join(lines)
    log = args.out / "logs" / f"{name}.log"
    log.write_text(" ".join(cmd) + "\n" + text)
    if proc.returncode != 0 and not any(stopped.values()):
        raise SystemExit(f"{name} failed ({proc.returncode}), see {log}:\n{text[-3000:]}")
    if not epochs and not stopped["timed_out"]:
        raise SystemExit(f"{name} printed no Throughput line, see {log}")
    if background and (switch is None or "epoch" not in switch or int(epochs[-1][0]) <= switch["epoch"]):
        epochs = []  # no epoch of the compiled network: eager epochs would say nothing of the recipe
    rate, memory = (epochs[-1][1], epochs[-1][2]) if epochs else (None, None)
    timeline = _timeline_summary(out, int(epochs[-1][0])) if args.timeline and out is not None and epochs else None
    return {
        "images_per_sec": float(rate.replace(",", "")) if rate else None,
        "peak_memory_gib": float(memory) if memory else None,
        "epochs": [{"epoch": int(e), "images_per_sec": float(r.replace(",", ""))} for e, r, _ in epochs],
        "timed_out": stopped["timed_out"],
        **({"switch": switch} if background else {}),
        **({"timeline": timeline} if args.timeline else {}),
        "log": str(log),
    }


def _timeline_summary(out: Path, epoch: int) -> dict[str, Any] | None:
    """Rank 0's step timeline summary of ``epoch`` (``benchmarks/step_timeline.py``), or None where none was written."""
    path = out / "step_timeline-rank0.json"
    if not path.is_file():
        return None
    return next((e["summary"] for e in json.loads(path.read_text()) if e["epoch"] == epoch), None)


def _mode_suffix(args: argparse.Namespace) -> str:
    """The compiled rows' suffix of names (``-default``, ``-cudagraphs``); none for eager rows."""
    return f"-{args.compile}" if args.compile in ("default", "cudagraphs", "background") else ""


def _common_fit_args(arch: str, devices: int, args: argparse.Namespace, out: Path, recipe: bool = True) -> list[str]:
    """``train.py`` arguments of every ``fit`` row; ``recipe``: the row reads ``configs/resnet50.yaml``, whose
    ``--model.compile`` stands in the recipe's mode."""
    # A background compile's row runs until its first epoch wholly after the switch (``_run_fit``).
    epochs = BACKGROUND_MAX_EPOCHS if _background(args, devices) else args.epochs
    cmd = [
        "--model.arch", arch, "--trainer.devices", str(devices), "--trainer.max_epochs", str(epochs),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out),
    ]  # fmt: skip
    if devices > 1:
        cmd += ["--trainer.strategy", "ddp"]
    if args.compile is not None and not (args.recipe_mode and recipe):
        cmd += ["--model.compile", COMPILE_MODES[args.compile]]
    if args.smoke or not torch.cuda.is_available():
        cmd += ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]
    if args.timeline:
        cmd += [f"--trainer.callbacks+={TIMELINE}"]
    return cmd


def fit_synthetic(arch: str, devices: int, args: argparse.Namespace) -> dict[str, Any]:
    """``fit`` on random uint8 batches made on the GPU, with the settings of ``configs/resnet50.yaml``."""
    name = f"fit-synthetic-{arch}-{devices}dev{_mode_suffix(args)}"
    out = args.out / "fit" / name
    cmd = [
        sys.executable, str(REPO / "benchmarks/fit_synthetic.py"), "fit",
        "--trainer.accelerator", "gpu", "--trainer.precision", "16-mixed", "--trainer.benchmark", "false",
        "--trainer.log_every_n_steps", "10", "--data.batch_size", str(args.batch_size),
        "--data.crop_size", str(args.crop_size), "--data.num_classes", str(args.num_classes),
        "--data.train_steps", str(args.model_steps), "--data.val_steps", "0", "--data.channels_last", "true",
        "--checkpoint.save_top_k", "0", "--checkpoint.save_last", "false",
        *_common_fit_args(arch, devices, args, out, recipe=False), *args.extra,
    ]  # fmt: skip
    return _run_fit(name, cmd, args, devices, out)


def fit(arch: str, decoder: str, devices: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """``train.py fit`` in a subprocess; the last epoch's line of the ``Throughput`` callback."""
    kind, _, share = decoder.partition("@")
    name = f"fit-{decoder}-{arch}-{devices}dev{_mode_suffix(args)}"
    out = args.out / "fit" / name
    cmd = [
        sys.executable, str(REPO / "train.py"), "fit", "--config", str(REPO / "configs/resnet50.yaml"),
        "--data.decoder", kind, "--data.root", str(root),
        "--data.workers", str(args.workers), "--data.batch_size", str(args.batch_size),
        "--data.crop_size", str(args.crop_size), "--data.val_resize", str(max(args.crop_size * 8 // 7, args.crop_size)),
        "--trainer.limit_val_batches", "2", *_common_fit_args(arch, devices, args, out),
    ]  # fmt: skip
    if share:
        cmd += ["--data.gpu_share", share]
    return _run_fit(name, cmd + args.extra, args, devices, out)


def environment(device: torch.device) -> dict[str, Any]:
    import pytorch_lightning
    import torchvision

    cuda = torch.cuda.is_available()
    return {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "torchvision": torchvision.__version__,
        "pytorch_lightning": pytorch_lightning.__version__,
    }


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["images_per_sec"] is not None]
    labels = [f"{r['arch']} {r['setting']} {r.get('compile', 'eager')} ({r['devices']} dev)" for r in rows]
    values = [r["images_per_sec"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    colours = {"model-alone": "C0", "fit-synthetic": "C3", "loop": "C1"}
    bars = ax.barh(range(len(rows)), values, color=[colours.get(r["setting"], "C2") for r in rows])
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("training images/s")
    ax.set_title(title, fontsize=9)
    for bar, r in zip(bars, rows):
        ratio = "" if r["ratio"] is None else f" ({r['ratio']:.2f}x)"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['images_per_sec']:,.0f}{ratio}",
                va="center", fontsize=8)  # fmt: skip
    ax.set_xlim(0, max(values) * 1.3 if values else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
    from lit_imagenet.compat import user_inductor_cache_dir
    from lit_imagenet.data.synthetic import make_shapes

    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    if user_inductor_cache_dir() is None:  # one cache folder for this process and every fit row's
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((args.out / "compile_cache").resolve())
    root = make_shapes(args.data, train_per_class=args.train_per_class, val_per_class=args.val_per_class,
                       width=args.width, height=args.height, num_classes=args.num_classes, quality=args.quality,
                       processes=1 if args.smoke else (os.cpu_count() or 1))  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    own_cpus = _cpus(args, 1)
    if own_cpus:
        os.sched_setaffinity(0, own_cpus)  # model-alone and loop use one GPU; the fit rows set their own
    torch.backends.cudnn.benchmark = True  # the ceiling: cuDNN's timed choice (the recipe leaves it off)
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []

    def add(setting: str, arch: str, devices: int, result: dict[str, Any]) -> None:
        mode = args.compile or "eager"
        alone = next((x for x in rows if (x["arch"], x["setting"], x["compile"]) == (arch, "model-alone", mode)), None)
        rate = result["images_per_sec"]
        ratio = 1.0 if setting == "model-alone" else (rate / alone["images_per_sec"] if alone and rate else None)
        rows.append({"setting": setting, "arch": arch, "devices": devices, "compile": mode, **result, "ratio": ratio})
        memory = result.get("peak_memory_gib")
        shown = "no finished epoch" if rate is None else f"{rate:,.1f} images/s"
        if ratio is not None:
            shown += f", {ratio:.3f}x model alone"
        if result.get("timed_out"):
            shown += f" (stopped after {args.row_timeout:g} s)"
        print(f"{setting} {arch} ({devices} dev{'' if mode == 'eager' else ', ' + mode}): {shown}"
              + (f", peak memory {memory:.2f} GiB" if memory is not None else ""), flush=True)  # fmt: skip
        if result.get("timeline"):
            t = result["timeline"]
            print(f"  step timeline: {t['steps']} steps in {t['steps_s']:.2f} s on the GPU, kernels "
                  f"{t['kernels_ms']['sum'] / 1000:.2f} s (median {t['kernels_ms']['median']:.2f} ms a step), gaps "
                  f"{t['gap_ms']['sum'] / 1000:.2f} s (the host late {t['host_wait_ms']['sum'] / 1000:.2f} s), "
                  f"host lead median {t['lead_ms']['median']:.1f} ms", flush=True)  # fmt: skip
        (args.out / "rows.partial.json").write_text(json.dumps(rows, indent=2, default=str))  # kept if cut short

    for arch, mode in [(arch, mode) for arch in args.archs for mode in args.modes]:
        args.recipe_mode = mode is None
        args.compile = recipe_mode(device) if mode is None else mode
        if "model-alone" not in args.skip:
            add("model-alone", arch, 1, model_alone(arch, args, device))
            _reset_memory(device)
        if "loop" not in args.skip:
            add("loop", arch, 1, hand_loop(arch, args, device, root))
            _reset_memory(device)
        for devices in args.devices:
            if "fit-synthetic" not in args.skip:
                add("fit-synthetic", arch, devices, fit_synthetic(arch, devices, args))
            for decoder in args.decoders:
                add(f"fit-{decoder}", arch, devices, fit(arch, decoder, devices, args, root))
    env = environment(device)
    images = args.num_classes * args.train_per_class
    setup = (f"{images:,} JPEGs {args.width}x{args.height} q{args.quality}, crop {args.crop_size}, "
             f"batch {args.batch_size}/device, {args.workers} workers, {args.epochs} epochs")  # fmt: skip
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"environment": env, "settings": settings, "data": str(root), "rows": rows}
    (args.out / "throughput.json").write_text(json.dumps(report, indent=2, default=str))
    where = env["gpu"] if device.type == "cuda" else "CPU"
    chart(rows, args.out / "throughput.png", f"{where}; {setup}")

    print(f"\n{where} ({env['cpus_usable']} CPUs), torch {env['torch']}, torchvision "
          f"{env['torchvision']}, pytorch-lightning {env['pytorch_lightning']}; {setup}\n")  # fmt: skip
    print("| setting | arch | network | devices | images/s | ratio to model alone | peak memory GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        memory = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        rate = "-" if r["images_per_sec"] is None else f"{r['images_per_sec']:,.0f}"
        if r.get("timed_out"):
            rate += " (stopped)"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        print(f"| {r['setting']} | {r['arch']} | {r['compile']} | {r['devices']} | {rate} | {ratio} | {memory} |")
    print(f"\nWrote {args.out / 'throughput.json'} and {args.out / 'throughput.png'}")


if __name__ == "__main__":
    main()
