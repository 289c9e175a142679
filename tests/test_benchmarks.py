"""The throughput benchmark's smoke mode runs end to end on CPU and writes its table and chart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/throughput.py"),
            "--smoke",
            "--out",
            str(out),
            "--decoders",
            "pil",
            "nvjpeg",
        ],
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


def test_trace_reader_measures_streams_steps_and_prefetch_ranges() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from trace_overlap import analyse
    finally:
        sys.path.pop(0)

    def ev(cat: str, name: str, ts: float, dur: float, tid: int | str = 1, **args: int) -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}

    trace = {
        "traceEvents": [
            # main stream 7: busy 0-400 and 600-1000 us (two overlapping kernels count once), idle 200 us
            ev("kernel", "conv", 0, 300, "stream 7", stream=7),
            ev("kernel", "bn", 100, 300, "stream 7", stream=7),
            ev("kernel", "relu", 600, 400, "stream 7", stream=7),
            # decode stream 20: 300-700, of which 200 us beside the main stream's kernels (300-400, 600-700)
            ev("kernel", "resize", 300, 400, "stream 20", stream=20),
            ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 350, 100, "stream 21", stream=21),
            ev("user_annotation", "train step 0", 0, 400),
            ev("user_annotation", "train step 1", 400, 300),
            ev("user_annotation", "train step 2", 700, 500),
            ev("user_annotation", "prefetch: wait for decode", 400, 50),
            ev("user_annotation", "prefetch: wait for decode", 700, 30),
            ev("user_annotation", "prefetch: decode", 300, 200, tid=2),
            ev("cuda_runtime", "cudaStreamSynchronize", 450, 40, tid=2),
            ev("cpu_op", "aten::conv", 0, 100),
            ev("cpu_op", "aten::add", 50, 100),
            ev("cpu_op", "aten::resize", 300, 10, tid=2),
            {"ph": "i", "name": "marker", "ts": 5},
        ]
    }
    out = analyse(trace)
    assert out["main_stream"] == 7
    assert out["streams"]["7"] == {"kernels": 3, "busy_ms": 0.8, "busy_ms_beside_main_stream": 0.0}
    assert out["streams"]["20"] == {"kernels": 1, "busy_ms": 0.4, "busy_ms_beside_main_stream": 0.2}
    assert out["main_stream_window_ms"] == 1.0 and abs(out["main_stream_idle_ms"] - 0.2) < 1e-9
    assert out["htod_copies_on_side_streams"] == 1 and out["htod_ms_overlapping_main_stream_kernels"] == 0.05
    assert out["steps"] == 2 and out["step_ms_mean"] == 0.4 and out["step_ms_max"] == 0.5
    main, decode = out["threads"]["1"], out["threads"]["2"]
    assert main["prefetch: wait for decode (ms, count)"] == [0.08, 2] and main["operator_ms"] == 0.15
    assert decode["prefetch: decode (ms, count)"] == [0.2, 1] and decode["sync_ms"] == 0.04


def test_resize_gil_benchmark_times_both_versions() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from resize_gil import measure
    finally:
        sys.path.pop(0)
    out = measure(pictures=4, height=12, width=10, size=6, repeats=1, device=torch.device("cpu"))
    assert set(out) == {f"{v}_{w}_ms" for v in ("python", "torchscript") for w in ("alone", "beside_busy_thread")}
    assert all(value > 0 for value in out.values())


def test_gpu_check_reads_the_test_report_and_marks_parts_of_other_commits(tmp_path: Path, monkeypatch) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    report = tmp_path / "gpu-tests.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_multi_gpu" name="test_a" time="12.5"/>'
        '<testcase classname="tests.test_multi_gpu" name="test_b" time="3"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="0"><skipped message="needs 2 CUDA devices"/>'
        "</testcase></testsuite></testsuites>"
    )
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *a, **k: None)
    rows = gpu_check.run_tests(tmp_path, [])
    assert [(r["row"], r["ok"]) for r in rows] == [
        ("test_multi_gpu::test_a", True), ("test_multi_gpu::test_b", False), ("test_gpu::test_c", True)
    ]  # fmt: skip
    assert rows[2]["detail"] == "skipped: needs 2 CUDA devices" and rows[2]["skipped"]
    bench = gpu_check._bench_row({"setting": "fit-pil", "arch": "resnet50", "devices": 2, "images_per_sec": 5000.0,
                                  "ratio": 0.8, "peak_memory_gib": 11.0})  # fmt: skip
    record = {"commit": "new", "machine": {"gpus": ["H"]},
              "parts": {"tests": {"commit": "old", "passed": 1, "failed": 1, "skipped": 1, "rows": rows},
                        "bench": {"commit": "new", "passed": 1, "failed": 0, "rows": [bench]}}}  # fmt: skip
    text = gpu_check.summary(record)
    assert "tests: 1 passed, 1 failed, 1 skipped (at old, not this commit)" in text
    assert "skip  test_gpu::test_c" in text and "pass  test_multi_gpu::test_a" in text
    assert "bench: 1 passed, 0 failed\n" in text and "5,000 images/s" in text
    assert "FAIL  test_multi_gpu::test_b" in text


def test_gpu_check_keeps_the_rows_of_other_test_shares_of_the_same_code(tmp_path: Path, monkeypatch) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "_machine", lambda: {"gpus": ["H", "H"]})
    tree = {"digest": "a"}
    monkeypatch.setattr(gpu_check, "tree_digest", lambda: tree["digest"])
    results = {"x": [{"row": "test_x::t", "ok": True}], "y": [{"row": "test_y::t", "ok": False}]}
    monkeypatch.setattr(gpu_check, "run_tests", lambda out, args: results[args[0]])
    record = tmp_path / "record.json"

    def check(share: str) -> dict:
        gpu_check.main(["--part", "tests", "--out", str(tmp_path), "--record", str(record), "--pytest-args", share])
        return json.loads(record.read_text())["parts"]["tests"]

    check("x")
    both = check("y")
    assert [r["row"] for r in both["rows"]] == ["test_x::t", "test_y::t"]
    assert (both["passed"], both["failed"], both["pytest_args"]) == (1, 1, ["x", "y"])
    tree["digest"] = "b"  # other code: the earlier share is not this code's result
    assert [r["row"] for r in check("x")["rows"]] == ["test_x::t"]


def test_gpu_check_names_the_commit_whose_files_ran(tmp_path: Path) -> None:
    """A record written from a checkout without its history gets the commit whose run files hash the same."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    repo = tmp_path / "repo"
    (repo / "lit_imagenet").mkdir(parents=True)
    (repo / "docs").mkdir()

    def git(*args: str) -> str:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ["PATH"]}  # fmt: skip
        return subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    (repo / "train.py").write_text("print(1)\n")
    (repo / "lit_imagenet" / "a.py").write_text("A = 1\n")
    git("add", "-A")
    git("commit", "-q", "-m", "one")
    first = git("rev-parse", "HEAD").strip()
    ran = gpu_check.tree_digest(repo)
    assert ran == gpu_check.commit_digest(first, repo)
    (repo / "docs" / "x.md").write_text("docs only\n")  # not a run file: the same digest
    git("add", "-A")
    git("commit", "-q", "-m", "docs")
    assert gpu_check.tree_digest(repo) == ran
    (repo / "lit_imagenet" / "a.py").write_text("A = 2\n")
    git("commit", "-q", "-am", "code")
    assert gpu_check.tree_digest(repo) != ran

    record = {"commit": "f00-dirty", "parts": {
        "tests": {"commit": "f00-dirty", "tree_sha256": ran, "date": "2026-01-02T00:00:00"},
        "bench": {"commit": "old", "tree_sha256": "0" * 64, "date": "2026-01-01T00:00:00"}}}  # fmt: skip
    lines = gpu_check.name_commits(record, repo)
    second = git("rev-parse", "HEAD~1").strip()
    assert record["parts"]["tests"]["commit"] == second  # the most recent commit with the files that ran
    assert record["parts"]["bench"]["commit"] == "old" and "no commit of the last 50" in lines[1]
    assert (record["commit"], record["tree_sha256"]) == (second, ran)


@pytest.mark.dali
def test_dali_rows(shapes_root: Path, tmp_path: Path) -> None:
    """``--decoders dali`` gives a fit-dali row beside model-alone, and a loader_speed row."""
    out = tmp_path / "throughput"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/throughput.py"), "--smoke", "--out", str(out), "--skip", "loop",
         "fit-synthetic", "--decoders", "dali"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "throughput.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["model-alone", "fit-dali"]
    assert rows[1]["images_per_sec"] > 0 and rows[1]["ratio"] > 0
    assert "--data.decoder dali" in Path(rows[1]["log"]).read_text().splitlines()[0]

    speed = tmp_path / "loaders.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/loader_speed.py"), "--data", str(shapes_root), "--workers", "1",
         "--batch-size", "4", "--batches", "2", "--decoders", "dali", "--out", str(speed)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads(speed.read_text())["loaders"]
    assert row["decoder"] == "dali" and row["batches"] == 2 and row["images_per_sec"] > 0


@pytest.mark.dali
def test_dali_cpu_ops_times_each_stage(shapes_root: Path, capsys) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dali_cpu_ops

    dali_cpu_ops.main(["--data", str(shapes_root), "--threads", "1", "--batch-size", "4", "--batches", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("threads")]
    assert len(lines) == 3 and "us per file" in lines[0] and all("images/s" in line for line in lines[1:])
    assert "crop windows" in lines[2]


@pytest.mark.dali
def test_dali_contention_times_the_model_beside_and_fed_by_the_pipeline(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import dali_contention

    out = tmp_path / "contention.json"
    dali_contention.main(["--smoke", "--out", str(out)])
    rows = {row["row"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == list(dali_contention.ROWS)
    assert all(row["images_per_sec"] > 0 and row["steps"] == 3 for row in rows.values())
    assert rows["model-alone"]["ratio_to_model_alone"] == 1.0
    assert rows["model-beside-pipeline"]["batches_dropped"] == 4  # one a step, the warm-up step's included
    for name in ("model-taking-batches", "model-fed-by-pipeline", "model-fed-one-ahead"):
        assert 0 < rows[name]["host_seconds_taking"] <= rows[name]["seconds"]


def test_step_timeline_splits_each_epoch_into_head_steps_and_tail(shapes_root: Path, tmp_path: Path, capsys) -> None:
    from benchmarks.step_timeline import StepTimeline
    from lit_imagenet.cli import main
    from tests.cli_args import fit_args

    # 24 training images in batches of 8: 3 steps an epoch, the callback named on the command line as on the GPU
    named = "--trainer.callbacks+=benchmarks.step_timeline.StepTimeline"
    cli = main(fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "2", named))
    timeline = next(c for c in cli.trainer.callbacks if isinstance(c, StepTimeline))
    written = json.loads((tmp_path / "step_timeline-rank0.json").read_text())
    assert written == json.loads(json.dumps(timeline.epochs))
    assert [e["epoch"] for e in written] == [0, 1]
    for epoch in written:
        s, rows = epoch["summary"], epoch["rows"]
        assert s["steps"] == len(rows) == 3 and s["images"] == 24
        assert s["head_s"] >= 0 and s["tail_s"] > 0 and s["steps_s"] > 0
        assert s["head_s"] + s["steps_s"] + s["tail_s"] == pytest.approx(s["epoch_s"])
        # the steps' span is the kernels and the gaps between them; on a CPU every gap waits for the host
        assert s["kernels_ms"]["sum"] + s["gap_ms"]["sum"] == pytest.approx(s["steps_s"] * 1000)
        assert s["host_wait_ms"]["sum"] == pytest.approx(s["gap_ms"]["sum"]) and s["queued_wait_ms"]["sum"] == 0
        assert "gap_ms" not in rows[0] and all(r["gap_ms"] >= 0 and r["host_ms"] > r["between_ms"] for r in rows[1:])
        for row in rows:  # the phases make up the step
            phases = row["forward_ms"] + row["backward_ms"] + row["optimizer_ms"]
            assert min(row["forward_ms"], row["backward_ms"], row["optimizer_ms"]) > 0
            assert phases == pytest.approx(row["kernels_ms"])
    out = capsys.readouterr().out
    assert "Step timeline, epoch 0:" in out and "Step timeline, epoch 1:" in out and " backward " in out


def test_step_timeline_times_an_epoch_resumed_part_way(shapes_root: Path, tmp_path: Path) -> None:
    from lit_imagenet.cli import main
    from tests.cli_args import fit_args

    named = "--trainer.callbacks+=benchmarks.step_timeline.StepTimeline"
    cli = main(
        fit_args(
            shapes_root, tmp_path, "--trainer.max_epochs", "1", "--step_checkpoint.every_n_train_steps", "2", named
        )
    )
    step_ckpt = Path(cli.trainer.log_dir) / "checkpoints" / "last-step.ckpt"
    os.utime(step_ckpt)  # the newest: the resume starts after the epoch's second step
    main(fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "last", named))
    written = json.loads((tmp_path / "step_timeline-rank0.json").read_text())
    assert [(e["epoch"], e["summary"]["steps"]) for e in written] == [(0, 1), (1, 3)]
    for epoch in written:
        s = epoch["summary"]
        assert 0 < s["epoch_s"] < 60 and s["head_s"] + s["steps_s"] + s["tail_s"] == pytest.approx(s["epoch_s"])
