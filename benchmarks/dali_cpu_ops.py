"""The CPU side of the DALI training pipeline, without decoding: what reading the files and the crop windows cost.

On CUDA, ``--data.decoder dali`` decodes on the GPU (``mixed``), but the file reader and the external
source that hands over each batch's crop windows and flips run on the CPU. This times (0) reading the
image sizes from the files' headers, done once per loader; then batches of two CPU pipelines:
(1) read the files; (2) also take the crop windows, computed with numpy from the samples' seeds and
sizes, as the training pipeline does. Needs only DALI's CPU operators.

    python benchmarks/dali_cpu_ops.py --data /tmp/lit_imagenet_jpeg500 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def build(stage: int, files: list[str], sizes: np.ndarray, batch_size: int, threads: int) -> Any:
    from nvidia.dali import fn, pipeline_def, types

    from lit_imagenet.dali import _CropSource
    from lit_imagenet.samplers import sample_seed

    seeds = [sample_seed(0, 0, i) for i in range(len(files))]

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=None, seed=0)
    def pipeline() -> Any:
        encoded, _ = fn.readers.file(files=files, labels=[0] * len(files), random_shuffle=False, name="Reader")
        if stage == 1:
            return encoded.shape()
        anchor, shape, flip = fn.external_source(source=_CropSource(seeds, sizes, batch_size, (0.08, 1.0)),
                                                 num_outputs=3, batch=True, dtype=[types.INT32] * 3)  # fmt: skip
        return encoded.shape(), anchor, shape, flip

    pipe = pipeline()
    pipe.build()
    return pipe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("/tmp/lit_imagenet_jpeg500"), help="an ImageFolder root")
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=20, help="batches timed, after 3")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from lit_imagenet.decoding import image_sizes
    from lit_imagenet.folders import scan_split

    _, samples = scan_split(args.data / "train")
    files = [path for path, _ in samples]
    names = {1: "read", 2: "read + the crop windows (external source, numpy)"}
    for threads in args.threads:
        start = time.perf_counter()
        sizes = image_sizes(files, threads)
        seconds = time.perf_counter() - start
        print(f"threads {threads:>2}  {'image sizes from the headers (once per loader)':<52} "
              f"{seconds / len(files) * 1e6:7.1f} us per file ({len(files)} files in {seconds:.2f} s)")  # fmt: skip
        for stage in (1, 2):
            pipe = build(stage, files, sizes, args.batch_size, threads)
            for _ in range(3):
                pipe.run()
            start = time.perf_counter()
            for _ in range(args.batches):
                pipe.run()
            seconds = (time.perf_counter() - start) / args.batches
            print(f"threads {threads:>2}  {names[stage]:<52} {seconds * 1000:7.1f} ms per batch of "
                  f"{args.batch_size} ({args.batch_size / seconds:,.0f} images/s)", flush=True)  # fmt: skip
            del pipe


if __name__ == "__main__":
    main()
