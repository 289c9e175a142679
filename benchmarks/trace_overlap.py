"""Reads a PyTorch profiler trace (``--profile.torch_trace true``) and reports copy/compute overlap.

For every host-to-device copy it measures how much of its duration ran while a kernel on another
CUDA stream was running: the side-stream prefetcher should put its copies (and its normalisation
kernels) beside the training step's kernels, not between them.

    python benchmarks/trace_overlap.py runs/.../trace.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(start: float, end: float, busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)


def analyse(path: str) -> dict[str, float]:
    events = json.load(open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels: dict[int, list[tuple[float, float]]] = defaultdict(list)
    copies: list[tuple[int, float, float]] = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        stream = int(e.get("args", {}).get("stream", -1))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if cat == "kernel":
            kernels[stream].append(span)
        elif cat == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            copies.append((stream, *span))
    busy = {s: _merge(v) for s, v in kernels.items()}
    main_stream = max(busy, key=lambda s: sum(b - a for a, b in busy[s])) if busy else -1
    copy_time = sum(end - start for _, start, end in copies)
    hidden = sum(
        _overlap(start, end, busy.get(main_stream, [])) for stream, start, end in copies if stream != main_stream
    )
    return {
        "kernels": float(sum(len(v) for v in kernels.values())),
        "streams_with_kernels": float(len(kernels)),
        "main_stream": float(main_stream),
        "htod_copies": float(len(copies)),
        "htod_copies_on_side_streams": float(sum(1 for s, _, _ in copies if s != main_stream)),
        "htod_copy_ms": copy_time / 1e3,
        "htod_ms_overlapping_main_stream_kernels": hidden / 1e3,
    }


if __name__ == "__main__":
    print(json.dumps(analyse(sys.argv[1]), indent=2))
