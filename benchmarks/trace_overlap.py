"""Reads a PyTorch profiler trace (``--profile.torch_trace true``) and reports where a step's time goes.

* Copy/compute overlap: for every host-to-device copy, how much of its duration ran while a kernel
  on the main CUDA stream (the one with the most kernel time: the training step's) was running.
  The side-stream prefetcher should put its copies beside the training kernels, not between them.
* Streams: for each CUDA stream, its kernels' count and busy time (overlapping kernels counted
  once), and how much of that ran at the same time as main-stream kernels.
* The main stream's idle time between its first and last kernel: time the GPU waited for work.
* Host: the ``train step N`` ranges (step time as the training loop saw it; the first one, which
  starts before its batch was fetched, is left out) and, per thread, the ranges whose names start
  with ``prefetch:`` (``CUDAPrefetcher``'s), the time in CUDA synchronisation calls, and how long the
  thread ran operators (threads with none of these and operators for under 5% of the window are left
  out).

    python benchmarks/trace_overlap.py runs/.../trace.json
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from typing import Any

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


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


def _total(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _events(trace: str | dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def analyse(trace: str | dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any]:
    """The figures above (times in ms) from a trace file's path or its loaded JSON."""
    kernels: dict[int, list[tuple[float, float]]] = defaultdict(list)
    copies: list[tuple[int, float, float]] = []
    steps: list[tuple[float, float]] = []
    ranges: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    syncs: dict[str, float] = defaultdict(float)
    ops: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in _events(trace):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat, name, tid = e.get("cat", ""), str(e.get("name", "")), str(e.get("tid", ""))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if cat == "kernel":
            kernels[int(e.get("args", {}).get("stream", -1))].append(span)
        elif cat == "gpu_memcpy" and "HtoD" in name:
            copies.append((int(e.get("args", {}).get("stream", -1)), *span))
        elif cat == "user_annotation" and name.startswith("train step "):
            steps.append(span)
        elif cat == "user_annotation" and name.startswith("prefetch:"):
            ranges[tid][name].append(span[1] - span[0])
        elif cat == "cuda_runtime" and name.startswith(SYNC_CALLS):
            syncs[tid] += span[1] - span[0]
        elif cat == "cpu_op":
            ops[tid].append(span)
    busy = {s: _merge(v) for s, v in kernels.items()}
    main_stream = max(busy, key=lambda s: _total(busy[s])) if busy else -1
    main_busy = busy.get(main_stream, [])
    copy_time = sum(end - start for _, start, end in copies)
    hidden = sum(_overlap(start, end, main_busy) for stream, start, end in copies if stream != main_stream)
    streams = {
        str(s): {
            "kernels": len(kernels[s]),
            "busy_ms": _total(b) / 1e3,
            "busy_ms_beside_main_stream": 0.0
            if s == main_stream
            else sum(_overlap(a, z, main_busy) for a, z in b) / 1e3,
        }
        for s, b in sorted(busy.items())
    }
    window = (main_busy[-1][1] - main_busy[0][0]) if main_busy else 0.0
    step_ms = sorted((b - a) / 1e3 for a, b in sorted(steps)[1:])
    threads = {
        tid: {
            "operator_ms": _total(_merge(ops.get(tid, []))) / 1e3,
            "sync_ms": syncs.get(tid, 0.0) / 1e3,
            **{f"{name} (ms, count)": [sum(d) / 1e3, len(d)] for name, d in sorted(ranges.get(tid, {}).items())},
        }
        for tid in sorted(set(ranges) | set(syncs) | {t for t, v in ops.items() if _total(_merge(v)) > 0.05 * window})
    }
    return {
        "kernels": sum(len(v) for v in kernels.values()),
        "streams_with_kernels": len(kernels),
        "main_stream": main_stream,
        "htod_copies": len(copies),
        "htod_copies_on_side_streams": sum(1 for s, _, _ in copies if s != main_stream),
        "htod_copy_ms": copy_time / 1e3,
        "htod_ms_overlapping_main_stream_kernels": hidden / 1e3,
        "main_stream_window_ms": window / 1e3,
        "main_stream_idle_ms": (window - _total(main_busy)) / 1e3,
        "streams": streams,
        "steps": len(step_ms),
        "step_ms_mean": statistics.fmean(step_ms) if step_ms else None,
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "step_ms_max": step_ms[-1] if step_ms else None,
        "threads": threads,
    }


if __name__ == "__main__":
    print(json.dumps(analyse(sys.argv[1]), indent=2))
