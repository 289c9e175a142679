"""ImageNet's file count without ImageNet: time to step N, steady images/s and peak host memory of whole runs.

It builds (once) an ImageFolder of hard links to a few hundred generated 500x375 JPEGs, with ImageNet's
1,281,167 training and 50,000 validation files in 1,000 class folders, so that the folder scan, the index and
host memory see ImageNet's size while decoding costs what the generated images cost. Then it runs each
``--rows`` entry as a process group of its own and records, from the lines the run prints:

* ``seconds_to_step``: from launch to the console line of step ``--steps``, when the run is ended;
* ``images_per_sec``: between the lines of step ``--steady-from`` and step ``--steps``;
* ``peak_pss_gib``: the largest sum of PSS over the run's process tree, sampled every half second;
* ``compile_s``: the compile time the run printed, if it printed one.

A row is ``LABEL=CHECKOUT:START``: ``CHECKOUT`` is a folder holding ``train.py`` (this repository, or an older
commit's files), run with ``configs/resnet50.yaml`` as shipped; ``START`` is ``cold`` (the row's home, temporary
folder and run folder are emptied first: no index, no compiler caches) or ``restart`` (they are kept from the last
row of that label). ``reference`` as ``CHECKOUT`` runs ``--reference`` (the upstream ``main_amp.py``) instead.

    python benchmarks/imagenet_scale.py --out /tmp/scale --rows new=.:cold new=.:restart \\
        old=/tmp/old:cold old=/tmp/old:restart ref=reference:cold --reference main_amp_upstream.py
    python benchmarks/imagenet_scale.py --out /tmp/scale --smoke   # CPU, a tiny tree, about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OURS = re.compile(r"\bstep (\d+)\b")
REFERENCE = re.compile(r"^Epoch: \[\d+\]\[(\d+)/\d+\]")
COMPILED = re.compile(r"[Cc]ompiled .*?([\d.]+) s")


def build_tree(root: Path, train: int, val: int, classes: int, sources: int) -> Path:
    """Hard links to ``sources`` generated JPEGs: ``train`` and ``val`` files spread over ``classes`` folders."""
    done = root / "complete.json"
    wanted = {"train": train, "val": val, "classes": classes, "sources": sources}
    if done.is_file() and json.loads(done.read_text()) == wanted:
        return root / "tree"
    shutil.rmtree(root, ignore_errors=True)
    sys.path.insert(0, str(REPO))
    from lit_imagenet.data.synthetic import make_shapes

    per_class = -(-sources // 6)
    shapes = make_shapes(str(root / "shapes"), train_per_class=per_class, val_per_class=1, width=500, height=375,
                         processes=os.cpu_count() or 1)  # fmt: skip
    files = sorted((shapes / "train").rglob("*.jpg"))[:sources]
    k = 0
    for split, count in (("train", train), ("val", val)):
        for c in range(classes):
            folder = root / "tree" / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for j in range(count // classes + (c < count % classes)):
                os.link(files[k % len(files)], folder / f"{split}_{c}_{j}.JPEG")
                k += 1
    done.write_text(json.dumps(wanted))
    return root / "tree"


def tree_pss_kib(root_pid: int) -> int:
    """The PSS of ``root_pid`` and every process below it, in KiB."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [root_pid]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def run_row(label: str, cmd: list[str], cwd: Path, env: dict[str, str], pattern: re.Pattern[str], args: Any) -> dict:
    """Runs ``cmd`` until its line of step ``args.steps``; returns the row's figures and its printed lines."""
    began = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            peak[0] = max(peak[0], tree_pss_kib(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seen: dict[int, float] = {}
    lines: list[str] = []
    compile_s = None
    deadline = began + args.timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic() - began
        lines.append(f"{now:8.2f} {line.rstrip()}")
        match = pattern.search(line)
        if match:
            seen.setdefault(int(match.group(1)), now)
        compiled = COMPILED.search(line) if compile_s is None and pattern is OURS else None
        if compiled:
            compile_s = float(compiled.group(1))
        if (seen and max(seen) >= args.steps) or time.monotonic() > deadline:
            break
    stop.set()
    sampler.join()
    with_pg = os.getpgid(proc.pid) if proc.poll() is None else None
    if with_pg is not None:
        os.killpg(with_pg, signal.SIGKILL)
    proc.wait()

    def at(step: int) -> float | None:
        return next((t for s, t in sorted(seen.items()) if s >= step), None)

    start, end = at(args.steady_from), at(args.steps)
    steps = min((s for s in seen if s >= args.steps), default=None)
    first = min((s for s in seen if s >= args.steady_from), default=None)
    rate = None
    if start is not None and end is not None and end > start and steps is not None and first is not None:
        rate = round((steps - first) * args.batch / (end - start), 1)
    return {
        "row": label,
        "reached_step": max(seen, default=None),
        "seconds_to_step": None if end is None else round(end, 2),
        "images_per_sec": rate,
        "peak_pss_gib": round(peak[0] / 2**20, 3),
        "compile_s": compile_s,
        "lines": lines[-60:] if end is None else [x for x in lines if not pattern.search(x.split(" ", 1)[-1])][:60],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", nargs="+", default=["new=.:cold", "new=.:restart"])
    parser.add_argument("--reference", type=Path, help="the upstream main_amp.py, for rows whose checkout is reference")
    parser.add_argument("--tree", type=Path, help="where the tree is built (default: OUT/tree)")
    parser.add_argument("--train", type=int, default=1_281_167)
    parser.add_argument("--val", type=int, default=50_000)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--sources", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--steady-from", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--smoke", action="store_true", help="a tiny tree and a few CPU steps")
    parser.add_argument("fit_args", nargs="*", help="more arguments for train.py fit (after --)")
    args = parser.parse_args()
    if args.smoke:
        args.train, args.val, args.classes, args.sources, args.batch, args.steps, args.steady_from = (
            480, 60, 6, 64, 8, 20, 10)  # fmt: skip
        args.fit_args += ["--trainer.accelerator", "cpu", "--data.batch_size", "8", "--data.workers", "1",
                          "--data.crop_size", "32", "--data.val_resize", "40", "--model.arch", "resnet18"]  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    tree = build_tree(args.tree or args.out / "tree", args.train, args.val, args.classes, args.sources)
    print(f"tree: {args.train:,} + {args.val:,} files in {args.classes} folders ({time.monotonic() - began:.1f} s)")
    report_path = args.out / "imagenet-scale.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {"rows": []}
    report.update(steps=args.steps, steady_from=args.steady_from, batch=args.batch, workers=args.workers)
    for spec in args.rows:
        label, _, rest = spec.partition("=")
        checkout, _, start = rest.rpartition(":")
        state = args.out / "state" / label
        if start == "cold":
            shutil.rmtree(state, ignore_errors=True)
        for sub in ("home", "tmp", "runs"):
            (state / sub).mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LIT_IMAGENET", "TORCHINDUCTOR", "TRITON"))}
        env.update(HOME=str(state / "home"), TMPDIR=str(state / "tmp"), PYTHONUNBUFFERED="1")
        if checkout == "reference":
            cmd = [sys.executable, str(args.reference.resolve()), str(tree), "-a", "resnet50", "-b", str(args.batch),
                   "--workers", str(args.workers), "--channels-last", "True"]  # fmt: skip
            cwd, pattern = state / "runs", REFERENCE
        else:
            cwd, pattern = Path(checkout).resolve(), OURS
            cmd = [sys.executable, "train.py", "fit", "--config", "configs/resnet50.yaml", "--data.root", str(tree),
                   "--data.workers", str(args.workers), "--trainer.max_steps", str(args.steps + 10),
                   "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(state / "runs"),
                   *args.fit_args]  # fmt: skip
        row = {**run_row(spec, cmd, cwd, env, pattern, args), "start": start}
        report["rows"].append(row)
        report_path.write_text(json.dumps(report, indent=1))
        shown = {k: v for k, v in row.items() if k != "lines"}
        print(json.dumps(shown), flush=True)
    print(f"{'row':28s} {'to step':>8s} {'images/s':>9s} {'PSS GiB':>8s} {'compile s':>9s}")
    for row in report["rows"]:
        print(f"{row['row']:28s} {row['seconds_to_step'] or float('nan'):8.1f} {row['images_per_sec'] or 0:9.0f} "
              f"{row['peak_pss_gib']:8.2f} {row['compile_s'] or 0:9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
