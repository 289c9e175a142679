"""The check of a GPU machine: the GPU tests, a short real ``fit`` per decoder on 1 and all GPUs, throughput.

``make gpu-check`` runs it. Two parts, which can run apart (``--part tests`` and ``--part bench``, e.g. where
one command may run for a limited time); each part's result is kept in the record with the commit it ran at and
the machines it ran on. A part can also run in shares (``--pytest-args`` for the tests, ``--decoders`` for the bench):
the rows of the same code's earlier shares are kept beside the new ones. Shares may run at once, each with its own
``--out``: a share reads the record when it ends, under a lock, and replaces it whole.

* ``tests``: ``pytest -m gpu`` (the single-GPU tests and, with 2 or more GPUs, the multi-GPU ones, which run
  the real ``train.py`` under DDP), one row per test, a failed one with its message; a test still running after
  ``--test-timeout`` seconds fails, and the others run.
* ``bench``: ``benchmarks/throughput.py`` for ResNet-50 on generated 500x375 JPEGs, in the recipe's mode of the
  network (on one GPU compiled in the background, each ``fit`` row timed over its first epoch after the switch;
  on several compiled from the first step): the model alone, ``fit`` on synthetic batches, and the recipe's ``fit``
  with each decoder (``pil``, ``torchvision``, ``nvjpeg``, and ``dali`` when NVIDIA DALI imports), each on 1 GPU
  and on every visible GPU. A row passes when its run finished its epochs. Each ``fit`` row keeps the step
  timeline of that epoch (``benchmarks/step_timeline.py``): what held it, the GPU, the host or the loader.

It prints one summary (pass/fail and images/s per row) and writes ``benchmarks/results/gpu-check.json``
(the commit, the machine, the versions and every row). The exit status is 1 when a row failed. Where the checkout
ran without its git history, ``--name-commit`` (run in the repository) names each part's commit by its files.

    python benchmarks/gpu_check.py                 # both parts
    python benchmarks/gpu_check.py --part tests
    python benchmarks/gpu_check.py --part bench --decoders pil nvjpeg
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import hashlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RECORD = REPO / "benchmarks" / "results" / "gpu-check.json"


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


RUN_FOLDERS = ("lit_imagenet", "tests", "configs", "benchmarks")
RUN_SUFFIXES = (".py", ".yaml", ".sh", ".cfg")


def _makes_a_run(path: str) -> bool:
    parts = path.split("/")
    if path in ("train.py", "setup.cfg"):
        return True
    return parts[0] in RUN_FOLDERS and "__pycache__" not in parts and Path(path).suffix in RUN_SUFFIXES


def _digest(files: dict[str, bytes]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    return digest.hexdigest()


def tree_digest(root: Path = REPO) -> str:
    """SHA-256 of the files that make a run (package, tests, configs, benchmarks, train.py): it names the code that
    ran also where the checkout arrived as files without its git history."""
    candidates = [root / "train.py", root / "setup.cfg"] + [f for d in RUN_FOLDERS for f in (root / d).rglob("*")]
    found = [f for f in candidates if f.is_file() and _makes_a_run(f.relative_to(root).as_posix())]
    return _digest({f.relative_to(root).as_posix(): f.read_bytes() for f in found})


def commit_digest(commit: str, root: Path = REPO) -> str:
    """:func:`tree_digest` of a commit's files, read from git."""
    names = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit], cwd=root, capture_output=True,
                           text=True, check=True).stdout.split("\n")  # fmt: skip
    files = {}
    for name in filter(_makes_a_run, names):
        show = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=root, capture_output=True, check=True)
        files[name] = show.stdout
    return _digest(files)


def name_commits(record: dict[str, Any], root: Path = REPO, depth: int = 50) -> list[str]:
    """Name the commit of each part of ``record`` by its ``tree_sha256``: the most recent of the last ``depth``
    commits whose files hash the same. Returns one line per part saying what was found."""
    listing = subprocess.run(["git", "rev-list", f"--max-count={depth}", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
    digests: dict[str, str] = {}
    lines = []
    for part, result in record["parts"].items():
        found = next((c for c in listing if digests.setdefault(c, commit_digest(c, root)) == result["tree_sha256"]),
                     None)  # fmt: skip
        if found is None:
            lines.append(f"{part}: no commit of the last {depth} has the files that ran; its commit is left as "
                         f"{result['commit']}")  # fmt: skip
            continue
        lines.append(f"{part}: {result['commit']} -> {found}")
        result["commit"] = found
        result["commit_source"] = "named by tree_sha256: the files that ran hash as this commit's"
    newest = max(record["parts"].values(), key=lambda r: r["date"])
    record["commit"], record["tree_sha256"] = newest["commit"], newest["tree_sha256"]
    return lines


def _machine() -> dict[str, Any]:
    import pytorch_lightning
    import torchvision

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda,
            "torchvision": torchvision.__version__, "pytorch_lightning": pytorch_lightning.__version__,
            "python": sys.version.split()[0]}  # fmt: skip


#: The most characters of a failed test's message that its row keeps.
_DETAIL_CHARS = 600


#: Seconds a GPU test may run before it fails (the longest ran 137 s on one H200): a test that hangs is a failed row,
#: with the stacks of its threads in the log, and the part goes on.
TEST_TIMEOUT = 300


def run_tests(out: Path, pytest_args: list[str], test_timeout: int = TEST_TIMEOUT) -> list[dict[str, Any]]:
    """``pytest -m gpu``; one row per test, from its JUnit report, a failed one with its message."""
    report = out / "gpu-tests.xml"
    # A test module that cannot be imported on this machine is a failed row; the other tests still run.
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", f"--junitxml={report}",
           "--continue-on-collection-errors", "-o", f"timeout={test_timeout}", *pytest_args]  # fmt: skip
    subprocess.run(cmd, cwd=REPO)
    rows: list[dict[str, Any]] = []
    if not report.is_file():
        return [{"row": "pytest -m gpu", "ok": False, "detail": "no test report was written"}]
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        failure = next((f for f in (case.find("failure"), case.find("error")) if f is not None), None)
        skipped = case.find("skipped")
        row: dict[str, Any] = {"row": name, "ok": failure is None, "seconds": round(float(case.get("time", 0)), 1)}
        if failure is not None:  # why, in the record: the assertion or the error, on one line
            lines = [line.strip() for line in (failure.text or "").splitlines() if line.strip()]
            why = failure.get("message") or (lines[-1] if lines else "")
            row["detail"] = " ".join(why.split())[:_DETAIL_CHARS]
        if skipped is not None:
            row["skipped"] = True
            row["detail"] = f"skipped: {skipped.get('message', '')}"
        rows.append(row)
    if not rows:
        rows.append({"row": "pytest -m gpu", "ok": False, "detail": "no test ran"})
    return rows


def run_bench(out: Path, decoders: list[str], extra: list[str]) -> list[dict[str, Any]]:
    """The ResNet-50 throughput rows on 1 and on all GPUs."""
    devices = sorted({1, max(1, torch.cuda.device_count())})
    cmd = [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--out", str(out / "throughput"),
           "--archs", "resnet50", "--skip", "loop", "--devices", *map(str, devices), "--decoders", *decoders,
           "--row-timeout", "240", "--timeline", *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO)
    path = out / "throughput" / "throughput.json"
    if not path.is_file():
        partial = out / "throughput" / "rows.partial.json"
        found = json.loads(partial.read_text()) if partial.is_file() else []
        rows = [_bench_row(r) for r in found]
        return rows + [{"row": "throughput.py", "ok": False, "detail": f"exit status {done.returncode}"}]
    return [_bench_row(r) for r in json.loads(path.read_text())["rows"]]


def _bench_row(r: dict[str, Any]) -> dict[str, Any]:
    rate = r.get("images_per_sec")
    return {"row": f"{r['setting']} {r['arch']} x{r['devices']}", "ok": rate is not None and not r.get("timed_out"),
            "compile": r.get("compile"), "images_per_sec": rate, "ratio_to_model_alone": r.get("ratio"),
            "peak_memory_gib": r.get("peak_memory_gib"),
            **({"switch": r["switch"]} if "switch" in r else {}),
            **({"timeline": _timeline_medians(r["timeline"])} if r.get("timeline") else {})}  # fmt: skip


def _timeline_medians(summary: dict[str, Any]) -> dict[str, Any]:
    """The step timeline of a bench row's epoch, in short: its sums in seconds, and each per-step figure's median in
    milliseconds (``benchmarks/step_timeline.py`` names them)."""
    short: dict[str, Any] = {key: round(summary[key], 3) for key in ("steps", "epoch_s", "head_s", "steps_s", "tail_s")}
    for key, value in summary.items():
        if isinstance(value, dict):
            short[key] = {"sum_s": round(value["sum"] / 1000, 3),
                          "median": None if value["median"] is None else round(value["median"], 2)}  # fmt: skip
    return short


def summary(record: dict[str, Any]) -> str:
    lines = [f"GPU check of {record['commit']} on {', '.join(record['machine']['gpus']) or 'no GPU'}"]
    for part, result in record["parts"].items():
        stale = "" if result["commit"] == record["commit"] else f" (at {result['commit']}, not this commit)"
        skipped = f", {result['skipped']} skipped" if result.get("skipped") else ""
        lines.append(f"\n{part}: {result['passed']} passed, {result['failed']} failed{skipped}{stale}")
        for row in result["rows"]:
            rate = f"{row['images_per_sec']:>9,.0f} images/s" if row.get("images_per_sec") else ""
            detail = f"  {row['detail']}" if row.get("detail") else ""
            mark = "skip" if row.get("skipped") else "pass" if row["ok"] else "FAIL"
            lines.append(f"  {mark}  {row['row']:<64} {rate}{detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["tests", "bench", "all"], default="all")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="logs and reports")
    parser.add_argument("--record", type=Path, default=RECORD, help="the JSON record to update")
    parser.add_argument("--decoders", nargs="+", default=None,
                        help="fit rows (default: pil torchvision nvjpeg, and dali when it imports); the rows of "
                        "earlier runs with other decoders at the same code are kept beside this run's")  # fmt: skip
    parser.add_argument("--pytest-args", default="",
                        help="more pytest arguments (tests part), e.g. a test file; the rows of earlier runs with "
                        "other arguments at the same code are kept beside this run's")  # fmt: skip
    parser.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT,
                        help="seconds a GPU test may run before it fails, with its threads' stacks in the log "
                        "(default %(default)s)")  # fmt: skip
    parser.add_argument("--name-commit", action="store_true",
                        help="run nothing: name the commit of each part of the record by the files that ran (for a "
                        "record written where the checkout arrived without its git history), and save it")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more throughput.py arguments, after --")
    args = parser.parse_args(argv)
    if args.name_commit:
        record = json.loads(args.record.read_text())
        print("\n".join(name_commits(record)))
        args.record.write_text(json.dumps(record, indent=2) + "\n")
        return 0
    if not torch.cuda.is_available():
        print("error: no CUDA device is visible; the GPU check runs on a GPU machine.", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    decoders = args.decoders or ["pil", "torchvision", "nvjpeg"] + (
        ["dali"] if importlib.util.find_spec("nvidia.dali") else []
    )
    record = {"commit": _commit(), "tree_sha256": tree_digest(), "machine": _machine(), "parts": {}}
    parts = ["tests", "bench"] if args.part == "all" else [args.part]
    for part in parts:
        if part == "tests":
            rows = run_tests(args.out, shlex.split(args.pytest_args), args.test_timeout)
        else:
            rows = run_bench(args.out, decoders, args.extra)
        with _locked(args.record):
            # Read now, not when this share started: a share run beside it may have saved its rows meanwhile.
            record["parts"] = json.loads(args.record.read_text())["parts"] if args.record.is_file() else {}
            _add_share(record, part, rows, args)
            _save(args.record, record)
    print("\n" + summary(record))
    print(f"\nRecord: {args.record}")
    return int(any(record["parts"][p]["failed"] for p in parts))


@contextlib.contextmanager
def _locked(record: Path) -> Any:
    """Holds an exclusive lock on the record's folder, which shares run at once take in turn to update it."""
    record.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(record.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


def _save(path: Path, record: dict[str, Any]) -> None:
    """Writes the record whole: a reader finds the old one or the new one, never part of one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, path)


def _add_share(record: dict[str, Any], part: str, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Puts a part's rows in the record, beside the rows of the same code's other shares of it."""
    earlier = record["parts"].get(part, {})
    # A share of a part: the tests of some pytest arguments, or the bench of some decoders (e.g. where one
    # command may only run so long). The rows of the same code's other shares are kept beside this one's.
    key, share = ("pytest_args", args.pytest_args) if part == "tests" else ("decoders", args.decoders)
    runs = [share] if share else []
    machines = [record["machine"]]
    if runs and earlier.get("tree_sha256") == record["tree_sha256"] and earlier.get(key):
        names = {r["row"] for r in rows}
        rows = [r for r in earlier["rows"] if r["row"] not in names] + rows
        kept = earlier[key]
        runs = ([kept] if isinstance(kept, str) else list(kept)) + runs
        machines = [m for m in earlier.get("machines", []) if m != record["machine"]] + machines
    failed = sum(not r["ok"] for r in rows)
    skipped = sum(bool(r.get("skipped")) for r in rows)
    now = datetime.datetime.now().isoformat(timespec="seconds")
    record["parts"][part] = {"commit": record["commit"], "tree_sha256": record["tree_sha256"], "date": now,
                             "passed": len(rows) - failed - skipped, "failed": failed,
                             "skipped": skipped, "machines": machines, "rows": rows}  # fmt: skip
    if runs:
        record["parts"][part][key] = runs


if __name__ == "__main__":
    sys.exit(main())
