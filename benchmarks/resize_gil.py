"""How much a busy Python thread slows the crop-and-resize of a batch, run as Python and as TorchScript.

The nvjpeg path crops and resizes each batch in the prefetcher's decode thread while the training
loop runs Python in the main thread. Each operator called from Python releases the GIL and must take
it back; beside a busy thread every taking back can wait. ``gpu_decode.resize_crops`` compiled by
TorchScript runs its loop without the GIL. This script times both, alone and beside a thread that
runs pure Python, on random pictures (CPU by default):

    python benchmarks/resize_gil.py --pictures 256 --height 60 --width 50 --size 24
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from lit_imagenet.gpu_decode import _scripted_resize_crops, resize_crops  # noqa: E402


def _time(fn, args, repeats: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def _spin(stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1


def measure(pictures: int, height: int, width: int, size: int, repeats: int, device: torch.device) -> dict[str, float]:
    """Milliseconds per batch for each of: Python or TorchScript, alone or beside a busy thread."""
    gen = torch.Generator().manual_seed(0)
    pics = [
        torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=gen).to(device) for _ in range(pictures)
    ]
    boxes = [[1, 2, height - 2, width - 3] for _ in range(pictures)]
    flips = list(range(0, pictures, 2))
    args = (pics, boxes, flips, size)
    out: dict[str, float] = {}
    for name, fn in (("python", resize_crops), ("torchscript", _scripted_resize_crops())):
        for _ in range(3):  # warm-up, and TorchScript's profiling runs
            fn(*args)
        out[f"{name}_alone_ms"] = _time(fn, args, repeats, device) * 1e3
        stop = threading.Event()
        busy = threading.Thread(target=_spin, args=(stop,))
        busy.start()
        try:
            time.sleep(0.05)
            out[f"{name}_beside_busy_thread_ms"] = _time(fn, args, repeats, device) * 1e3
        finally:
            stop.set()
            busy.join()
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pictures", type=int, default=256)
    parser.add_argument("--height", type=int, default=60)
    parser.add_argument("--width", type=int, default=50)
    parser.add_argument("--size", type=int, default=24, help="output side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread of operators, as in a decode thread beside the training loop
    result = measure(args.pictures, args.height, args.width, args.size, args.repeats, torch.device(args.device))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
