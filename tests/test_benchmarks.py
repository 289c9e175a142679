"""The throughput benchmark's smoke mode runs end to end on CPU and writes its table and chart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import PIL
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
            "--timeline",
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
        if row["setting"].startswith("fit"):  # the step timeline of the epoch reported: its steps, split
            epoch = row["epochs"][-1]["epoch"]
            timeline = json.loads((Path(row["log"]).parents[1] / "fit" / Path(row["log"]).stem /
                                   "step_timeline-rank0.json").read_text())  # fmt: skip
            assert row["timeline"] == next(e["summary"] for e in timeline if e["epoch"] == epoch)
            assert row["timeline"]["steps"] > 0 and row["timeline"]["kernels_ms"]["sum"] > 0
        else:
            assert "timeline" not in row
    assert rows[0]["ratio"] == 1.0
    env = report["environment"]
    for key in ("cpu_count", "torch", "torchvision", "pytorch_lightning"):
        assert env[key], key
    assert all(row["compile"] == "eager" for row in rows)
    assert "| fit-nvjpeg | resnet18 | eager | 1 |" in proc.stdout
    command, log = (out / "logs" / "fit-pil-resnet18-1dev.log").read_text().split("\n", 1)
    assert "--model.compile" not in command  # the recipe's mode: auto, eager on a CPU
    synthetic = (out / "logs" / "fit-synthetic-resnet18-1dev.log").read_text().split("\n", 1)[0]
    assert "--model.compile false" in synthetic  # not the recipe's config: the mode is named
    assert "Compile: eager (--model.compile auto compiles on CUDA devices only; this run trains on cpu)." in log

    png = (out / "throughput.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000


def test_a_row_past_its_timeout_is_stopped_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "throughput"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/throughput.py"), "--smoke", "--out", str(out), "--skip", "loop",
         "--decoders", "pil", "--row-timeout", "0.5", "--compile", "eager"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "throughput.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["model-alone", "fit-synthetic", "fit-pil"]
    for row in rows[1:]:
        assert row["timed_out"] is True and row["images_per_sec"] is None and row["ratio"] is None
    assert "| fit-pil | resnet18 | eager | 1 | - (stopped) | - | - |" in proc.stdout
    assert "--model.compile false" in (out / "logs" / "fit-pil-resnet18-1dev.log").read_text()  # eager asked for
    assert (out / "throughput.png").read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("ends", ["switched", "stays eager", "switched, timed"])
def test_a_background_compile_row_reports_its_first_epoch_after_the_switch_and_stops_there(
    tmp_path: Path, ends: str
) -> None:
    """The recipe's mode on one GPU trains eagerly until its background compile ends: the row reports the first epoch
    wholly compiled, and stops the run after it (or where the run says it stays eager, with no figure). With
    ``--timeline`` it stops once that epoch's step timeline is written, and keeps its summary."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import throughput

    timed = ends == "switched, timed"
    args = throughput.parse_args(["--out", str(tmp_path), "--row-timeout", "60", *(["--timeline"] if timed else [])])
    args.compile = "background"
    (tmp_path / "logs").mkdir()
    switch = ("Compiled the network from the caches of its background compile (41.2 s) at step 250 and ran its first "
              "compiled step in 3.1 s: 2 of 2 graphs found in the caches (compiler caches: /c).")  # fmt: skip
    eager = "Compile: eager (the background compile failed (OSError: no space); its log: /c/compile.log)."
    epochs = [f"Epoch {k}: {rate:,} images/s over all processes (25,600 images in 6.4 s)"
              for k, rate in enumerate([4000, 4001, 4002, 4500, 6400])]  # fmt: skip
    printed = [*epochs[:3], eager if ends == "stays eager" else switch, *epochs[3:]]
    script = "import time\n" + "".join(f"print({line!r}, flush=True)\n" for line in printed)
    if timed:  # as the callback does: the epoch's line first, then its timeline written, then the timeline's line
        summaries = [{"epoch": k, "summary": {"steps": 100 + k}, "rows": []} for k in range(5)]
        written = tmp_path / "step_timeline-rank0.json"
        script += f"time.sleep(1)\nimport pathlib\npathlib.Path({str(written)!r})"
        script += f".write_text({json.dumps(summaries)!r})\nprint('Step timeline, epoch 4: ...', flush=True)\n"
    script += "time.sleep(60)\n"
    started = time.monotonic()
    row = throughput._run_fit("fit-fake", [sys.executable, "-c", script], args, 1, tmp_path)
    assert time.monotonic() - started < 30 and not row["timed_out"]
    assert ("timeline" in row) == timed
    if timed:
        assert row["timeline"] == {"steps": 104} and row["images_per_sec"] == 6400
    elif ends == "switched":
        assert row["images_per_sec"] == 6400 and row["epochs"][-1]["epoch"] == 4
        assert row["switch"] == {"child_seconds": 41.2, "step": 250, "first_compiled_step_seconds": 3.1,
                                 "graphs_found": 2, "graphs": 2, "epoch": 3}  # fmt: skip
    else:
        assert row["images_per_sec"] is None and row["switch"] == {"stays": eager}


def test_gpu_check_reads_the_test_report_and_marks_parts_of_other_commits(tmp_path: Path, monkeypatch) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    report = tmp_path / "gpu-tests.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_multi_gpu" name="test_a" time="12.5"/>'
        '<testcase classname="tests.test_multi_gpu" name="test_b" time="3"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="0"><skipped message="needs 2 CUDA devices"/>'
        '</testcase><testcase classname="tests.test_gpu" name="test_d" time="1"><failure message="assert 5 &lt;=\n'
        '  4"/></testcase><testcase classname="tests.test_gpu" name="test_e" time="1"><error>Traceback\n  x\n'
        "E   RuntimeError: CUDA error\n</error></testcase></testsuite></testsuites>"
    )
    commands = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda cmd, **k: commands.append(cmd))
    rows = gpu_check.run_tests(tmp_path, ["tests/test_gpu.py"], 120)
    assert commands[0][-3:] == ["-o", "timeout=120", "tests/test_gpu.py"]  # a test that hangs fails; the rest run
    assert [(r["row"], r["ok"]) for r in rows] == [
        ("test_multi_gpu::test_a", True), ("test_multi_gpu::test_b", False), ("test_gpu::test_c", True),
        ("test_gpu::test_d", False), ("test_gpu::test_e", False),
    ]  # fmt: skip
    assert rows[2]["detail"] == "skipped: needs 2 CUDA devices" and rows[2]["skipped"]
    assert [rows[k]["detail"] for k in (1, 3, 4)] == ["boom", "assert 5 <= 4", "E RuntimeError: CUDA error"]
    assert "detail" not in rows[0]
    bench = gpu_check._bench_row({"setting": "fit-pil", "arch": "resnet50", "devices": 2, "images_per_sec": 5000.0,
                                  "ratio": 0.8, "peak_memory_gib": 11.0})  # fmt: skip
    assert "timeline" not in bench
    summary = {"steps": 100, "images": 25600, "epoch_s": 4.0, "head_s": 0.1, "steps_s": 3.6, "tail_s": 0.3,
               "kernels_ms": {"sum": 3500.0, "median": 35.0, "max": 40.0},
               "lead_ms": {"sum": 2000.0, "median": 20.123, "max": 30.0}}  # fmt: skip
    timed = gpu_check._bench_row({"setting": "fit-dali", "arch": "resnet50", "devices": 1, "images_per_sec": 6400.0,
                                  "ratio": 0.9, "peak_memory_gib": 10.4, "timeline": summary})  # fmt: skip
    assert timed["timeline"] == {"steps": 100, "epoch_s": 4.0, "head_s": 0.1, "steps_s": 3.6, "tail_s": 0.3,
                                 "kernels_ms": {"sum_s": 3.5, "median": 35.0},
                                 "lead_ms": {"sum_s": 2.0, "median": 20.12}}  # fmt: skip
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
    monkeypatch.setattr(gpu_check, "run_tests", lambda out, args, timeout: results[args[0]])
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


def test_gpu_check_shares_run_at_once_keep_each_others_rows(tmp_path: Path, monkeypatch) -> None:
    """A share that ends while another runs: the one that ends last reads the record as the first left it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "_machine", lambda: {"gpus": ["H"]})
    monkeypatch.setattr(gpu_check, "tree_digest", lambda: "a")
    record = tmp_path / "record.json"

    def check(share: str) -> int:
        out = tmp_path / share
        return gpu_check.main(["--part", "tests", "--out", str(out), "--record", str(record), "--pytest-args", share])

    def run_tests(out: Path, args: list[str], timeout: int) -> list[dict]:
        if args == ["long"]:
            check("short")  # starts after this share and ends before it
        return [{"row": f"test_{args[0]}::t", "ok": True}]

    monkeypatch.setattr(gpu_check, "run_tests", run_tests)
    assert check("long") == 0
    tests = json.loads(record.read_text())["parts"]["tests"]
    assert [r["row"] for r in tests["rows"]] == ["test_short::t", "test_long::t"]
    assert (tests["passed"], tests["pytest_args"]) == (2, ["short", "long"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["long", "record.json", "short"]  # no partial file left


def test_gpu_check_keeps_the_rows_of_other_bench_shares_of_the_same_code(tmp_path: Path, monkeypatch) -> None:
    """The bench run a few decoders at a time: one record with every decoder's rows, and each share's machine."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    machine = {"gpus": ["H200"]}
    monkeypatch.setattr(gpu_check, "_machine", lambda: dict(machine))
    monkeypatch.setattr(gpu_check, "tree_digest", lambda: "a")

    def rows(out: Path, decoders: list[str], extra: list[str]) -> list[dict]:
        return [{"row": "model-alone resnet50 x1", "ok": True, "images_per_sec": float(len(decoders))}] + [
            {"row": f"fit-{d} resnet50 x1", "ok": d != "dali"} for d in decoders
        ]

    monkeypatch.setattr(gpu_check, "run_bench", rows)
    record = tmp_path / "record.json"

    def check(*decoders: str) -> dict:
        gpu_check.main(["--part", "bench", "--out", str(tmp_path), "--record", str(record), "--decoders", *decoders])
        return json.loads(record.read_text())["parts"]["bench"]

    check("pil", "torchvision")
    machine["gpus"] = ["H100"]
    both = check("nvjpeg", "dali")
    assert [r["row"] for r in both["rows"]] == [
        "fit-pil resnet50 x1", "fit-torchvision resnet50 x1", "model-alone resnet50 x1", "fit-nvjpeg resnet50 x1",
        "fit-dali resnet50 x1",
    ]  # fmt: skip
    assert both["rows"][2]["images_per_sec"] == 2.0  # a row both shares ran: the later share's
    assert (both["passed"], both["failed"], both["decoders"]) == (4, 1, [["pil", "torchvision"], ["nvjpeg", "dali"]])
    assert both["machines"] == [{"gpus": ["H200"]}, {"gpus": ["H100"]}]


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
    """``--decoders dali`` gives a fit-dali row beside model-alone."""
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


@pytest.mark.dali
def test_dali_pipelines_records_each_stage_with_its_memory(tmp_path: Path) -> None:
    """``dali_pipelines.py`` builds three pipelines and records each stage with its seconds and resident memory."""
    from benchmarks.dali_pipelines import main

    out = tmp_path / "pipelines.json"
    images = ["--images", "24", "--batches", "2", "--folder", str(tmp_path / "images")]
    assert main(["--one", "1", *images, "--out", str(out)]) == 0  # what each thread count's process runs
    events = json.loads(out.read_text())
    names = [e["event"] for e in events]
    assert names[:3] == ["start", "DALI imported", "first pipeline built"]
    assert names[-1] == "its next 6 batches" and len(names) == 15
    assert all(e["anonymous"] > 0 and e["files"] > 0 for e in events)
    assert [e["second"] for e in events] == sorted(e["second"] for e in events)
    built = [e for e in events if "built" in e["event"]]
    assert len(built) == 3 and all(e["build_s"] > 0 for e in built)
    assert all(e["s_per_batch"] > 0 for e in events if "s_per_batch" in e)


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


def _startup_module():
    """``benchmarks/startup.py``, imported as a module."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import startup
    finally:
        sys.path.pop(0)
    return startup


def test_startup_benchmark_builds_the_link_tree_and_times_a_first_run_and_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link tree; then, ``--bytecode``: every import row and run reads one cache, compiled once before them and
    read even where writing is turned off; the restart runs in the first run's folders."""
    startup = _startup_module()
    sources = []
    for k in range(3):
        (tmp_path / "src").mkdir(exist_ok=True)
        sources.append(tmp_path / "src" / f"{k}.jpg")
        sources[-1].write_bytes(b"\xff\xd8\xff" + bytes([k]))
    tree = startup.build_tree(tmp_path / "tree", sources, train=10, val=4, classes=3)
    assert sorted(len(list(d.iterdir())) for d in (tree / "train").iterdir()) == [3, 3, 4]
    assert sum(1 for _ in (tree / "val").rglob("*.JPEG")) == 4 and os.stat(sources[0]).st_nlink == 1 + 5
    assert startup.build_tree(tmp_path / "tree", sources, train=10, val=4, classes=3) == tree  # kept, not made again
    out = tmp_path / "startup"
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    # Two of the import rows (each a process that imports torch): the others are timed the same way.
    monkeypatch.setattr(startup, "IMPORTS", (startup.IMPORTS[0], startup.IMPORTS[-1]))
    assert startup.main(["--out", str(out), "--smoke", "--probe", "--bytecode"]) == 0
    report = json.loads((out / "startup.json").read_text())
    assert report["complete"] is True and report["machine"]["cpus"] >= 1
    imports, rows = report["rows"][:2], report["rows"][2:]
    assert [r["run"] for r in imports] == [
        "imports: torch, torchvision (bytecode cached)",
        "imports: lit_imagenet.cli (bytecode cached)",
    ]
    assert all(r["seconds"] > 0 for r in imports)
    by_package = report["import_seconds_by_package"]["lit_imagenet.cli (bytecode cached)"]
    # The 15 packages that took longest, and the rest as "other": this package's own modules rank where the
    # machine's load puts them, torch and Lightning always among the largest.
    assert {"torch", "pytorch_lightning"} <= set(by_package) and len(by_package) <= 16
    assert sum(by_package.values()) > 0.5 and ("lit_imagenet" in by_package or "other" in by_package)
    named = ["pil, first run (bytecode cached)", "pil, restart (bytecode cached)"]
    assert [r["run"] for r in rows] == named
    assert all(r["seconds_to_first_step"] > 0 and r["peak_pss_gib"] > 0 and not r["timed_out"] for r in rows)
    for row in rows:  # the peak's parts add up to it; a CPU run trains eagerly: no compile child
        parts = row["peak_pss_parts_gib"]
        assert parts["main"] > 0 and parts["compile child"] == 0 and parts["compile workers"] == 0
        assert set(parts) == {"main", "loader workers", "compile child", "compile workers", "early scan"}
        assert abs(sum(parts.values()) - row["peak_pss_gib"]) <= 0.03 and row["peak_pss_second"] > 0
    assert "images_per_sec" in rows[0] and len(list((out / "index-pil").glob("*.index"))) == 2
    assert len(list((out / "runs" / "pil").rglob("version_*"))) == 2  # the restart in the first run's folder
    tag = sys.implementation.cache_tag
    ours = out / "pycache" / str(REPO).lstrip(os.sep) / "lit_imagenet"
    assert (ours / f"cli.{tag}.pyc").is_file()  # written by the import before the rows
    pil = out / "pycache" / str(Path(PIL.__file__).parent).lstrip(os.sep)
    assert (pil / f"JpegImagePlugin.{tag}.pyc").is_file()  # and by the runs: PIL imports it at the first JPEG
    before = rows[1]["lines_before_first_step"]  # the restart's start, line by line with its second
    assert len(before) > 1 and re.search(r"^\s*[\d.]+ Epoch 0 \[\d+/\d+\] step 1\b", before[-1]), before
    for row in rows:  # --probe: the fit's hooks in order, then the first batch, whose step's end is the first logged
        probe = row["probe"]  # step's
        (_, came, ended), *later = probe["batches_s"]
        hooks = [probe[f"{hook}_s"] for hook in ("setup", "fit_start", "train_start", "epoch_start")]
        assert 0 < hooks[0] and hooks == sorted(hooks) and hooks[-1] <= came, probe
        assert came <= ended < row["seconds_to_first_step"] + 0.5, probe
        assert all(start >= ended for _, start, _ in later[:1]), probe
    (memory,) = rows[0]["probe"]["memory"]  # the smoke's first run writes its memory after step 2; a restart none
    assert memory["step"] == 2 and memory["pinned_gib"] == {} and all(r["probe"]["memory"] == [] for r in rows[1:])
    assert memory["main_pss_gib"]["files"] > 0.05 and 0.1 < sum(memory["main_pss_gib"].values()) < 3, memory


def test_the_probe_splits_a_process_pss_by_what_is_mapped() -> None:
    """64 MiB of torch's shared memory (what a loader worker's batch arrives in) count as shared memory, and the
    parts add up to the process's PSS."""
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.probe import pss_by_kind
    finally:
        sys.path.pop(0)
    import torch

    before = pss_by_kind()
    block = torch.ones(64 * 2**20, dtype=torch.uint8).share_memory_()
    block[::4096] = 2  # every page in
    after = pss_by_kind()
    assert 0.06 < after["shared memory"] - before["shared memory"] < 0.07, (before, after)
    assert after["files"] > 0 and after["anonymous"] > 0
    rollup = int(re.search(r"^Pss:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text(), re.M).group(1))
    assert abs(sum(after.values()) - rollup / 2**20) < 0.01
    del block


def test_the_peak_pss_is_split_into_the_main_process_loader_workers_and_a_compile_child(tmp_path: Path) -> None:
    """A process tree of the run's shape: the main process, a forked worker holding 200 MB, a child running a
    ``background_compile.py`` with a worker of its own holding 300 MB, and an early scan holding 100 MB. Each part
    is counted where it belongs."""
    startup = _startup_module()
    ready = tmp_path / "ready"
    ready.mkdir()
    touch = f"import pathlib; pathlib.Path({str(ready)!r}, str(os.getpid())).touch(); "  # once every page is in
    hold = (
        "import os, sys, time; block = bytearray(int(sys.argv[1]) * 2**20); block[::4096] = b'x' * len(block[::4096]); "
        + touch
    )
    child = tmp_path / "background_compile.py"
    child.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {hold + 'time.sleep(60)'!r}, '300'])\n"
        "time.sleep(60)\n"
    )  # fmt: skip
    main = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(child)!r}])\n"
        f"subprocess.Popen([sys.executable, '-c', {hold + 'time.sleep(60)'!r}, '100', 'lit_imagenet.data.prescan'])\n"
        "if os.fork() == 0:\n"
        f"    block = bytearray(200 * 2**20); block[::4096] = b'x' * len(block[::4096]); {touch}time.sleep(60)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", main], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(ready.iterdir())) < 3 and time.monotonic() < deadline:  # the holders have touched their pages
            time.sleep(0.1)
        parts = startup.tree_pss_by_part(proc.pid)
        assert 0.28 < parts["compile workers"] < 0.4, parts  # the child's worker's 300 MB
        assert 0.18 < parts["loader workers"] < 0.3, parts  # the forked worker's 200 MB
        assert 0.09 < parts["early scan"] < 0.15, parts  # the early scan's 100 MB
        assert 0 < parts["compile child"] < 0.1 and 0 < parts["main"] < 0.1, parts
        assert abs(sum(parts.values()) - startup.tree_pss_gib(proc.pid)) < 0.02
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_startup_call_stopped_part_way_keeps_the_rows_it_had(tmp_path: Path, monkeypatch) -> None:
    """The report is written after every row: a call ended by its time limit during its second run keeps the first."""
    startup = _startup_module()
    calls = []

    def run(name, *args, **kwargs):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a time limit's signal does to the call, part-way through a run
        return {"run": name, "first_step": 1, "seconds_to_first_step": 2.5, "peak_pss_gib": 0.1, "timed_out": False}

    monkeypatch.setattr(startup, "run", run)
    out = tmp_path / "startup"
    with pytest.raises(KeyboardInterrupt):
        startup.main(["--out", str(out), "--smoke", "--no-imports", "--tree", str(tmp_path / "tree")])
    report = json.loads((out / "startup.json").read_text())
    assert calls == ["pil, first run", "pil, restart"]
    assert [r["run"] for r in report["rows"]] == ["pil, first run"] and report["complete"] is False
    assert report["tree"]["train"] > 0 and report["machine"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU's step succeeds there")
def test_warm_gpu_without_a_cuda_device_stops_with_one_sentence(tmp_path: Path) -> None:
    startup = _startup_module()
    with pytest.raises(SystemExit, match="on a machine without a CUDA device, leave --warm-gpu out"):
        startup.main(["--out", str(tmp_path / "out"), "--smoke", "--no-imports", "--warm-gpu",
                      "--tree", str(tmp_path / "tree")])  # fmt: skip
    assert not (tmp_path / "out" / "startup.json").exists()  # no row ran
    assert not (tmp_path / "tree").exists() and not (tmp_path / "tree-sources").exists()  # nor was the data made


def test_lean_starts_the_reference_a_restart_and_a_first_run_of_their_own(tmp_path: Path, monkeypatch) -> None:
    """``--lean``: the reference, a restart in the first run's folders and a first run in empty folders of its own,
    each under ``python -S`` over the requirements alone and timed to its first step. The reference also runs a
    second time as it is, to its first step: its first run on a machine autotunes cuDNN for longer."""
    startup = _startup_module()
    calls = []

    def run(name, cmd, out, steps, pattern, images, timeout, env, steady_from=100, after_switch=0, probe=None):
        folder = cmd[cmd.index("--trainer.default_root_dir") + 1] if "--trainer.default_root_dir" in cmd else None
        if folder is not None:  # a first run finds its folder emptied; its index folder is the run's own
            assert not Path(folder).exists() or not name.startswith("pil, first run")
            Path(folder).mkdir(parents=True, exist_ok=True)
            assert Path(cmd[cmd.index("--data.index_dir") + 1]).name == "index-" + Path(folder).name
        first_path = env.get("PYTHONPATH", "").split(os.pathsep)[0]
        calls.append((name, cmd[1] == "-S", first_path, steps, after_switch, folder))
        seconds = {"reference": 20.0, "reference, again": 10.0, "reference (requirements only)": 12.0,
                   "pil, first run": 8.0, "pil, restart": 7.0, "pil, restart (requirements only)": 5.0,
                   "pil, first run (requirements only)": 6.0}[name]  # fmt: skip
        return {"run": name, "first_step": 1, "seconds_to_first_step": seconds, "last_step": steps + after_switch,
                "peak_pss_gib": 4.0 if name == "reference" else 3.0, "timed_out": False}  # fmt: skip

    monkeypatch.setattr(startup, "run", run)
    monkeypatch.setattr(startup, "lean_site", lambda folder, requirements: folder)
    out = tmp_path / "startup"
    reference = tmp_path / "main_amp.py"
    reference.write_text("")
    argv = ["--out", str(out), "--smoke", "--no-imports", "--tree", str(tmp_path / "tree"), "--lean"]
    assert startup.main([*argv, "--reference", str(reference), "--steps", "5", "--after-switch", "7"]) == 0
    lean, runs = str(out / "lean-site"), out / "runs"
    assert [c[:5] for c in calls] == [
        ("reference", False, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0], 5, 0),
        ("reference, again", False, calls[0][2], 1, 0),
        ("reference (requirements only)", True, lean, 1, 0),
        ("pil, first run", False, calls[0][2], 5, 7),
        ("pil, restart", False, calls[0][2], 1, 7),
        ("pil, restart (requirements only)", True, lean, 1, 0),
        ("pil, first run (requirements only)", True, lean, 1, 0),
    ]
    assert [c[5] for c in calls[3:]] == [str(runs / "pil")] * 3 + [str(runs / "pil-lean")]
    # Each decoder beside the reference: its first runs as fractions of the reference's, its restarts' seconds.
    assert json.loads((out / "startup.json").read_text())["beside_reference"] == {"pil": {
        "first_run_over_reference_first_run": 0.4, "first_run_over_reference_again": 0.8,
        "requirements_only_first_run_over_reference": 0.5, "restart_seconds": [7.0],
        "requirements_only_restart_seconds": [5.0], "peak_pss_over_reference": 0.75, "peak_pss_same_span": False,
    }}  # fmt: skip
    with pytest.raises(SystemExit):
        startup.parse_args([*argv, "--reference-runs", "0"])


def test_a_start_that_never_reached_its_first_step_is_left_out_of_the_comparison() -> None:
    startup = _startup_module()

    def row(of, start, seconds, lean=False, last=400, pss=5.0):
        return {"of": of, "start": start, "requirements_only": lean, "seconds_to_first_step": seconds,
                "last_step": last, "peak_pss_gib": pss}  # fmt: skip

    rows = [row("reference", "first run", 20.0), row("dali", "first run", None, last=None, pss=2.0),
            row("dali", "restart", 9.0, last=10), row("dali", "restart 2", None, last=None),
            row("nvjpeg", "first run", 12.0, pss=4.0)]  # fmt: skip
    beside = startup.beside_reference(rows)
    assert beside["dali"] == {"restart_seconds": [9.0], "peak_pss_over_reference": 0.4, "peak_pss_same_span": False}
    assert beside["nvjpeg"] == {"first_run_over_reference_first_run": 0.6, "peak_pss_over_reference": 0.8,
                                "peak_pss_same_span": True}  # fmt: skip
    assert startup.beside_reference(rows[1:]) == {"dali": {"restart_seconds": [9.0]}, "nvjpeg": {}}


def test_the_lean_site_holds_the_requirements_and_nothing_else(tmp_path: Path) -> None:
    """``startup.py --lean`` runs with only what the package requires importable: other packages are not probed."""
    startup = _startup_module()
    assert {"torch", "pytorch-lightning", "torchmetrics", "jsonargparse[signatures]"} <= set(startup.install_requires())
    site = startup.lean_site(tmp_path / "lean", startup.install_requires())
    code = (
        "import importlib.util, lit_imagenet.cli, sys; "
        "print(importlib.util.find_spec('pytest') is None, 'pytest' in sys.modules, len(sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-S", "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[:2] == ["True", "False"]
    assert (site / "torch").is_symlink() and not (site / "_pytest").exists()


def test_startup_benchmark_counts_global_steps_across_epochs(tmp_path: Path) -> None:
    startup = _startup_module()
    lines = [
        "Epoch 0 [1/2] step 1 | x",
        "Epoch 0 [2/2] step 2 | x",
        "Epoch 1 [1/2] step 3 | x",
        "Epoch 1 [2/2] step 4 | x",
    ]
    code = f"import time\nfor line in {lines!r}:\n    print(line, flush=True)\n    time.sleep(0.2)\ntime.sleep(30)"
    cmd = [sys.executable, "-c", code]
    row = startup.run("two epochs", cmd, tmp_path, 4, startup.OURS, 8, 20, dict(os.environ), steady_from=2)
    assert row["first_step"] == 1 and not row["timed_out"]
    assert 8 * 2 / 0.6 < row["images_per_sec"] < 8 * 2 / 0.3  # steps 2 to 4, 0.4 s apart; stopped at step 4


def test_startup_rows_take_the_compiled_first_step_from_its_line(tmp_path: Path) -> None:
    startup = _startup_module()
    step = "Epoch 0 [10/5005] step 10 | 0.459 s/step | 558 images/s | loss 7.0564"
    compiled = "Compiled the network and ran its first step in 3.4 s (compiler caches: /runs/compile_cache)."
    for name, printed, seconds in (("compiled", [compiled, step], 3.4), ("eager", [step], None)):
        cmd = [sys.executable, "-c", f"print({chr(10).join(printed)!r})"]
        row = startup.run(name, cmd, tmp_path, 10, startup.OURS, 256, 60, dict(os.environ))
        assert row["first_step"] == 10 and row["first_compiled_step_seconds"] == seconds and not row["timed_out"]


def test_startup_runs_on_past_their_step_until_some_steps_after_the_background_compiles_switch(tmp_path: Path) -> None:
    """``--after-switch N``: the peak PSS covers the background compile, and the compiled steps get their images/s."""
    startup = _startup_module()

    def last_step(row: dict) -> int:
        printed = Path(row["log"]).read_text().splitlines()[1:]  # after the command
        return max(
            int(m.group(1)) for m in (startup.OURS.search(line.strip().split(" ", 1)[-1]) for line in printed) if m
        )

    steps = [f"Epoch 0 [{k}/5005] step {k} | x" for k in range(10, 301, 10)]
    switch = ("Compiled the network from the caches of its background compile (51.0 s) at step 125 and ran its first "
              "compiled step in 3.2 s: 2 of 2 graphs found in the caches (compiler caches: /c).")  # fmt: skip
    printed = [*steps[:12], switch, *steps[12:]]  # the switch between steps 120 and 130
    code = f"import time\nfor line in {printed!r}:\n    print(line, flush=True)\n    time.sleep(0.02)\ntime.sleep(30)"
    row = startup.run("auto", [sys.executable, "-c", code], tmp_path, 40, startup.OURS, 256, 20, dict(os.environ),
                      steady_from=20, after_switch=150)  # fmt: skip
    assert not row["timed_out"] and row["first_step"] == 10 and row["first_compiled_step_seconds"] == 3.2
    assert last_step(row) == 280  # stopped at step 125 + 150, on the logging grid
    assert {k: row["switch"][k] for k in ("step", "child_seconds", "graphs_found", "graphs")} == {
        "step": 125, "child_seconds": 51.0, "graphs_found": 2, "graphs": 2}  # fmt: skip
    assert row["compiled_images_per_sec"] > 0  # steps 150 to 280
    row = startup.run("auto2", [sys.executable, "-c", code], tmp_path, 40, startup.OURS, 256, 20, dict(os.environ),
                      steady_from=20)  # fmt: skip
    assert last_step(row) == 40 and "compiled_images_per_sec" not in row and "switch" not in row


def test_drop_caches_drops_them_before_every_run_and_names_the_rows_so(tmp_path: Path, monkeypatch) -> None:
    startup = _startup_module()
    events = []
    monkeypatch.setattr(startup, "drop_caches", lambda: events.append("drop"))

    def run(name, *args, **kwargs):
        events.append(name)
        return {"run": name, "first_step": 1, "seconds_to_first_step": 2.5, "peak_pss_gib": 0.1, "timed_out": False}

    monkeypatch.setattr(startup, "run", run)
    reference = tmp_path / "main_amp.py"
    reference.write_text("")
    out = tmp_path / "startup"
    argv = ["--out", str(out), "--smoke", "--no-imports", "--tree", str(tmp_path / "tree"), "--drop-caches"]
    assert startup.main([*argv, "--reference", str(reference), "--restarts", "2"]) == 0
    assert events == ["drop",  # before anything is made: a machine where it fails stops at once
                      "drop", "reference (cold caches)", "drop", "reference, again (cold caches)",
                      "drop", "pil, first run (cold caches)", "drop", "pil, restart (cold caches)",
                      "drop", "pil, restart 2 (cold caches)"]  # fmt: skip


def test_drop_caches_where_the_kernel_refuses_stops_with_one_sentence(tmp_path: Path, monkeypatch) -> None:
    startup = _startup_module()
    monkeypatch.setattr(startup, "DROP_CACHES", tmp_path / "no such folder" / "drop_caches")
    monkeypatch.setattr(startup, "run", lambda *args, **kwargs: pytest.fail("no run starts"))
    with pytest.raises(SystemExit, match=r"drop_caches cannot be written \(.*\); run the benchmark as root, or leave"):
        startup.main(["--out", str(tmp_path / "out"), "--smoke", "--no-imports", "--drop-caches",
                      "--tree", str(tmp_path / "tree")])  # fmt: skip
    assert not (tmp_path / "tree").exists()  # nothing was made
