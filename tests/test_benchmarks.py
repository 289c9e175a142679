"""The benchmark scripts run end to end on a CPU, and the GPU check reads its reports and keeps its record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_check  # noqa: E402


def _throughput(out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "benchmarks/throughput.py"), "--smoke", "--out", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_throughput_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput"
    proc = _throughput(out, "--decoders", "pil", "--train-per-class", "16")  # 12 steps: a pace from batch 11
    report = json.loads((out / "throughput.json").read_text())
    rows = report["rows"]
    assert [r["setting"] for r in rows] == ["model-alone", "fit-synthetic", "fit-pil"]
    for row in rows:
        assert row["images_per_sec"] > 0 and row["ratio"] > 0 and row["devices"] == 1, row
        assert row["peak_memory_gib"] is None  # CPU: no GPU memory to report
    assert all(row["steady_images_per_sec"] > 0 for row in rows[1:]), rows
    assert rows[0]["ratio"] == 1.0
    assert all(report["environment"][key] for key in ("cpus", "torch", "torchvision", "pytorch_lightning"))
    assert "| fit-pil | resnet18 | 1 |" in proc.stdout
    command = (out / "logs" / "pil-resnet18-1dev.log").read_text().split("\n", 1)[0]
    assert "--config" in command and "--model.compile" not in command  # the recipe's own mode


def test_a_row_past_its_timeout_is_stopped_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "throughput"
    proc = _throughput(out, "--decoders", "pil", "--row-timeout", "0.5", "--compile", "eager")
    rows = json.loads((out / "throughput.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["model-alone", "fit-synthetic", "fit-pil"]
    for row in rows[1:]:
        assert row["timed_out"] is True and row["images_per_sec"] is None and row["ratio"] is None
        assert row["error"] == "stopped after 0.5 s"
    assert "| fit-pil | resnet18 | 1 | - | - | - | - |" in proc.stdout
    assert "--model.compile false" in (out / "logs" / "pil-resnet18-1dev.log").read_text()


@pytest.mark.dali
def test_dali_rows(tmp_path: Path) -> None:
    out = tmp_path / "throughput"
    _throughput(out, "--skip", "fit-synthetic", "--decoders", "dali")
    rows = json.loads((out / "throughput.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["model-alone", "fit-dali"]
    assert rows[1]["images_per_sec"] > 0 and rows[1]["ratio"] > 0
    assert "--data.decoder dali" in Path(rows[1]["log"]).read_text().splitlines()[0]


def test_gpu_check_reads_the_test_report_and_says_which_rows_failed(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "gpu-tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_multi_gpu" name="test_a" time="12.5"/>'
        '<testcase classname="tests.test_multi_gpu" name="test_b" time="3"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c" time="0"><skipped message="needs 2 CUDA devices"/>'
        '</testcase><testcase classname="tests.test_gpu" name="test_d" time="1"><error>Traceback\n  x\n'
        "E   RuntimeError: CUDA error\n</error></testcase></testsuite></testsuites>"
    )
    commands = []
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda cmd, **k: commands.append(cmd))
    rows = gpu_check.run_tests(tmp_path, ["tests/test_gpu.py"], 120)
    assert commands[0][-3:] == ["-o", "timeout=120", "tests/test_gpu.py"]  # a test that hangs fails; the rest run
    assert [(r["row"], r["ok"]) for r in rows] == [
        ("test_multi_gpu::test_a", True), ("test_multi_gpu::test_b", False), ("test_gpu::test_c", True),
        ("test_gpu::test_d", False),
    ]  # fmt: skip
    assert [rows[k]["detail"] for k in (1, 2, 3)] == [
        "boom",
        "skipped: needs 2 CUDA devices",
        "E RuntimeError: CUDA error",
    ]
    record = {"commit": "new", "machine": {"gpus": ["H"]},
              "parts": {"tests": {"commit": "old", "passed": 1, "failed": 2, "skipped": 1, "rows": rows}}}  # fmt: skip
    text = gpu_check.summary(record)
    assert "tests: 1 passed, 2 failed, 1 skipped (at old, not this commit)" in text
    assert "skip  test_gpu::test_c" in text and "FAIL  test_multi_gpu::test_b" in text


def test_gpu_check_records_each_part_and_keeps_the_other(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "_machine", lambda: {"gpus": ["H100"]})
    monkeypatch.setattr(gpu_check, "run_tests", lambda out, args, timeout: [{"row": "test_gpu::t", "ok": True}])

    run = subprocess.run

    def throughput(cmd: list[str], **kwargs) -> object:  # throughput.py's report, as it writes it
        if "--out" not in cmd:
            return run(cmd, **kwargs)  # git
        row = {"arch": "resnet50", "devices": 1}
        failed = {"images_per_sec": None, "ratio": None, "error": "exit status 1"}
        alone = {"images_per_sec": 6000.0, "steady_images_per_sec": None, "ratio": 1.0}
        rows = [{**row, "setting": "model-alone", **alone}, {**row, "setting": "fit-pil", **failed}]
        folder = Path(cmd[cmd.index("--out") + 1])
        folder.mkdir(parents=True)
        (folder / "throughput.json").write_text(json.dumps({"rows": rows}))

    monkeypatch.setattr(gpu_check.subprocess, "run", throughput)
    record = tmp_path / "record.json"
    args = ["--out", str(tmp_path / "out"), "--record", str(record)]
    assert gpu_check.main(["--part", "tests", *args]) == 0
    assert gpu_check.main(["--part", "bench", "--decoders", "pil", *args]) == 1  # a row without images/s failed
    parts = json.loads(record.read_text())["parts"]
    assert (parts["tests"]["passed"], parts["bench"]["passed"], parts["bench"]["failed"]) == (1, 1, 1)
    assert parts["bench"]["rows"][0] == {"row": "model-alone resnet50 x1", "ok": True, "images_per_sec": 6000.0,
                                         "steady_images_per_sec": None, "ratio": 1.0, "peak_memory_gib": None,
                                         "compile_seconds": None}  # fmt: skip
    assert parts["bench"]["rows"][1]["detail"] == "exit status 1"  # why, in the record
    assert parts["bench"]["tree_sha256"] == gpu_check.tree_digest()


def test_gpu_check_runs_of_some_tests_add_up_to_one_part_of_the_same_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "_machine", lambda: {"gpus": ["H100"]})
    results = {"tests/test_a.py": [{"row": "test_a::t", "ok": True}, {"row": "test_a::u", "ok": False}],
               "tests/test_a.py::u": [{"row": "test_a::u", "ok": True}],
               "tests/test_b.py": [{"row": "test_b::t", "ok": True}]}  # fmt: skip
    monkeypatch.setattr(gpu_check, "run_tests", lambda out, args, timeout: results[args[0]])
    record = tmp_path / "record.json"
    args = ["--part", "tests", "--out", str(tmp_path / "out"), "--record", str(record), "--pytest-args"]

    def rows() -> list[tuple[str, bool]]:
        part = json.loads(record.read_text())["parts"]["tests"]
        assert part["passed"] + part["failed"] == len(part["rows"])
        return [(row["row"], row["ok"]) for row in part["rows"]]

    assert gpu_check.main([*args, "tests/test_a.py"]) == 1
    assert gpu_check.main([*args, "tests/test_b.py"]) == 1  # the part still has test_a::u's failure
    assert gpu_check.main([*args, "tests/test_a.py::u"]) == 0  # the failed test again: its new row replaces it
    assert rows() == [("test_a::t", True), ("test_b::t", True), ("test_a::u", True)]
    monkeypatch.setattr(gpu_check, "tree_digest", lambda: "other files")
    assert gpu_check.main([*args, "tests/test_b.py"]) == 0
    assert rows() == [("test_b::t", True)]  # rows of other files are not this code's


def test_gpu_check_without_a_gpu_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path), "--record", str(tmp_path / "r.json")]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err


def test_gpu_check_names_the_commit_whose_files_ran(tmp_path: Path) -> None:
    """A record written from a copy of the files without their history gets the commit whose run files hash so."""
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
    ran = gpu_check.tree_digest(repo)
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


def test_fit_on_synthetic_batches_through_the_command_line(tmp_path: Path) -> None:
    from benchmarks.fit_synthetic import SyntheticDataModule
    from lit_imagenet.cli import main

    cli = main(["fit", "--trainer.accelerator", "cpu", "--model.arch", "resnet18", "--data.batch_size", "4",
                "--data.crop_size", "32", "--data.num_classes", "3", "--data.train_steps", "3", "--data.val_steps", "1",
                "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
                "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path)],
               datamodule_class=SyntheticDataModule)  # fmt: skip
    assert cli.trainer.global_step == 3
    assert cli.model.hparams.num_classes == 3 and cli.model.hparams.class_names == ["class_0", "class_1", "class_2"]
