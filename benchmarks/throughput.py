"""Training throughput of the model alone and of ``fit`` with each decoder, on one folder of generated JPEGs.

Rows, per architecture:

* ``model-alone``: SGD steps on a random uint8 batch already on the device, normalised there at each step
  (channels_last, float16 autocast with a gradient scaler on CUDA, float32 on a CPU). The ceiling of the others.
* ``fit-synthetic``: the project's ``fit`` (``benchmarks/fit_synthetic.py``) on random uint8 batches made on the
  GPU, the same steps per epoch, no validation or checkpoint: what Lightning costs.
* ``fit-<decoder>``: ``train.py fit --config configs/resnet50.yaml --data.decoder <decoder>`` in a process of its
  own, with 2 validation batches and the checkpoint in each epoch, as a real run has.

Each row runs ``--epochs`` epochs (2 by default; the first pays for compiling and starting the workers) and reports
the last, timed with the host clock, the GPU synchronised at its start and end. A ``fit`` row also reports that
epoch's pace from its 11th batch to its last (the console's line, timed by CUDA events): in a short epoch the
first batches weigh, in ImageNet's 5,005 steps they do not. Every row runs the network as the
recipe does (``--model.compile auto``: compiled on CUDA, eager on a CPU) unless ``--compile`` names a mode. All rows
share one compiler cache folder (``OUT/compile_cache``), so only the first compiles from nothing. The ratio divides a
row's images/s by ``model-alone``'s. The table is printed and written to ``OUT/throughput.json``.

    python benchmarks/throughput.py --out runs/throughput
    python benchmarks/throughput.py --out runs/throughput --decoders dali nvjpeg --devices 1 2
    python benchmarks/throughput.py --out /tmp/tp --smoke   # CPU, tiny sizes, well under a minute
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
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
EPOCH_LINE = re.compile(
    r"^Epoch (\d+): ([\d,.]+) images/s .*?(?:; ([\d,.]+) images/s from batch \d+ to the last)?"
    r"(?:, peak GPU memory ([\d.]+) GiB)?$"
)
COMPILED_LINE = re.compile(r"^Compiled the network.* in ([\d.]+) s")
LR_PER_256, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-4  # configs/resnet50.yaml
#: ``--compile``'s modes and the ``--model.compile`` value of each.
COMPILE_MODES = {"eager": "false", "default": "true", "cudagraphs": "cudagraphs"}
DECODERS = ("pil", "torchvision", "nvjpeg", "dali")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny data and model: checks the script")
    parser.add_argument("--data", default=None, help="the JPEG folder (default /tmp/lit_imagenet_jpeg500)")
    parser.add_argument("--archs", nargs="+", default=None, help="default resnet50 (smoke: resnet18)")
    parser.add_argument("--decoders", nargs="*", choices=DECODERS, default=["pil", "torchvision", "nvjpeg"],
                        help="one fit row each; given with no value: none")  # fmt: skip
    parser.add_argument("--devices", type=int, nargs="+", default=[1], help="GPU counts of the fit rows (DDP if > 1)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["model-alone", "fit-synthetic"])
    parser.add_argument("--compile", choices=list(COMPILE_MODES), default=None,
                        help="the network's mode in every row (default: the recipe's)")  # fmt: skip
    parser.add_argument("--row-timeout", type=float, default=None,
                        help="stop a fit row after this many seconds; it reports the epochs it finished")  # fmt: skip
    parser.add_argument(
        "--workers", type=int, default=None, help="loader workers per process (DALI keeps its default threads)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="per device (default 256)")
    parser.add_argument("--crop-size", type=int, default=None, help="default 224")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every row; the last is reported")
    parser.add_argument("--train-per-class", type=int, default=None, help="default 3200 (6 classes: 75 steps)")
    parser.add_argument("extra", nargs="*", help="more train.py arguments for the fit rows, after --")
    args = parser.parse_args(argv)
    full = {"archs": ["resnet50"], "workers": min(15, max(1, (os.cpu_count() or 2) - 1)), "batch_size": 256,
            "crop_size": 224, "epochs": 2, "train_per_class": 3200, "data": "/tmp/lit_imagenet_jpeg500"}  # fmt: skip
    smoke = {"archs": ["resnet18"], "workers": 0, "batch_size": 4, "crop_size": 32, "epochs": 1,
             "train_per_class": 8, "data": str(args.out / "data")}  # fmt: skip
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.size, args.val_per_class, args.num_classes = ((40, 40), 2, 3) if args.smoke else ((500, 375), 100, 6)
    args.steps = -(-args.num_classes * args.train_per_class // args.batch_size)
    if min(args.devices) < 1 or args.epochs < 1:
        parser.error(f"--devices and --epochs must be at least 1. Got {args.devices} and {args.epochs}")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_alone(arch: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """SGD steps on a random uint8 batch already on ``device``; images/s and peak memory of the last epoch."""
    from lit_imagenet.data.presets import Uint8Normalize
    from lit_imagenet.training.models import build_model
    from lit_imagenet.training.schedule import scaled_lr

    cuda = device.type == "cuda"
    model = build_model(arch, args.num_classes).to(device, memory_format=torch.channels_last).train()
    mode = args.compile or ("default" if cuda else "eager")
    if mode != "eager":
        model.compile(dynamic=False, mode="reduce-overhead" if mode == "cudagraphs" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=scaled_lr(LR_PER_256, args.batch_size), momentum=MOMENTUM,
                                weight_decay=WEIGHT_DECAY, **({"fused": True} if cuda else {}))  # fmt: skip
    scaler = torch.amp.GradScaler(device.type, enabled=cuda)
    criterion, normalize = torch.nn.CrossEntropyLoss(), Uint8Normalize().to(device)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch_size, 3, args.crop_size, args.crop_size)
    images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
    images = images.contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=generator)
    rate = None
    for _ in range(args.epochs):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            if mode == "cudagraphs":
                torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast(device.type, dtype=torch.float16, enabled=cuda):
                loss = criterion(model(normalize(images)), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        _sync(device)
        rate = args.steps * args.batch_size / (time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    return {"images_per_sec": rate, "peak_memory_gib": memory}


def run_fit(name: str, cmd: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Runs a ``fit`` row's command; its last epoch's figures from the console's ``Epoch N:`` lines, or ``error``
    saying why there are none (the run failed, stopped at ``--row-timeout`` or finished too few epochs)."""
    # A session of its own, so that a row stopped by --row-timeout takes its DDP ranks and workers with it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)  # fmt: skip
    timed_out = threading.Event()

    def stop() -> None:
        if proc.poll() is None:
            timed_out.set()
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(args.row_timeout, stop) if args.row_timeout else None
    if timer is not None:
        timer.start()
    try:
        text, _ = proc.communicate()
    finally:
        if timer is not None:
            timer.cancel()
    log = args.out / "logs" / f"{name}.log"
    log.write_text(" ".join(cmd) + "\n" + text)
    lines = text.splitlines()
    epochs = [m.groups() for m in map(EPOCH_LINE.match, lines) if m]
    error = None
    if timed_out.is_set():
        error = f"stopped after {args.row_timeout:g} s"
    elif proc.returncode != 0:
        error = f"exit status {proc.returncode}, see {log}"
    elif len(epochs) < args.epochs:
        error = f"{len(epochs)} of {args.epochs} 'Epoch N: ... images/s' lines, see {log}"
    compiled = next((float(m.group(1)) for m in map(COMPILED_LINE.match, lines) if m), None)
    rate, steady, memory = epochs[-1][1:] if error is None else (None, None, None)
    return {
        "images_per_sec": float(rate.replace(",", "")) if rate else None,
        "steady_images_per_sec": float(steady.replace(",", "")) if steady else None,
        "peak_memory_gib": float(memory) if memory else None,
        "compile_seconds": compiled,
        "timed_out": timed_out.is_set(),
        "error": error,
        "log": str(log),
    }


def fit_command(arch: str, decoder: str | None, devices: int, args: argparse.Namespace, root: Path) -> list[str]:
    """The ``fit`` row's command: ``train.py`` with the recipe and ``decoder``, or ``fit_synthetic.py`` for None."""
    out = args.out / "fit" / f"{decoder or 'synthetic'}-{arch}-{devices}dev"
    if decoder is None:
        cmd = [
            sys.executable, str(REPO / "benchmarks/fit_synthetic.py"), "fit", "--trainer.precision", "16-mixed",
            "--data.batch_size", str(args.batch_size), "--data.crop_size", str(args.crop_size),
            "--data.num_classes", str(args.num_classes), "--data.train_steps", str(args.steps),
            "--data.val_steps", "0", "--data.channels_last", "true", "--checkpoint.save_top_k", "0",
            "--checkpoint.save_last", "false", "--model.compile", "auto",
        ]  # fmt: skip
    else:
        cmd = [
            sys.executable, str(REPO / "train.py"), "fit", "--config", str(REPO / "configs/resnet50.yaml"),
            "--data.decoder", decoder, "--data.root", str(root), "--data.batch_size", str(args.batch_size),
            "--data.crop_size", str(args.crop_size), "--data.val_resize", str(args.crop_size * 8 // 7),
            "--data.workers", str(args.workers),
            "--trainer.limit_val_batches", "2",
        ]  # fmt: skip
    cmd += [
        "--model.arch", arch, "--trainer.devices", str(devices), "--trainer.max_epochs", str(args.epochs),
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out),
    ]  # fmt: skip
    if devices > 1:
        cmd += ["--trainer.strategy", "ddp"]
    if args.compile is not None:
        cmd += ["--model.compile", COMPILE_MODES[args.compile]]
    if args.smoke or not torch.cuda.is_available():
        cmd += ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]
    return cmd + args.extra


def environment() -> dict[str, Any]:
    import pytorch_lightning
    import torchvision

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchvision": torchvision.__version__,
        "pytorch_lightning": pytorch_lightning.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
    from lit_imagenet.compat import user_inductor_cache_dir
    from lit_imagenet.data.synthetic import make_shapes

    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    if user_inductor_cache_dir() is None:  # one cache folder for this process and every fit row's
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((args.out / "compile_cache").resolve())
    width, height = args.size
    root = make_shapes(args.data, train_per_class=args.train_per_class, val_per_class=args.val_per_class,
                       width=width, height=height, num_classes=args.num_classes, quality=90,
                       processes=1 if args.smoke else (os.cpu_count() or 1))  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.backends.cudnn.benchmark = True  # the ceiling: cuDNN's timed choice
    rows: list[dict[str, Any]] = []

    def add(setting: str, arch: str, devices: int, result: dict[str, Any]) -> None:
        alone = next((r for r in rows if (r["setting"], r["arch"]) == ("model-alone", arch)), None)
        rate = result["images_per_sec"]
        ratio = 1.0 if setting == "model-alone" else rate / alone["images_per_sec"] if alone and rate else None
        rows.append({"setting": setting, "arch": arch, "devices": devices, **result, "ratio": ratio})
        shown = f"failed: {result.get('error')}" if rate is None else f"{rate:,.1f} images/s"
        print(f"{setting} {arch} ({devices} dev): {shown}" + (f", {ratio:.3f}x model alone" if ratio else ""),
              flush=True)  # fmt: skip

    for arch in args.archs:
        if "model-alone" not in args.skip:
            add("model-alone", arch, 1, model_alone(arch, args, device))
        for devices in args.devices:
            for decoder in ([None] if "fit-synthetic" not in args.skip else []) + args.decoders:
                cmd = fit_command(arch, decoder, devices, args, root)
                result = run_fit(f"{decoder or 'synthetic'}-{arch}-{devices}dev", cmd, args)
                add(f"fit-{decoder or 'synthetic'}", arch, devices, result)
    env = environment()
    images = args.num_classes * args.train_per_class
    setup = (f"{images:,} JPEGs {width}x{height}, {args.steps} steps of {args.batch_size} per device, crop "
             f"{args.crop_size}, {args.workers} workers, the last of {args.epochs} epochs")  # fmt: skip
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report = {"environment": env, "settings": settings, "setup": setup, "rows": rows}
    (args.out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{env['gpu'] or 'CPU'} ({env['cpus']} CPUs), torch {env['torch']}, pytorch-lightning "
          f"{env['pytorch_lightning']}; {setup}\n")  # fmt: skip
    print("| setting | arch | devices | images/s | from batch 11 | of the model alone | peak GPU memory GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        rate = "-" if r["images_per_sec"] is None else f"{r['images_per_sec']:,.0f}"
        steady = "-" if r.get("steady_images_per_sec") is None else f"{r['steady_images_per_sec']:,.0f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        memory = "-" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}"
        print(f"| {r['setting']} | {r['arch']} | {r['devices']} | {rate} | {steady} | {ratio} | {memory} |")
    print(f"\nWrote {args.out / 'throughput.json'}")


if __name__ == "__main__":
    main()
