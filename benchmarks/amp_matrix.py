"""Trains ResNet-50 under each mixed-precision setting, with a save and a resume, and tabulates the result.

Each setting runs ``train.py fit`` for one epoch, then resumes from that run's ``last.ckpt`` for two
more epochs (so every setting takes 3 epochs of optimizer steps and one resume). The table gives the
last epoch's images/s (over all processes, epoch start included), its mean training loss, peak GPU
memory, and the loss scale stored in the final checkpoint; the JSON also keeps every epoch's validation
loss and top-1. Small JPEGs keep the loaders ahead of the
GPU, so the figures compare the precisions rather than the decoders.

    python benchmarks/amp_matrix.py --out runs/amp --devices 1
    python benchmarks/amp_matrix.py --out runs/amp2 --devices 2 --settings O1 O2 O3 16-mixed bf16-mixed
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "O1": ["--amp.opt_level", "O1", "--amp.backend", "apex"],
    "O2": ["--amp.opt_level", "O2", "--amp.backend", "apex"],
    "O3": ["--amp.opt_level", "O3", "--amp.keep_batchnorm_fp32", "true", "--amp.backend", "apex"],
    "16-mixed": ["--trainer.precision", "16-mixed"],
    "bf16-mixed": ["--trainer.precision", "bf16-mixed"],
    "32-true": ["--trainer.precision", "32-true"],
    "16-true": ["--trainer.precision", "16-true"],
    "bf16-true": ["--trainer.precision", "bf16-true"],
    "O1-native": ["--amp.opt_level", "O1", "--amp.backend", "native", "--amp.loss_scale", "128"],
    "O2-syncbn": ["--amp.opt_level", "O2", "--amp.backend", "apex", "--trainer.sync_batchnorm", "true"],
    "16-mixed-syncbn": ["--trainer.precision", "16-mixed", "--trainer.sync_batchnorm", "true"],
}
EPOCH_LINE = re.compile(r"Epoch (\d+): ([\d,]+) images/s .*?(?:peak GPU memory ([\d.]+) GiB)?$")


def run(args: list[str], log: Path) -> str:
    cmd = [sys.executable, str(REPO / "train.py"), "fit", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    text = proc.stdout + proc.stderr
    log.write_text(" ".join(cmd) + "\n" + text)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}), see {log}:\n{text[-3000:]}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", default="/tmp/lit_imagenet_jpeg160")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--settings", nargs="+", default=["O1", "O2", "O3", "16-mixed", "bf16-mixed"])
    parser.add_argument("--train-per-class", type=int, default=4267, help="6 classes: 25,602 images")
    parser.add_argument("--val-per-class", type=int, default=100)
    parser.add_argument("extra", nargs="*", help="more train.py arguments, after --")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
    from lit_imagenet.synthetic import make_shapes

    make_shapes(args.data, train_per_class=args.train_per_class, val_per_class=args.val_per_class, width=160,
                height=120, processes=os.cpu_count() or 1)  # fmt: skip
    common = [
        "--config", str(REPO / "configs/resnet50.yaml"), "--data.root", args.data,
        "--data.workers", str(args.workers), "--trainer.devices", str(args.devices),
        "--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "2", *args.extra,
    ]  # fmt: skip
    if args.devices > 1:
        common += ["--trainer.strategy", "ddp"]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.settings:
        out = args.out / name
        base = [*common, *SETTINGS[name], "--trainer.default_root_dir", str(out),
                "--trainer.logger.init_args.save_dir", str(out)]  # fmt: skip
        first = run([*base, "--trainer.max_epochs", "1"], args.out / f"{name}-first.log")
        last = sorted(out.rglob("last.ckpt"), key=lambda p: p.stat().st_mtime)[-1]
        second = run([*base, "--trainer.max_epochs", "3", "--ckpt_path", str(last)], args.out / f"{name}-resume.log")
        finals = [(torch.load(p, map_location="cpu", weights_only=True), p) for p in out.rglob("last*.ckpt")]
        ckpt, final = max(finals, key=lambda c: c[0]["global_step"])
        epochs = [m.groups() for m in map(EPOCH_LINE.search, second.splitlines()) if m]
        epoch, rate, memory = epochs[-1]
        metrics = list(csv.DictReader(open(next(final.parent.parent.glob("metrics.csv")))))
        losses = [float(r["train/loss_epoch"]) for r in metrics if r.get("train/loss_epoch")]
        vals = [(float(r["val/loss"]), float(r["val/top1"])) for r in metrics if r.get("val/loss") and r["val/top1"]]
        choice = next((line for line in (first + second).splitlines() if "AMP: " in line), "")
        rows.append({
            "setting": name,
            "devices": args.devices,
            "steps": ckpt["global_step"],
            "last_epoch": int(epoch),
            "images_per_sec": float(rate.replace(",", "")),
            "train_loss_last_epoch": losses[-1] if losses else float("nan"),
            "peak_memory_gib": float(memory) if memory else None,
            "val_loss_per_epoch": [v[0] for v in vals],
            "val_top1_per_epoch": [v[1] for v in vals],
            "checkpoint_scaler": ckpt.get("ApexAMP") or ckpt.get("MixedPrecision"),
            "resumed_from_step": torch.load(last, map_location="cpu", weights_only=True)["global_step"],
            "chosen": choice.split("AMP: ", 1)[-1] if choice else "",
        })  # fmt: skip
        print(json.dumps(rows[-1], default=str), flush=True)
    (args.out / "amp_matrix.json").write_text(json.dumps(rows, indent=2, default=str))
    print(
        f"\n| setting | GPUs | steps | resumed at | images/s (epoch {rows[0]['last_epoch']}) | train loss | peak GiB |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['setting']} | {r['devices']} | {r['steps']} | {r['resumed_from_step']} | "
              f"{r['images_per_sec']:,.0f} | {r['train_loss_last_epoch']:.4f} | {r['peak_memory_gib']} |")  # fmt: skip


if __name__ == "__main__":
    main()
