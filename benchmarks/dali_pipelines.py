"""What a DALI training pipeline costs the process that builds it: seconds, the interpreter, host memory.

In one process (the first CUDA work done, as in a run), on a folder of generated 500x375 JPEGs
(``lit_imagenet.data.synthetic.draw_shape``), with the recipe's pipeline (``lit_imagenet.data.dali.pipeline``:
``mixed`` decoding with the crop, resize, normalise to float16 channels_last; batches of 256 on CUDA):

1. it builds a first pipeline in a thread while the main thread counts in a loop: the build's seconds, and the
   main thread's count as a share of its count alone, which says how much of the build held the interpreter;
2. its first batch, then ``--batches`` (30) more;
3. a second pipeline beside the first, built the same way, and its first batches;
4. the first deleted, then ``nvidia.dali.backend.ReleaseUnusedMemory()``, then glibc's ``malloc_trim``;
5. a third pipeline built while the second lives, and its first batch once the second is deleted.

The second and third pipelines then run ``3 * --batches`` batches more. A build shorter than 0.1 s has no share.

After each step it reads the process's resident memory from ``/proc/self/smaps``, split into anonymous memory,
mappings of ``/dev`` files (on CUDA: the page-locked host memory that DALI and CUDA allocate), shared memory and other
files.
On a machine without CUDA it runs the same pipeline on the CPU, with batches of 32.

    python benchmarks/dali_pipelines.py --threads 8 4 --out dali-pipelines.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def resident_mib() -> dict[str, int]:
    """The process's resident memory in MiB, split as ``benchmarks/probe.py`` splits it (``pss_by_kind``)."""
    from benchmarks.probe import pss_by_kind

    return {kind: round(gib * 1024) for kind, gib in pss_by_kind(field="Rss").items()}


def make_images(folder: Path, count: int) -> list[str]:
    """``count`` generated 500x375 JPEGs in ``folder`` (kept when there), their paths."""
    from lit_imagenet.data.synthetic import draw_shape

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{i:05d}.jpg" for i in range(count)]
    for i, path in enumerate(paths):
        if not path.exists():
            draw_shape(("circle", "square", "triangle")[i % 3], (500, 375), i).save(path, quality=90)
    return [str(p) for p in paths]


def measure(files: list[str], threads: int, batches: int = 30) -> list[dict[str, Any]]:
    """The steps above, each with its second from the start, resident memory and timings."""
    import numpy as np
    import torch

    cuda = torch.cuda.is_available()
    began = time.perf_counter()
    events: list[dict[str, Any]] = []

    def note(name: str, **extra: Any) -> None:
        at = round(time.perf_counter() - began, 3)
        events.append({"event": name, "second": at, **extra, **resident_mib()})
        print(json.dumps(events[-1]), flush=True)

    if cuda:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    note("CUDA ready" if cuda else "start")
    import nvidia.dali.backend as backend

    from lit_imagenet.data.dali.pipeline import CropSource, build_pipeline

    note("DALI imported")
    batch = 256 if cuda else 32
    sizes = np.tile(np.array([[375, 500]], dtype=np.int32), (len(files), 1))

    def build(seed: int) -> Any:
        order = np.random.default_rng(seed).permutation(len(files))
        source = CropSource(
            np.arange(len(files)), order.astype(np.uint64), lambda rows: sizes[rows], batch, (0.08, 1.0)
        )
        pipe = build_pipeline(
            [files[i] for i in order], [0] * len(files), source, batch_size=batch, threads=threads,
            device_id=0 if cuda else None, crop_size=224, dtype=torch.float16 if cuda else torch.float32,
            channels_last=True, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), hw_decoder_load=0.65,
        )  # fmt: skip
        pipe.build()
        return pipe

    def count_for(seconds: float) -> int:
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            n += 1
        return n

    alone = count_for(0.5) / 0.5

    def build_beside_main_thread(seed: int) -> tuple[Any, dict[str, float]]:
        built: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: built.update(pipe=build(seed)))
        start, counted = time.perf_counter(), 0
        thread.start()
        while thread.is_alive():
            counted += count_for(0.01)
        seconds = time.perf_counter() - start
        share = round(counted / seconds / alone, 2) if seconds >= 0.1 else None
        return built["pipe"], {"build_s": round(seconds, 3), "main_thread_share": share}

    def run(pipe: Any, batches: int) -> float:
        start = time.perf_counter()
        for _ in range(batches):
            pipe.run()
        if cuda:
            torch.cuda.synchronize()
        return round((time.perf_counter() - start) / batches, 4)

    first, timing = build_beside_main_thread(1)
    note("first pipeline built", **timing)
    note("its first batch", s=run(first, 1))
    note(f"its next {batches} batches", s_per_batch=run(first, batches))
    second, timing = build_beside_main_thread(2)
    note("second pipeline built beside the first", **timing)
    note("its first batch", s=run(second, 1))
    note(f"its next {batches} batches", s_per_batch=run(second, batches))
    del first
    gc.collect()
    note("first pipeline deleted")
    backend.ReleaseUnusedMemory()
    note("ReleaseUnusedMemory")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    note("malloc_trim")
    note(f"second pipeline's next {3 * batches} batches", s_per_batch=run(second, 3 * batches))
    third, timing = build_beside_main_thread(3)
    note("third pipeline built beside the second", **timing)
    del second
    gc.collect()
    note("second deleted, the third's first batch", s=run(third, 1))
    note(f"its next {3 * batches} batches", s_per_batch=run(third, 3 * batches))
    return events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[8], help="DALI threads, one process each")
    parser.add_argument("--images", type=int, default=4096, help="generated JPEGs the pipelines read")
    parser.add_argument("--batches", type=int, default=30, help="batches each pipeline runs after its first")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/dali_pipelines_images"))
    parser.add_argument("--out", type=Path, required=True, help="the JSON record")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: these threads
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    if args.one is not None:
        events = measure(make_images(args.folder, args.images), args.one, args.batches)
        args.out.write_text(json.dumps(events, indent=2) + "\n")
        return 0
    import subprocess

    make_images(args.folder, args.images)
    record: dict[str, Any] = {"images": args.images, "batches": args.batches, "by_threads": {}}
    for threads in args.threads:  # each in a process of its own: the first build is the process's first
        part = args.out.with_suffix(f".{threads}.json")
        counts = ["--images", str(args.images), "--batches", str(args.batches), "--folder", str(args.folder)]
        cmd = [sys.executable, __file__, "--one", str(threads), *counts, "--out", str(part)]
        subprocess.run(cmd, check=True)
        record["by_threads"][str(threads)] = json.loads(part.read_text())
        part.unlink()
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
