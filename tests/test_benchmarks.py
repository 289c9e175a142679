"""The throughput benchmark's smoke mode runs end to end on CPU and writes its table and chart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/throughput.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    report = json.loads((out / "throughput.json").read_text())
    rows = report["rows"]
    assert [(r["setting"], r["arch"]) for r in rows] == [
        ("model-alone", "resnet18"),
        ("loop", "resnet18"),
        ("fit-synthetic", "resnet18"),
        ("fit-pil", "resnet18"),
        ("fit-torchvision", "resnet18"),
        ("fit-nvjpeg", "resnet18"),
    ]
    for row in rows:
        assert row["images_per_sec"] > 0, row
        assert row["devices"] == 1
        assert row["ratio"] > 0
        assert row["peak_memory_gib"] is None  # CPU: no GPU memory to report
    assert rows[0]["ratio"] == 1.0
    env = report["environment"]
    for key in ("cpu_count", "torch", "torchvision", "pytorch_lightning"):
        assert env[key], key
    assert "| fit-nvjpeg | resnet18 | 1 |" in proc.stdout

    png = (out / "throughput.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000


def test_a_row_past_its_timeout_is_stopped_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "throughput"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/throughput.py"), "--smoke", "--out", str(out), "--skip", "loop",
         "--decoders", "pil", "--row-timeout", "0.5"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "throughput.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["model-alone", "fit-synthetic", "fit-pil"]
    for row in rows[1:]:
        assert row["timed_out"] is True and row["images_per_sec"] is None and row["ratio"] is None
    assert "| fit-pil | resnet18 | 1 | - (stopped) | - | - |" in proc.stdout
    assert (out / "throughput.png").read_bytes().startswith(PNG_SIGNATURE)


def test_loader_speed_runs_on_cpu(shapes_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "loaders.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/loader_speed.py"), "--data", str(shapes_root), "--workers", "1",
         "--batch-size", "4", "--batches", "2", "--decoders", "pil", "torchvision", "nvjpeg@0.5", "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["decoder"] for r in report["loaders"]] == ["pil", "torchvision", "nvjpeg@0.5"]
    assert all(r["images_per_sec"] > 0 and r["batches"] == 2 for r in report["loaders"])
