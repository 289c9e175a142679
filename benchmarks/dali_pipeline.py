"""The DALI training pipeline alone (``--data.decoder dali``'s ``DALILoader``), without a model: images/s.

For each setting of CPU threads and hardware-decoder share, it builds the loader on a folder of JPEGs
(the ``throughput.py`` data by default), times the pipeline's build, its first batch, and then a
number of batches with the GPU synchronised at both ends. What a ``fit`` with ``dali`` could reach
at most, and how the threads (``--data.workers`` in a ``fit``) and the hardware decoder's share
(``DALILoader``'s ``hw_decoder_load``, 0.65 in a ``fit``) move it.

    python benchmarks/dali_pipeline.py --data /tmp/lit_imagenet_jpeg500 --threads 15 --hw-loads 0.65 0.9 1.0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def measure(samples: list[tuple[str, int]], threads: int, hw_load: float, args: argparse.Namespace) -> dict[str, Any]:
    from lit_imagenet.dali import DALILoader
    from lit_imagenet.samplers import EpochSeededSampler

    sampler = EpochSeededSampler(samples, seed=0)  # type: ignore[arg-type]
    device = torch.device("cuda", 0)
    loader = DALILoader(samples, args.batch_size, True, args.crop_size, 256, (0.08, 1.0), threads, sampler=sampler,
                        device=device, channels_last=True, dtype=torch.float16, hw_decoder_load=hw_load)  # fmt: skip
    start = time.perf_counter()
    batches = iter(loader)
    next(batches)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    for _ in range(args.warmup):
        next(batches)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    batches.close()
    rate = args.batches * args.batch_size / seconds
    row = {"threads": threads, "hw_decoder_load": hw_load, "first_batch_s": round(first, 3),
           "images_per_sec": round(rate, 1)}  # fmt: skip
    print(f"threads {threads:>2}  hw_decoder_load {hw_load:.2f}: {rate:>9,.0f} images/s "
          f"(first batch after {first:.2f} s)", flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("/tmp/lit_imagenet_jpeg500"), help="an ImageFolder root")
    parser.add_argument("--threads", type=int, nargs="+", default=[15])
    parser.add_argument("--hw-loads", type=float, nargs="+", default=[0.65])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--crop-size", type=int, default=224)
    parser.add_argument("--warmup", type=int, default=10, help="batches before the timing")
    parser.add_argument("--batches", type=int, default=60, help="batches timed")
    parser.add_argument("--out", type=Path, default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: the DALI pipeline benchmark needs a CUDA device.")
    sys.path.insert(0, str(REPO))
    from lit_imagenet.folders import scan_split

    _, samples = scan_split(args.data / "train")
    needed = (args.warmup + args.batches + 1) * args.batch_size
    if len(samples) < needed:
        sys.exit(f"error: {args.data / 'train'} holds {len(samples)} images; the timing needs {needed}.")
    rows = [measure(samples, t, h, args) for t in args.threads for h in args.hw_loads]
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
