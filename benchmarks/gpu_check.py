"""The check of a GPU machine: the GPU tests, then a short ``fit`` per decoder and the model alone.

``make gpu-check`` runs the first two parts, which can also run apart (``--part tests``, ``--part bench``):

* ``tests``: ``pytest -m gpu``, one row per test, a failed one with its message; a test still running after
  ``--test-timeout`` seconds fails, and the others run. With ``--pytest-args`` (some of the tests, for a machine
  lent for less time than the whole part takes) the rows that ran replace theirs in a part recorded of the same
  files, and the part's other rows stay.
* ``bench``: ``benchmarks/throughput.py`` for ResNet-50 on generated 500x375 JPEGs, as ``configs/resnet50.yaml``
  trains it: the model alone, ``fit`` on synthetic batches and ``fit`` with each decoder (``pil``, ``torchvision``,
  ``nvjpeg``, and ``dali`` when NVIDIA DALI imports), on 1 GPU and on every visible GPU. A row passes when its run
  finished its epochs.

``--part accuracy`` (not in ``all``) trains ResNet-18 with ``configs/resnet50.yaml`` and with
``configs/resnet50_tv2.yaml`` on scikit-learn's handwritten digits (1,797 real 8x8 scans, upscaled to 72x72, every
fifth one held out), same epochs and seed, and reports each recipe's best validation top-1 (and its EMA's).

It prints a summary and writes ``benchmarks/results/gpu-check.json``: per part, the commit, a digest of the files
that make a run, the machine, the versions and every row. The exit status is 1 when a row failed. Where the files
ran without their git history, ``--name-commit`` (run in the repository) names each part's commit by that digest.

    python benchmarks/gpu_check.py                 # both parts, 12 minutes or more on one H100
    python benchmarks/gpu_check.py --part bench --decoders pil nvjpeg
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
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


#: Seconds a GPU test may run before it fails: a test that hangs is a failed row,
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
    """``benchmarks/throughput.py`` for ResNet-50 on 1 and on all GPUs: one row per setting."""
    devices = sorted({1, max(1, torch.cuda.device_count())})
    cmd = [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--out", str(out / "throughput"),
           "--devices", *map(str, devices), "--decoders", *decoders, "--row-timeout", "240", *extra]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO)
    path = out / "throughput" / "throughput.json"
    if not path.is_file():
        return [{"row": "throughput.py", "ok": False, "detail": f"exit status {done.returncode}"}]
    rows = []
    for r in json.loads(path.read_text())["rows"]:
        rate = r.get("images_per_sec")
        row = {"row": f"{r['setting']} {r['arch']} x{r['devices']}", "ok": rate is not None, "images_per_sec": rate}
        keys = ("steady_images_per_sec", "ratio", "peak_memory_gib", "compile_seconds")
        row.update({key: r.get(key) for key in keys})
        if r.get("error"):
            row["detail"] = r["error"]
        rows.append(row)
    return rows


#: Per recipe of the accuracy part: its config and its sizes scaled to the 72x72 digits (224 -> 64). The EMA's decay
#: of torchvision's recipe is set for 600 epochs of ImageNet: on a run of 1,400 steps its average would hardly move
#: from the weights at the end of the warmup, so this run's is 0.999 (adjusted as the recipe's).
ACCURACY_RECIPES = {
    "resnet50.yaml": "--data.crop_size 64 --data.val_resize 72".split(),
    "resnet50_tv2.yaml": (
        "--data.train_crop_size 50 --data.val_resize 66 --data.crop_size 64 --model.ema_decay 0.999".split()
    ),
}


def digits_folder(root: Path) -> Path:
    """scikit-learn's digits as an ImageFolder under ``root``: 72x72 RGB PNGs, every fifth image in ``val/``
    (a ``root`` that has ``train/`` already is taken as made: made elsewhere for a machine without scikit-learn)."""
    from PIL import Image

    if (root / "train").is_dir():
        return root
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("error: the accuracy part needs scikit-learn's digits: pip install scikit-learn") from None
    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        folder = root / ("val" if i % 5 == 4 else "train") / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        gray = Image.fromarray((image * (255 / 16)).round().astype("uint8")).resize((72, 72), Image.BILINEAR)
        gray.convert("RGB").save(folder / f"{i:04d}.png")
    return root


def run_accuracy(out: Path, epochs: int, extra: list[str]) -> list[dict[str, Any]]:
    """Each recipe of ``ACCURACY_RECIPES`` on the digits, ResNet-18, ``epochs`` epochs, seed 0: a row each with
    its best validation top-1 (``val/top1``, and ``val_ema/top1`` where the recipe keeps an EMA)."""
    import csv

    data = digits_folder(out / "digits")
    rows = []
    for config, sizes in ACCURACY_RECIPES.items():
        run = out / "accuracy" / Path(config).stem
        cmd = [sys.executable, str(REPO / "train.py"), "fit", "--config", str(REPO / "configs" / config),
               "--trainer.default_root_dir", str(run), "--trainer.max_epochs", str(epochs), "--seed_everything", "0",
               "--model.arch", "resnet18", "--data.root", str(data), "--data.batch_size", "64", "--data.workers", "8",
               "--data.decoder", "pil", "--model.compile", "false", *sizes, *extra]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO)
        metrics = run / "metrics.csv"
        row: dict[str, Any] = {"row": f"{config} resnet18 digits {epochs} epochs", "ok": done.returncode == 0}
        if metrics.is_file():
            with metrics.open() as f:
                table = list(csv.DictReader(f))
            for key in ("val/top1", "val_ema/top1"):
                values = [float(r[key]) for r in table if r.get(key)]
                if values:
                    row[key] = round(max(values), 4)
        if not row["ok"] or "val/top1" not in row:
            row.update(ok=False, detail=f"exit status {done.returncode}")
        rows.append(row)
    return rows


def summary(record: dict[str, Any]) -> str:
    lines = [f"GPU check of {record['commit']} on {', '.join(record['machine']['gpus']) or 'no GPU'}"]
    for part, result in record["parts"].items():
        stale = "" if result["commit"] == record["commit"] else f" (at {result['commit']}, not this commit)"
        skipped = f", {result['skipped']} skipped" if result.get("skipped") else ""
        lines.append(f"\n{part}: {result['passed']} passed, {result['failed']} failed{skipped}{stale}")
        for row in result["rows"]:
            rate = f"{row['images_per_sec']:>9,.0f} images/s" if row.get("images_per_sec") else ""
            rate += "  ".join(f"{k} {row[k]:.4f}" for k in ("val/top1", "val_ema/top1") if k in row)
            detail = f"  {row['detail']}" if row.get("detail") else ""
            mark = "skip" if row.get("skipped") else "pass" if row["ok"] else "FAIL"
            lines.append(f"  {mark}  {row['row']:<64} {rate}{detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["tests", "bench", "all", "accuracy"], default="all")
    parser.add_argument("--epochs", type=int, default=60, help="epochs of each recipe (accuracy part)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="logs and reports")
    parser.add_argument("--record", type=Path, default=RECORD, help="the JSON record to update")
    parser.add_argument("--decoders", nargs="+", default=None,
                        help="fit rows (default: pil torchvision nvjpeg, and dali when it imports)")  # fmt: skip
    parser.add_argument("--pytest-args", default="", help="more pytest arguments (tests part), e.g. a test file")
    parser.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT,
                        help="seconds a GPU test may run before it fails (default %(default)s)")  # fmt: skip
    parser.add_argument("--name-commit", action="store_true",
                        help="run nothing: name the commit of each part of the record by the files that ran, and "
                        "save it")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more throughput.py (accuracy: train.py) arguments, after --")
    args = parser.parse_args(argv)
    record = json.loads(args.record.read_text()) if args.record.is_file() else {"parts": {}}
    if args.name_commit:
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
    record.update(commit=_commit(), tree_sha256=tree_digest(), machine=_machine())
    parts = ["tests", "bench"] if args.part == "all" else [args.part]
    for part in parts:
        if part == "tests":
            rows = run_tests(args.out, shlex.split(args.pytest_args), args.test_timeout)
            earlier = record["parts"].get("tests", {})
            if args.pytest_args and earlier.get("tree_sha256") == record["tree_sha256"]:  # a part of the tests
                ran = {row["row"] for row in rows}
                rows = [row for row in earlier["rows"] if row["row"] not in ran] + rows
        elif part == "bench":
            rows = run_bench(args.out, decoders, args.extra)
        else:
            rows = run_accuracy(args.out, args.epochs, args.extra)
        failed = sum(not r["ok"] for r in rows)
        skipped = sum(bool(r.get("skipped")) for r in rows)
        record["parts"][part] = {"commit": record["commit"], "tree_sha256": record["tree_sha256"],
                                 "date": datetime.datetime.now().isoformat(timespec="seconds"),
                                 "passed": len(rows) - failed - skipped, "failed": failed, "skipped": skipped,
                                 "machine": record["machine"], "rows": rows}  # fmt: skip
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(record, indent=2) + "\n")
    print("\n" + summary(record))
    print(f"\nRecord: {args.record}")
    return int(any(record["parts"][p]["failed"] for p in parts))


if __name__ == "__main__":
    sys.exit(main())
