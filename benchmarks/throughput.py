"""Training throughput of the model alone, of a hand-written loop like the reference's, and of ``fit``.

For each architecture, on one generated folder of JPEGs (``lit_imagenet.synthetic.make_shapes``,
~500x375 at quality 90 by default, as ``benchmarks/fit_resnet50.sh``), it measures side by side:

* ``model-alone``: SGD steps on random normalised float batches already on the device
  (channels_last, float16 autocast with a gradient scaler on CUDA, float32 on CPU); warm-up steps,
  then timed steps between CUDA events. The ceiling for the other rows.
* ``loop``: the reference's training loop written out by hand: ``ImageFolderDataset`` (PIL decoding,
  RandomResizedCrop, flip) in a ``DataLoader`` with ``collate_uint8`` (channels_last), persistent
  workers and pinned memory, the project's ``CUDAPrefetcher`` (side-stream copy and normalisation),
  ``torch.autocast`` with ``torch.amp.GradScaler``, and SGD with the recipe's hyperparameters (at a
  constant learning rate). Timed over whole epochs, epoch start included; on CPU the batches are
  normalised with ``Uint8Normalize`` instead of the prefetcher.
* ``fit-<decoder>``: ``train.py fit --config configs/resnet50.yaml`` in a subprocess, one row per
  ``--data.decoder``; the last epoch's images/s (over all processes, epoch start included, with 2
  validation batches and the checkpoint save) and peak GPU memory from the ``Throughput`` callback.

``model-alone`` and ``loop`` run on one device; ``--devices N`` makes the ``fit`` rows use N GPUs
under DDP. The ratio column divides each row's images/s by the ``model-alone`` images/s of the same
architecture. The table is printed and written to ``OUT/throughput.json`` (with the hardware and
versions) and ``OUT/throughput.png``.

    python benchmarks/throughput.py --out runs/throughput
    python benchmarks/throughput.py --out runs/throughput2 --devices 2 --archs resnet50
    python benchmarks/throughput.py --out /tmp/tp --smoke   # CPU, tiny sizes, well under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
EPOCH_LINE = re.compile(r"Epoch (\d+): ([\d,.]+) images/s .*?(?:peak GPU memory ([\d.]+) GiB)?$")
LR_PER_256, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-4  # configs/resnet50.yaml


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny data and model steps: checks the script")
    parser.add_argument("--data", default=None, help="shapes folder (default /tmp/lit_imagenet_jpeg500)")
    parser.add_argument("--archs", nargs="+", default=None, help="default resnet50 resnet18 (smoke: resnet18)")
    parser.add_argument("--decoders", nargs="+", default=["pil", "torchvision"], choices=["pil", "torchvision"])
    parser.add_argument("--devices", type=int, default=1, help="GPUs of the fit rows (DDP when more than 1)")
    parser.add_argument("--workers", type=int, default=None, help="loader workers per process (default 15)")
    parser.add_argument("--batch-size", type=int, default=None, help="per device (default 256)")
    parser.add_argument("--crop-size", type=int, default=None, help="default 224")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of the loop and fit rows (default 2)")
    parser.add_argument("--model-steps", type=int, default=None, help="timed model-alone steps (default 50)")
    parser.add_argument("--warmup-steps", type=int, default=None, help="model-alone warm-up steps (default 10)")
    parser.add_argument("--width", type=int, default=None, help="image width (default 500)")
    parser.add_argument("--height", type=int, default=None, help="image height (default 375)")
    parser.add_argument("--quality", type=int, default=90)
    parser.add_argument("--train-per-class", type=int, default=None, help="default 4267 (6 classes: 25,602)")
    parser.add_argument("--val-per-class", type=int, default=None, help="default 500")
    parser.add_argument("--num-classes", type=int, default=None, help="default 6")
    parser.add_argument("extra", nargs="*", help="more train.py arguments for the fit rows, after --")
    args = parser.parse_args(argv)
    full = {"archs": ["resnet50", "resnet18"], "workers": 15, "batch_size": 256, "crop_size": 224, "epochs": 2,
            "model_steps": 50, "warmup_steps": 10, "width": 500, "height": 375, "train_per_class": 4267,
            "val_per_class": 500, "num_classes": 6, "data": "/tmp/lit_imagenet_jpeg500"}  # fmt: skip
    smoke = {"archs": ["resnet18"], "workers": 0, "batch_size": 4, "crop_size": 32, "epochs": 1,
             "model_steps": 2, "warmup_steps": 1, "width": 40, "height": 40, "train_per_class": 8,
             "val_per_class": 2, "num_classes": 3, "data": str(args.out / "data")}  # fmt: skip
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.devices < 1:
        parser.error(f"--devices must be at least 1. Got {args.devices}")
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _training_parts(arch: str, num_classes: int, batch_size: int, device: torch.device) -> tuple[Any, ...]:
    from lit_imagenet.models import build_model
    from lit_imagenet.schedule import scaled_lr

    model = build_model(arch, num_classes).to(device, memory_format=torch.channels_last).train()
    optimizer = torch.optim.SGD(
        model.parameters(), lr=scaled_lr(LR_PER_256, batch_size), momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
    )
    cuda = device.type == "cuda"
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


def model_alone(arch: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """SGD steps on random normalised batches already on the device."""
    model, optimizer, scaler, criterion = _training_parts(arch, args.num_classes, args.batch_size, device)
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch_size, 3, args.crop_size, args.crop_size)
    images = torch.randn(shape, device=device, generator=generator).contiguous(memory_format=torch.channels_last)
    targets = torch.randint(0, args.num_classes, (args.batch_size,), device=device, generator=generator)
    for _ in range(args.warmup_steps):
        _step(model, optimizer, scaler, criterion, images, targets, device)
    _sync(device)
    _reset_memory(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.model_steps):
            _step(model, optimizer, scaler, criterion, images, targets, device)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000.0
    else:
        began = time.perf_counter()
        for _ in range(args.model_steps):
            _step(model, optimizer, scaler, criterion, images, targets, device)
        seconds = time.perf_counter() - began
    images_per_sec = args.model_steps * args.batch_size / max(seconds, 1e-9)
    return {"images_per_sec": images_per_sec, "peak_memory_gib": _peak_memory(device), "seconds": seconds}


def hand_loop(arch: str, args: argparse.Namespace, device: torch.device, root: Path) -> dict[str, Any]:
    """The reference's loop: uint8 collation, pinned memory, side-stream prefetch, native AMP, SGD."""
    from torch.utils.data import DataLoader
    from torchvision import transforms

    from lit_imagenet.data import ImageFolderDataset, collate_uint8, load_rgb, scan_split
    from lit_imagenet.prefetch import CUDAPrefetcher, Uint8Normalize

    cuda = device.type == "cuda"
    _, samples = scan_split(root / "train")
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
    model, optimizer, scaler, criterion = _training_parts(arch, args.num_classes, args.batch_size, device)
    normalize = Uint8Normalize().to(device)
    epochs = []
    for epoch in range(args.epochs):
        _sync(device)
        _reset_memory(device)
        began = time.perf_counter()
        count = 0
        if cuda:
            batches = CUDAPrefetcher(iter(loader), device, normalize)
        else:
            batches = ((normalize(images), targets) for images, targets in loader)
        for images, targets in batches:
            _step(model, optimizer, scaler, criterion, images, targets, device)
            count += int(images.shape[0])
        _sync(device)
        seconds = time.perf_counter() - began
        epochs.append({"epoch": epoch, "images": count, "seconds": seconds, "images_per_sec": count / seconds})
        print(f"  loop {arch} epoch {epoch}: {count / seconds:,.0f} images/s ({count:,} images in {seconds:.1f} s)")
    del loader  # stops the persistent workers
    last = epochs[-1]
    return {"images_per_sec": last["images_per_sec"], "peak_memory_gib": _peak_memory(device), "epochs": epochs}


def fit(arch: str, decoder: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """``train.py fit`` in a subprocess; the last epoch's line of the ``Throughput`` callback."""
    name = f"fit-{decoder}-{arch}"
    out = args.out / "fit" / name
    cmd = [
        sys.executable, str(REPO / "train.py"), "fit", "--config", str(REPO / "configs/resnet50.yaml"),
        "--model.arch", arch, "--data.decoder", decoder, "--data.root", str(root),
        "--data.workers", str(args.workers), "--data.batch_size", str(args.batch_size),
        "--data.crop_size", str(args.crop_size), "--data.val_resize", str(max(args.crop_size * 8 // 7, args.crop_size)),
        "--trainer.devices", str(args.devices), "--trainer.max_epochs", str(args.epochs),
        "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(out),
        "--trainer.logger.init_args.save_dir", str(out),
    ]  # fmt: skip
    if args.devices > 1:
        cmd += ["--trainer.strategy", "ddp"]
    if args.smoke or not torch.cuda.is_available():
        cmd += ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]
    cmd += args.extra
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    text = proc.stdout + proc.stderr
    log = args.out / "logs" / f"{name}.log"
    log.write_text(" ".join(cmd) + "\n" + text)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}), see {log}:\n{text[-3000:]}")
    epochs = [m.groups() for m in map(EPOCH_LINE.search, text.splitlines()) if m]
    if not epochs:
        raise SystemExit(f"{name} printed no Throughput line, see {log}")
    _, rate, memory = epochs[-1]
    return {
        "images_per_sec": float(rate.replace(",", "")),
        "peak_memory_gib": float(memory) if memory else None,
        "epochs": [{"epoch": int(e), "images_per_sec": float(r.replace(",", ""))} for e, r, _ in epochs],
        "log": str(log),
    }


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

    labels = [f"{r['arch']} {r['setting']} ({r['devices']} dev)" for r in rows]
    values = [r["images_per_sec"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    colours = {"model-alone": "C0", "loop": "C1"}
    bars = ax.barh(range(len(rows)), values, color=[colours.get(r["setting"], "C2") for r in rows])
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("training images/s")
    ax.set_title(title, fontsize=9)
    for bar, r in zip(bars, rows):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r['images_per_sec']:,.0f} ({r['ratio']:.2f}x)",
                va="center", fontsize=8)  # fmt: skip
    ax.set_xlim(0, max(values) * 1.3 if values else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
    from lit_imagenet.synthetic import make_shapes

    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    root = make_shapes(args.data, train_per_class=args.train_per_class, val_per_class=args.val_per_class,
                       width=args.width, height=args.height, num_classes=args.num_classes, quality=args.quality,
                       processes=1 if args.smoke else (os.cpu_count() or 1))  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    torch.backends.cudnn.benchmark = True  # as configs/resnet50.yaml
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []

    def add(setting: str, arch: str, devices: int, result: dict[str, Any]) -> None:
        rows.append({"setting": setting, "arch": arch, "devices": devices, **result})
        memory = result.get("peak_memory_gib")
        print(f"{setting} {arch}: {result['images_per_sec']:,.1f} images/s"
              + (f", peak memory {memory:.2f} GiB" if memory is not None else ""), flush=True)  # fmt: skip

    for arch in args.archs:
        add("model-alone", arch, 1, model_alone(arch, args, device))
        _reset_memory(device)
        add("loop", arch, 1, hand_loop(arch, args, device, root))
        _reset_memory(device)
        for decoder in args.decoders:
            add(f"fit-{decoder}", arch, args.devices, fit(arch, decoder, args, root))
    for r in rows:
        alone = next(x for x in rows if x["arch"] == r["arch"] and x["setting"] == "model-alone")
        r["ratio"] = r["images_per_sec"] / alone["images_per_sec"]

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
    print("| setting | arch | devices | images/s | ratio to model alone | peak memory GiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        memory = f"{r['peak_memory_gib']:.2f}" if r["peak_memory_gib"] is not None else "-"
        print(f"| {r['setting']} | {r['arch']} | {r['devices']} | {r['images_per_sec']:,.0f} | {r['ratio']:.2f} | "
              f"{memory} |")  # fmt: skip
    print(f"\nWrote {args.out / 'throughput.json'} and {args.out / 'throughput.png'}")


if __name__ == "__main__":
    main()
