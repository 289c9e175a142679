"""ImageNet's file count without ImageNet: how soon a run trains, how fast, and how much host memory it holds.

It builds (once, and reuses) an ImageFolder of hard links to generated JPEGs of 500x375
(``lit_imagenet.data.synthetic.make_shapes``): by default ImageNet's 1,281,167 training and 50,000
validation files in 1,000 class folders. Decoding then costs what it costs on the generated images,
while the file system, the folder scan, the index and the host memory see ImageNet's size. Then it
runs, each in a process group of its own:

* the reference script, given with ``--reference PATH`` (NVIDIA apex's ``main_amp.py`` in its form
  that runs without apex), with its ``--workers``, then again to its first logged step (``reference, again``;
  ``--reference-runs`` sets how many runs): it autotunes cuDNN's convolutions (``cudnn.benchmark``), which takes
  seconds longer in its first run on a machine than in the next ones, so the first row may hold a cost that a
  restart on the same machine does not pay;
* ``train.py fit --config configs/resnet50.yaml`` as shipped, once per ``--decoders`` entry, twice:
  a first run with an empty index folder and run folder, then a restart in the same folders, as a
  requeued job: it finds the index, and with ``--model.compile`` the compiler caches. ``--restarts N``
  restarts N times, one row each (``restart``, ``restart 2``, ...): a restart's time varies from one
  to the next.

For each run it reports the seconds from launch to the first logged step (the line of step 10:
both log every 10 steps), images/s between the lines of step ``--steady-from`` (100) and step
``--steps`` (400; the restarts stop at step 10), and the peak PSS of the run's process tree (every process and loader
worker, read from ``/proc/PID/smaps_rollup`` every half second), with its second and its parts at that moment (the
main process, the loader workers, a background compile's child and that child's compile workers, the early scan)
and, for a compiled network, the seconds its first step took, compiling or reading the compiler caches (the line
``train.py`` prints).
The table is printed and written to ``OUT/startup.json``, after rows that time the interpreter's
imports alone (``torch`` and ``torchvision``, what the reference imports; pytorch-lightning,
torchmetrics and jsonargparse, each alone; ``lit_imagenet.cli``, what ``train.py`` imports, also
split by package from ``python -X importtime``): the part of a start that no data path can shorten.
Then each decoder beside the reference (``beside_reference`` in the report): its first runs' seconds as fractions
of the reference's first run, of its next one and, with ``--lean``, of its run with only the requirements
importable; its restarts' seconds; its first run's peak PSS as a fraction of the reference's.
Caches are left warm: the tree was just built or used. With ``--after-switch N`` a run that compiles in the
background (the recipe's ``auto`` on one GPU) goes on until N steps after its switch to the compiled network:
its row then holds the switch (its step and second, the child's seconds, the graphs found in the caches), the
compiled network's images/s, and a peak PSS that covers the compiling child.
The report is written again after each row, with ``"complete": false`` until the last: a call stopped
by its time limit keeps the rows it had.
Each run's record also holds the lines it printed before its first step, each with its second.

With ``--lean`` the imports, the reference (to its first logged step) and two more starts of each decoder (a
restart in the first run's folders, then a first run in empty folders of its own, both to their first logged step) run
again with only the package's requirements importable (``python -S`` over a folder of links to the installed files of
``setup.cfg``'s requirements and theirs): what a virtual environment of its own gives, where the
interpreter's environment holds other packages that an import probes for and loads.

With ``--bytecode`` every process (the reference too) reads and writes Python's compiled bytecode under
``OUT/pycache`` (``PYTHONPYCACHEPREFIX``, writing allowed even where ``PYTHONDONTWRITEBYTECODE`` is set),
filled before the first timed row by one import of what the runs import: what an installation that
compiled its bytecode gives (pip's default), where the interpreter's packages hold none. Its rows are
named with `` (bytecode cached)``.

With ``--warm-gpu`` one process runs a ResNet-50 step on the GPU before the first timed row, so that no timed run is
the machine's first CUDA process, the one that loads the CUDA, cuDNN and cuBLAS libraries first: without it the first
row (the reference's, when given) may hold a cost of the machine's state that the others do not. It does not take away
what the reference's first run pays for autotuning cuDNN's convolutions: 20.6 s to step 10 after it, against 10.8 s in
its second run, on an H200 (record ``9081cd7`` of ``benchmarks/results/startup.json``).

With ``--drop-caches`` the kernel's page cache, dentries and inodes are dropped before each run of the reference and of
this package (``sync``, then ``3`` into ``/proc/sys/vm/drop_caches``, which needs root): each run then starts as on a
node whose memory holds neither the data's folders nor the Python environment, as a job does on a node it has not run
on, or after other jobs have pushed the data out; the reference then walks its 1.33 million folder entries from the
disk. Its rows are named with `` (cold caches)``. A machine where the file cannot be written stops before anything is
made, with one sentence.

With ``--probe`` each run of this package also carries the callback of ``benchmarks/probe.py``: its row then holds
the seconds of the fit's set-up by Lightning's hooks (``probe.setup_s``: the data module set up; ``fit_start_s``:
the network on its device with its optimizer; ``train_start_s``: the logger, checkpoint and loaders ready;
``epoch_start_s``), when each of its first batches came and when its step ended (``probe.batches_s``), and its main
process's PSS after some steps, split by what is mapped, beside the page-locked memory that torch holds for batches
on their way to the GPU (``probe.memory``).

    python benchmarks/startup.py --out runs/startup --reference main_amp.py
    python benchmarks/startup.py --out runs/startup --decoders pil dali --train 128116 --val 5000
    python benchmarks/startup.py --out runs/su2 --no-imports --decoders auto --label compiled -- --model.compile true
    python benchmarks/startup.py --out runs/su3 --bytecode --reference main_amp.py
    python benchmarks/startup.py --out runs/su4 --bytecode --no-imports --probe --decoders pil nvjpeg
    python benchmarks/startup.py --out /tmp/startup --smoke   # CPU, a tiny tree, well under a minute
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

# The lines where a background compile (the recipe's on one GPU) ended and the run switched, and where it did not.
from throughput import NO_SWITCH_LINE, SWITCH_LINE

REPO = Path(__file__).resolve().parents[1]
OURS = re.compile(r"^Epoch \d+ \[\d+/\d+\] step (\d+)")
REFERENCE = re.compile(r"^Epoch: \[\d+\]\[(\d+)/\d+\]")
# The line ours prints once the compiled network's first step ends (--model.compile): the compile's share.
COMPILED = re.compile(r"^Compiled the network and ran its first step in ([\d.]+) s")
_MARKER = ".links.json"


# What the reference imports, what train.py imports, and the libraries between the two.
IMPORTS = (
    ("imports: torch, torchvision", "import torch, torchvision"),
    ("imports: pytorch_lightning", "import pytorch_lightning"),
    ("imports: torchmetrics", "import torchmetrics"),
    ("imports: jsonargparse", "import jsonargparse"),
    ("imports: lit_imagenet.cli", "import lit_imagenet.cli"),
)

# Run once before the rows with --bytecode: the modules every run imports (the reference's too), compiled.
WARM_IMPORTS = (
    "import importlib.util, torch, torch.distributed, torchvision.datasets, torchvision.models, "
    "torchvision.transforms, lit_imagenet.cli\n"
    "if importlib.util.find_spec('nvidia.dali'):\n"
    "    import nvidia.dali, nvidia.dali.plugin.pytorch"
)

# Run once before the rows with --warm-gpu: a ResNet-50 step under autocast, so that the reference's first run is not
# the machine's first to load the CUDA, cuDNN and cuBLAS libraries.
WARM_GPU = (
    "import torch, torchvision\n"
    "model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)\n"
    "x = torch.randn(8, 3, 224, 224, device='cuda').to(memory_format=torch.channels_last)\n"
    "with torch.autocast('cuda', torch.float16):\n"
    "    loss = model(x).float().sum()\n"
    "loss.backward()\n"
    "torch.cuda.synchronize()"
)


def bytecode_environment(env: dict[str, str], folder: Path) -> dict[str, str]:
    """``env`` for a process that keeps its compiled bytecode under ``folder``, writing it where it is missing."""
    cached = {key: value for key, value in env.items() if key != "PYTHONDONTWRITEBYTECODE"}
    cached["PYTHONPYCACHEPREFIX"] = str(folder)
    return cached


def import_seconds_by_package(importtime: str, top: int = 15) -> dict[str, float]:
    """The seconds each top-level package's own modules took to import, from ``python -X importtime``'s report.

    Each module's own time (without the modules it imported) is added to its top-level package, so that
    the figures add up to the whole import; the ``top`` largest are kept, the rest summed as ``other``.
    """
    totals: dict[str, float] = {}
    for line in importtime.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if match:
            package = match.group(2).split(".")[0]
            totals[package] = totals.get(package, 0.0) + int(match.group(1)) / 1e6
    ranked = sorted(totals.items(), key=lambda item: -item[1])
    kept = {name: round(seconds, 3) for name, seconds in ranked[:top]}
    if len(ranked) > top:
        kept["other"] = round(sum(seconds for _, seconds in ranked[top:]), 3)
    return kept


def build_tree(out: Path, sources: list[Path], train: int, val: int, classes: int) -> Path:
    """An ImageFolder of ``train`` and ``val`` hard links to ``sources`` in ``classes`` folders (reused when made so).

    A file system allows a file some tens of thousands of links (ext4: about 65,000), so each source
    file is linked at most ``ceil((train + val) / len(sources))`` times.
    """
    settings = {"train": train, "val": val, "classes": classes, "sources": [str(s) for s in sources]}
    marker = out / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        return out
    if (train + val) / len(sources) > 60_000:
        raise SystemExit(f"{train + val} links to {len(sources)} files is over 60,000 a file; use more --sources")
    k = 0
    for split, count in (("train", train), ("val", val)):
        per, extra = divmod(count, classes)
        for c in range(classes):
            folder = out / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per + (c < extra)):
                link = folder / f"n{c:08d}_{i}.JPEG"
                if not link.exists():
                    os.link(sources[k % len(sources)], link)
                k += 1
    marker.write_text(json.dumps(settings))
    return out


def _children(pid: int) -> dict[int, list[int]]:
    """Every process's children, from ``/proc``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    return children


def _descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    children = _children(pid) if children is None else children
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def _pss_kib(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    match = re.search(r"^Pss:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


#: The part of a run a process of its tree plays, from its command line (``/proc/PID/cmdline``).
COMPILE_CHILD = "background_compile.py"
#: The module of the scan that train.py starts at launch (python -m lit_imagenet.data.prescan).
EARLY_SCAN = "lit_imagenet.data.prescan"


def tree_pss_by_part(pid: int) -> dict[str, float]:
    """The PSS of ``pid``'s process tree in GiB, by part: ``main`` (``pid``), ``loader workers`` (the processes below
    it, DataLoader workers and the reference's), ``compile child`` (a background compile's process, which runs
    ``background_compile.py``), ``compile workers`` (the processes below that child: inductor's compile pool) and
    ``early scan`` (the scan that ``train.py`` starts at launch, ``lit_imagenet.data.prescan``, with its pool)."""
    children = _children(pid)
    parts = {"main": _pss_kib(pid), "loader workers": 0, "compile child": 0, "compile workers": 0, "early scan": 0}
    for child in children.get(pid, []):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        below = _descendants(child, children)
        if any(arg.endswith(COMPILE_CHILD.encode()) for arg in command.split(b"\0")):
            parts["compile child"] += _pss_kib(child)
            parts["compile workers"] += sum(_pss_kib(p) for p in below[1:])
        elif EARLY_SCAN.encode() in command.split(b"\0"):
            parts["early scan"] += sum(_pss_kib(p) for p in below)
        else:
            parts["loader workers"] += sum(_pss_kib(p) for p in below)
    return {part: kib / 2**20 for part, kib in parts.items()}


def tree_pss_gib(pid: int) -> float:
    """The PSS of ``pid`` and every process below it, in GiB (``/proc/PID/smaps_rollup``)."""
    return sum(_pss_kib(p) for p in _descendants(pid)) / 2**20


def requirement_closure(names: list[str]) -> list[Any]:
    """The installed distributions of ``names`` and of everything they require (with the extras named)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found: dict[str, Any] = {}
    todo = [Requirement(name) for name in names]
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in found:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # not installed here: a run that needs it fails, and says so
        found[key] = dist
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ["", *req.extras]):
                todo.append(sub)
    return list(found.values())


def _link_into(target: Path, source: Path) -> None:
    """Links ``source`` into the folder ``target``, merging folders that two distributions share (``nvidia/``)."""
    place = target / source.name
    if not place.exists() and not place.is_symlink():
        place.symlink_to(source)
        return
    if place.is_symlink() and place.resolve() == source.resolve():
        return
    if place.is_symlink() and place.is_dir() and source.is_dir():
        first = place.resolve()
        place.unlink()
        place.mkdir()
        for child in first.iterdir():
            _link_into(place, child)
    if place.is_dir() and not place.is_symlink() and source.is_dir():
        for child in source.iterdir():
            _link_into(place, child)


def lean_site(folder: Path, requirements: list[str]) -> Path:
    """A folder of links to the installed files of ``requirements`` and their dependencies, and nothing else.

    ``python -S`` with ``PYTHONPATH`` set to it sees what a virtual environment holding only the
    package's requirements holds (no other package that an import might probe for and load).
    """
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for dist in requirement_closure(requirements):
        root = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in sorted(tops):
            if (root / top).exists() and top != "__pycache__":
                _link_into(folder, root / top)
    return folder


def install_requires() -> list[str]:
    """The package's requirements, from ``setup.cfg``: names with their extras, without versions or markers."""
    import configparser

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options"]["install_requires"].strip().splitlines()
    return [re.split(r"[<>=!~; ]", line.strip(), maxsplit=1)[0] for line in lines if line.strip()]


def slug(name: str) -> str:
    """``name`` as a file name: each run of characters but letters, digits, ``_``, ``.`` and ``-`` as one ``-``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name)


def probe_summary(text: str, launched: float) -> dict[str, Any]:
    """The events of ``benchmarks/probe.py`` in seconds from the run's launch (``launched``, the wall clock):
    the fit's set-up by Lightning's hooks (``setup_s``, ``fit_start_s``, ``train_start_s``, ``epoch_start_s``, the
    first epoch's), the start and end of each of the first batches (``[batch, start, end]``), and the main
    process's memory after its steps (GiB; ``pinned_gib``: the caching host allocator's counts, on CUDA). A line cut
    short by the run's end is left out."""
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue

    def second(event: dict[str, Any]) -> float:
        return round(event["t"] - launched, 3)

    out: dict[str, Any] = {}
    for event in ("setup", "fit_start", "train_start", "epoch_start"):
        first = next((e for e in events if e["event"] == event), None)
        if first is not None:
            out[f"{event}_s"] = second(first)
    starts = {e["batch"]: second(e) for e in events if e["event"] == "batch_start"}
    ends = {e["batch"]: second(e) for e in events if e["event"] == "batch_end"}
    out["batches_s"] = [[batch, starts[batch], ends.get(batch)] for batch in sorted(starts)]
    out["memory"] = [
        {"step": e["step"], "second": second(e), "main_pss_gib": e["main_pss_gib"],
         "pinned_gib": {key: round(value / 2**30, 3) for key, value in e["pinned"].items()}}
        for e in events if e["event"] == "memory"
    ]  # fmt: skip
    return out


#: Where the kernel takes the order to drop its clean caches (``--drop-caches``).
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_caches() -> None:
    """Writes dirty pages out, then drops the page cache, dentries and inodes, so that the next run reads from disk."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError as err:
        raise SystemExit(f"--drop-caches: {DROP_CACHES} cannot be written ({err.strerror or err}); run the benchmark "
                         "as root, or leave --drop-caches out.") from None  # fmt: skip


def run(name: str, cmd: list[str], out: Path, steps: int, pattern: re.Pattern[str], images: int, timeout: float,
        env: dict[str, str], steady_from: int = 100, after_switch: int = 0,
        probe: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Runs ``cmd`` until its line of step ``steps`` (or its end, or ``timeout``): the first step's time, the
    throughput from step ``steady_from`` to ``steps``, the peak PSS. With ``after_switch``, a run that compiles in
    the background goes on until that many steps after its switch to the compiled network (the peak PSS then covers
    the compile), and the compiled network's images/s are taken from 20 steps after the switch to the end. With
    ``probe``, the file that ``cmd``'s ``benchmarks/probe.py`` callback writes: its events go into the row."""
    log = out / "logs" / f"{slug(name)}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    launched = time.time()
    began = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env,
                            start_new_session=True)  # fmt: skip
    peak: list[Any] = [0.0, {}, 0.0]  # the peak, its parts, its second
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.5):
            parts = tree_pss_by_part(proc.pid)
            if sum(parts.values()) > peak[0]:
                peak[:] = [sum(parts.values()), parts, time.monotonic() - began]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seen: dict[int, float] = {}
    lines = []
    first_line: int | None = None  # the number of lines up to the first step's
    killer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    killer.start()
    assert proc.stdout is not None
    compiled_step: float | None = None
    switch: dict[str, Any] | None = None
    waiting, target = after_switch > 0, steps  # for a switch, and the step to stop at
    reached = False
    for line in proc.stdout:
        now = time.monotonic() - began
        lines.append(f"{now:8.2f} {line}")
        compiled = COMPILED.search(line)
        if compiled:
            compiled_step = float(compiled.group(1))
        switched = SWITCH_LINE.match(line)
        if switched:
            child, step, first, found, graphs = switched.groups()
            compiled_step = float(first)
            switch = {"step": int(step), "seconds": round(now, 2), "child_seconds": float(child),
                      "graphs_found": int(found), "graphs": int(graphs)}  # fmt: skip
            target = max(steps, int(step) + after_switch) if waiting else target
        elif NO_SWITCH_LINE.match(line):
            switch, waiting = {"stays": line.strip()}, False
        match = pattern.search(line)
        if match:
            # Ours: the global step, which goes on across epochs; the reference's: the batch of its first
            # epoch (5,005 batches of 256 at ImageNet's size).
            step = int(match.group(1))
            seen[step] = now
            first_line = len(lines) if first_line is None else first_line
            if step >= target and (switch is not None or not waiting):
                reached = True
                break
    killer.cancel()
    timed_out = proc.poll() is None and not reached
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done.set()
    sampler.join()
    log.write_text(" ".join(cmd) + "\n" + "".join(lines))
    first = min(seen) if seen else None
    row: dict[str, Any] = {
        "run": name,
        "first_step": first,
        "seconds_to_first_step": seen.get(first) if first is not None else None,
        "last_step": max(seen) if seen else None,  # the span the peak PSS covers
        "peak_pss_gib": round(peak[0], 2),
        # The peak's parts (main process, loader workers, a background compile's child and its compile workers).
        "peak_pss_parts_gib": {part: round(gib, 2) for part, gib in peak[1].items()},
        "peak_pss_second": round(peak[2], 1),
        "first_compiled_step_seconds": compiled_step,  # None for an eager run
        "log": str(log),
        "timed_out": timed_out,
        # Where the start goes: each line printed up to the first step, with its second.
        "lines_before_first_step": [line[:160].rstrip() for line in lines[: first_line or 60]],
    }
    if steady_from in seen and steps in seen and steps > steady_from:
        row["images_per_sec"] = round((steps - steady_from) * images / (seen[steps] - seen[steady_from]))
    if probe is not None and probe.is_file():
        row["probe"] = probe_summary(probe.read_text(), launched)
    if switch is not None:
        row["switch"] = switch
        after = sorted(step for step in seen if "step" in switch and step >= switch["step"] + 20)
        if len(after) > 1 and after[-1] - after[0] >= 100:
            row["compiled_images_per_sec"] = round((after[-1] - after[0]) * images / (seen[after[-1]] - seen[after[0]]))
    return row


def beside_reference(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each decoder's starts beside the reference's, from rows tagged with ``of``, ``start`` and
    ``requirements_only``: the seconds to the first logged step as a fraction of the reference's first run
    (on a fresh machine, the one that autotunes cuDNN for longest) and of its next run, with only the requirements
    importable beside the reference's run of that kind, the restarts' seconds, and the peak PSS as a fraction of the
    reference's first run (``peak_pss_same_span``: whether both stopped at the same step). An entry is left out
    where a row it needs is missing or never reached its first step."""

    def seconds(row: dict[str, Any] | None) -> float | None:
        return row["seconds_to_first_step"] if row is not None else None

    def find(of: str, start: str, lean: bool) -> dict[str, Any] | None:
        return next((r for r in rows if r.get("of") == of and r.get("start") == start
                     and r.get("requirements_only") == lean), None)  # fmt: skip

    reference, again = find("reference", "first run", False), find("reference", "again", False)
    reference_lean = find("reference", "first run", True)
    out: dict[str, dict[str, Any]] = {}
    for of in dict.fromkeys(r["of"] for r in rows if r.get("of") not in (None, "reference")):
        first, lean_first = find(of, "first run", False), find(of, "first run", True)
        entry: dict[str, Any] = {}
        for key, ours, theirs in (
            ("first_run_over_reference_first_run", first, reference),
            ("first_run_over_reference_again", first, again),
            ("requirements_only_first_run_over_reference", lean_first, reference_lean),
        ):
            if seconds(ours) is not None and seconds(theirs) is not None:
                entry[key] = round(seconds(ours) / seconds(theirs), 2)
        for key, lean in (("restart_seconds", False), ("requirements_only_restart_seconds", True)):
            restarts = [r["seconds_to_first_step"] for r in rows if r.get("of") == of
                        and r.get("start", "").startswith("restart") and r.get("requirements_only") == lean
                        and r["seconds_to_first_step"] is not None]  # fmt: skip
            if restarts:
                entry[key] = [round(t, 1) for t in restarts]
        if first is not None and reference is not None and reference["peak_pss_gib"]:
            entry["peak_pss_over_reference"] = round(first["peak_pss_gib"] / reference["peak_pss_gib"], 2)
            entry["peak_pss_same_span"] = first.get("last_step") == reference.get("last_step")
        out[of] = entry
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny tree and model: checks the script")
    parser.add_argument("--reference", type=Path, default=None, help="the reference script; left out if not given")
    parser.add_argument("--decoders", nargs="*", default=None, help="train.py's --data.decoder values (default auto)")
    parser.add_argument("--tree", type=Path, default=None, help="the hard-link folder (default /tmp/imagenet_links)")
    parser.add_argument("--sources", type=int, default=None, help="generated JPEGs linked to (default 25,602)")
    parser.add_argument("--train", type=int, default=None, help="training files (default 1,281,167)")
    parser.add_argument("--val", type=int, default=None, help="validation files (default 50,000)")
    parser.add_argument("--classes", type=int, default=None, help="class folders (default 1,000)")
    parser.add_argument("--steps", type=int, default=None, help="the step a first run stops at (default 400)")
    parser.add_argument("--steady-from", type=int, default=None, help="throughput from this step on (default 100)")
    parser.add_argument("--restart-steps", type=int, default=None, help="the step a restart stops at (default 10)")
    parser.add_argument("--after-switch", type=int, default=0,
                        help="a run that compiles in the background goes on until this many steps after its switch "
                             "to the compiled network (default 0: it stops at its step)")  # fmt: skip
    parser.add_argument("--restarts", type=int, default=1,
                        help="restarts of each decoder after its first run, one row each (default 1)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=15, help="the reference's --workers (the recipe's 15)")
    parser.add_argument("--reference-runs", type=int, default=2,
                        help="runs of the reference: the first to --steps, the others to their first logged step "
                             "(default 2)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run is stopped")
    parser.add_argument("--label", default="", help="added to the names of this call's runs (e.g. for the extra)")
    parser.add_argument("--no-imports", action="store_true", help="leave out the import rows (a second call)")
    parser.add_argument("--lean", action="store_true",
                        help="also the imports, the reference, a restart and a first run with only the "
                             "requirements importable")  # fmt: skip
    parser.add_argument(
        "--bytecode",
        action="store_true",
        help="every process with a compiled bytecode cache under OUT/pycache, filled first",
    )
    parser.add_argument("--warm-gpu", action="store_true",
                        help="first, a ResNet-50 step on the GPU in a process of its own: no timed run, the "
                             "reference's first included, is the machine's first CUDA process")  # fmt: skip
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the kernel's file caches before each run of the reference and of train.py "
                             "(root only): each starts with neither the data's folders nor the Python environment "
                             "in memory")  # fmt: skip
    parser.add_argument("--probe", action="store_true",
                        help="this package's runs also write their first batches and their main process's memory "
                             "(benchmarks/probe.py) into their rows")  # fmt: skip
    parser.add_argument("extra", nargs="*", help="more train.py arguments, after --")
    args = parser.parse_args(argv)
    if args.restarts < 1:
        parser.error(f"--restarts must be at least 1. Got {args.restarts}")
    if args.reference_runs < 1:
        parser.error(f"--reference-runs must be at least 1. Got {args.reference_runs}")
    full = {"tree": Path("/tmp/imagenet_links"), "sources": 25_602, "train": 1_281_167, "val": 50_000,
            "classes": 1000, "steps": 400, "steady_from": 100, "restart_steps": 10, "decoders": ["auto"]}  # fmt: skip
    smoke = {"tree": args.out / "tree", "sources": 8, "train": 60, "val": 12, "classes": 4, "steps": 3,
             "steady_from": 1, "restart_steps": 1, "decoders": ["pil"]}  # fmt: skip
    for key, value in (smoke if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from lit_imagenet.data.synthetic import make_shapes

    args.out.mkdir(parents=True, exist_ok=True)
    # The GPU's first step, before the data is made: a machine where it fails stops at once, not minutes later.
    warm = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.warm_gpu and subprocess.run([sys.executable, "-c", WARM_GPU], cwd=REPO, env=warm).returncode != 0:
        raise SystemExit("--warm-gpu: the ResNet-50 step on the GPU failed (its error is above); on a machine "
                         "without a CUDA device, leave --warm-gpu out.")  # fmt: skip
    if args.drop_caches:
        drop_caches()  # a machine where it cannot be done stops here, before the data is made
    per_class = -(-args.sources // 6)
    size = (40, 40) if args.smoke else (500, 375)
    sources_root = make_shapes(str(args.tree) + "-sources", train_per_class=per_class, val_per_class=1,
                               width=size[0], height=size[1], num_classes=6, processes=os.cpu_count() or 1)  # fmt: skip
    sources = sorted((sources_root / "train").rglob("*.jpg"))
    began = time.monotonic()
    tree = build_tree(args.tree, sources, args.train, args.val, args.classes)
    print(f"Tree: {tree} ({args.train:,} + {args.val:,} links to {len(sources):,} files), "
          f"{time.monotonic() - began:.0f} s", flush=True)  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    named = " (bytecode cached)" if args.bytecode else ""  # added to every row's name
    named += " (cold caches)" if args.drop_caches else ""

    def run_row(*run_args: Any, **run_kwargs: Any) -> dict[str, Any]:
        """``run``, after the caches are dropped with ``--drop-caches``."""
        if args.drop_caches:
            drop_caches()
        return run(*run_args, **run_kwargs)

    if args.bytecode:
        env = bytecode_environment(env, args.out / "pycache")
    batch = 4 if args.smoke else 256
    if "--data.batch_size" in args.extra[:-1]:  # images/s counts the batches given to train.py
        batch = int(args.extra[args.extra.index("--data.batch_size") + 1])
    common = ["--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false", "--curves.enabled", "false"]
    if args.smoke:
        common += ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--model.arch", "resnet18",
                   "--data.batch_size", str(batch), "--data.crop_size", "16", "--data.val_resize", "16",
                   "--data.workers", "1", "--trainer.log_every_n_steps", "1"]  # fmt: skip
    rows: list[dict[str, Any]] = []
    by_package: dict[str, dict[str, float]] = {}
    tree_info = {"train": args.train, "val": args.val, "classes": args.classes, "sources": len(sources)}

    def write_report(machine: dict[str, Any] | None) -> None:
        """The report so far; complete once the machine's entry, read after the last run, is given."""
        report = {"tree": tree_info, "machine": machine, "rows": rows, "import_seconds_by_package": by_package,
                  "beside_reference": beside_reference(rows), "complete": machine is not None}  # fmt: skip
        (args.out / "startup.json").write_text(json.dumps(report, indent=2) + "\n")

    def add(row: dict[str, Any]) -> None:
        """Keeps a row, prints it, and writes the report so far: a call stopped by its time limit keeps its rows."""
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_report(None)

    # Each interpreter setting the imports and the restarts run under: its row suffix, command, environment.
    pythons: list[tuple[str, list[str], dict[str, str]]] = [("", [sys.executable], env)]
    if args.lean:
        from importlib import metadata

        dali = [d.metadata["Name"] for d in metadata.distributions() if d.metadata["Name"].startswith("nvidia-dali")]
        site = lean_site(args.out / "lean-site", install_requires() + dali)
        pythons.append(
            (" (requirements only)", [sys.executable, "-S"], {**env, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"})
        )
    for _, python, run_env in pythons if args.bytecode else []:
        subprocess.run([*python, "-c", WARM_IMPORTS], cwd=REPO, env=run_env, check=True)
    for suffix, python, run_env in pythons if not args.no_imports else []:
        for what, code in IMPORTS:
            began = time.monotonic()
            subprocess.run([*python, "-c", code], cwd=REPO, env=run_env, check=True)
            add({"run": what + suffix + named, "seconds_to_first_step": None,
                 "seconds": round(time.monotonic() - began, 2)})  # fmt: skip
        timed = subprocess.run([*python, "-X", "importtime", "-c", "import lit_imagenet.cli"], cwd=REPO, env=run_env,
                               check=True, capture_output=True, text=True)  # fmt: skip
        by_package["lit_imagenet.cli" + suffix + named] = import_seconds_by_package(timed.stderr)
    if args.reference is not None:
        cmd = [str(args.reference.resolve()), str(tree), "-a", "resnet50", "-b", str(batch),
               "--workers", str(args.workers), "--channels-last", "True"]  # fmt: skip
        row = run_row("reference" + named, [sys.executable, *cmd], args.out, args.steps, REFERENCE, batch,
                      args.timeout, env, args.steady_from)  # fmt: skip
        add({**row, "of": "reference", "start": "first run", "requirements_only": False})
        for k in range(2, args.reference_runs + 1):
            again = "reference, again" + ("" if k == 2 else f" {k - 1}")
            row = run_row(again + named, [sys.executable, *cmd], args.out, args.restart_steps, REFERENCE, batch,
                          args.timeout, env, args.steady_from)  # fmt: skip
            add({**row, "of": "reference", "start": "again" if k == 2 else f"again {k - 1}",
                 "requirements_only": False})  # fmt: skip
        for suffix, python, run_env in pythons[1:]:  # its first step only: what it imports, under the same interpreter
            row = run_row("reference" + suffix + named, [*python, *cmd], args.out, args.restart_steps, REFERENCE,
                          batch, args.timeout, run_env, args.steady_from)  # fmt: skip
            add({**row, "of": "reference", "start": "first run", "requirements_only": True})
    for decoder in args.decoders:
        tag = f"{decoder} {args.label}".strip()
        folder_name = slug(tag)
        # Every start of a decoder shares one index and run folder, as a requeued job does: a restart finds the
        # index and the compiler caches (--model.compile) that the first run left. A first run with only the
        # requirements importable (--lean) starts from folders of its own, empty.
        # Each start: its kind, the interpreter's row suffix, the step it stops at, the interpreter, its folder.
        attempts = [("first run", "", args.steps, [sys.executable], env, folder_name)]
        attempts += [
            ("restart" if k == 1 else f"restart {k}", "", args.restart_steps, [sys.executable], env, folder_name)
            for k in range(1, args.restarts + 1)
        ]
        for suffix, python, run_env in pythons[1:]:
            attempts.append(("restart", suffix, args.restart_steps, python, run_env, folder_name))
            attempts.append(("first run", suffix, args.restart_steps, python, run_env, f"{folder_name}-lean"))
        for start, suffix, steps, python, run_env, folder in attempts:
            name = f"{tag}, {start}{suffix}{named}"
            index, run_dir = args.out / f"index-{folder}", args.out / "runs" / folder
            cmd = [*python, str(REPO / "train.py"), "fit", "--config", str(REPO / "configs/resnet50.yaml"),
                   "--data.root", str(tree), "--data.decoder", decoder, "--data.index_dir", str(index),
                   "--trainer.default_root_dir", str(run_dir), *common, *args.extra]  # fmt: skip
            if start == "first run":
                subprocess.run(["rm", "-rf", str(index), str(run_dir)], check=True)
            probe = None
            if args.probe:
                probe = args.out / "probes" / f"{slug(name)}.jsonl"
                probe.unlink(missing_ok=True)
                init = {"path": str(probe), **({"memory_steps": [2]} if args.smoke else {})}
                cmd.append("--trainer.callbacks+=" + json.dumps({"class_path": "benchmarks.probe.StartupProbe",
                                                                 "init_args": init}))  # fmt: skip
            switch = args.after_switch if run_env is env else 0  # the lean starts are timed to their first step
            row = run_row(
                name, cmd, args.out, steps, OURS, batch, args.timeout, run_env, args.steady_from, switch, probe=probe
            )
            add({**row, "of": tag, "start": start, "requirements_only": run_env is not env})
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        machine.update(torch=torch.__version__, gpus=[torch.cuda.get_device_name(i)
                                                       for i in range(torch.cuda.device_count())])  # fmt: skip
    except ImportError:
        pass
    write_report(machine)
    print(f"\n{'run':<28} {'first step (s)':>15} {'compiled step (s)':>18} {'images/s':>10} {'peak PSS (GiB)':>15}")
    for row in rows:
        if "seconds" in row:  # an import row: the seconds the interpreter took
            print(f"{row['run']:<28} {row['seconds']:>15.1f}")
            continue
        first = f"{row['seconds_to_first_step']:.1f}" if row["seconds_to_first_step"] is not None else "-"
        rate = f"{row['images_per_sec']:,}" if "images_per_sec" in row else "-"
        compiled = row.get("first_compiled_step_seconds")
        compiled = f"{compiled:.1f}" if compiled is not None else "-"
        print(f"{row['run']:<28} {first:>15} {compiled:>18} {rate:>10} {row['peak_pss_gib']:>15.2f}")
    for row in rows:
        probe = row.get("probe")
        if probe and probe["batches_s"]:
            _, first, end = probe["batches_s"][0]
            ended = f"{end:.2f}" if end is not None else "-"
            hooks = ", ".join(
                f"{hook} {probe[f'{hook}_s']:.2f}"
                for hook in ("setup", "fit_start", "train_start", "epoch_start")
                if f"{hook}_s" in probe
            )
            print(f"{row['run']}: the fit's hooks at {hooks} s; its first batch came at {first:.2f} s and its first "
                  f"step ended at {ended} s")  # fmt: skip
    for what, seconds_by_package in by_package.items():
        print(f"\nimport {what}, seconds by package: "
              + ", ".join(f"{name} {seconds:.2f}" for name, seconds in seconds_by_package.items()))  # fmt: skip
    beside = beside_reference(rows)
    if any(beside.values()):
        print("\nBeside the reference (seconds to the first logged step as a fraction of the reference's):")
        for of, entry in beside.items():
            print(f"  {of}: " + "; ".join(f"{key} {value}" for key, value in entry.items()))
    print(f"\nReport: {args.out / 'startup.json'}")
    return int(any(row["seconds_to_first_step"] is None for row in rows if "seconds" not in row))


if __name__ == "__main__":
    sys.exit(main())
