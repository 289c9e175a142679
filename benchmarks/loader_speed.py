"""The data path alone: how fast each decoder delivers normalised training batches to the GPU, no model.

For each ``--decoders`` entry (``pil``, ``torchvision``, ``nvjpeg``, ``nvjpeg@SHARE`` or ``dali``) it builds
the project's ``ImageFolderDataModule`` on ``--data``, iterates its training loader through the side-stream
prefetcher as ``fit`` does (a ``dali`` loader hands over batches on the GPU itself) and reports images/s over
``--batches`` batches after the first one, with the GPU synchronised at both ends. If the GPU trains faster
than a decoder delivers, that decoder bounds ``fit``. For ``nvjpeg`` it also times one batch's pieces: the
batched ``decode_jpeg`` alone, and the whole ``EncodedBatch.decode`` (decode, crop and resize, flip,
rounding), with the host time that each takes.

    python benchmarks/loader_speed.py --data /tmp/lit_imagenet_jpeg500 --decoders torchvision nvjpeg nvjpeg@0.5
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


def _synced(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def loader_rate(root: str, decoder: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from lit_imagenet import ImageFolderDataModule

    kind, _, share = decoder.partition("@")
    dm = ImageFolderDataModule(root, batch_size=args.batch_size, workers=args.workers, decoder=kind,  # type: ignore[arg-type]
                               gpu_share=float(share or 1.0), seed=0, channels_last=device.type == "cuda")  # fmt: skip
    if device.type == "cuda":
        dm.prefetch_device = device
    start = time.perf_counter()
    loader = dm.train_dataloader()
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - start
    begin, count = _synced(device), 0
    for batch in batches:
        if device.type != "cuda" and hasattr(batch, "decode"):
            batch.decode(device)
        count += 1
        if count == args.batches:
            break
    seconds = _synced(device) - begin
    if getattr(loader, "_iterator", None) is not None:  # stop the persistent workers before the next decoder
        loader._iterator._shutdown_workers()  # forks its own (a DALI loader has threads, no workers)
    rate = count * args.batch_size / seconds
    print(f"{decoder}: {rate:,.0f} images/s over {count} batches ({seconds / count * 1e3:.1f} ms each), "
          f"first batch after {first:.2f} s", flush=True)  # fmt: skip
    return {"decoder": decoder, "images_per_sec": rate, "batches": count, "first_batch_seconds": first}


def decode_parts(root: str, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Milliseconds per batch of nvJPEG's decode alone and of the whole ``EncodedBatch.decode``."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from lit_imagenet import ImageFolderDataModule

    dm = ImageFolderDataModule(root, batch_size=args.batch_size, workers=2, decoder="nvjpeg", seed=0,
                               channels_last=True)  # fmt: skip
    loader = dm.train_dataloader()
    batch = next(iter(loader)).pin_memory()
    if loader._iterator is not None:
        loader._iterator._shutdown_workers()
    data = [item.data for item in batch.encoded]
    out: dict[str, float] = {}
    for name, fn in (
        ("decode_jpeg", lambda: decode_jpeg(data, mode=ImageReadMode.RGB, device=device)),
        ("EncodedBatch.decode", lambda: batch.decode(device)),
    ):
        fn()  # warm-up
        host, total = [], []
        for _ in range(5):
            begin = _synced(device)
            fn()
            host.append(time.perf_counter() - begin)
            total.append(_synced(device) - begin)
        out[f"{name} ms"] = min(total) * 1e3
        out[f"{name} host ms"] = min(host) * 1e3
        print(f"{name}, {len(data)} images: {min(total) * 1e3:.1f} ms ({min(host) * 1e3:.1f} ms until it returns)")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="an ImageFolder root with train/ and val/")
    parser.add_argument("--decoders", nargs="+", default=["pil", "torchvision", "nvjpeg"])
    parser.add_argument("--workers", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--batches", type=int, default=40, help="timed batches per decoder, after the first")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))  # runs from a checkout, installed or not
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"}
    report["loaders"] = [loader_rate(args.data, decoder, args, device) for decoder in args.decoders]
    if device.type == "cuda" and any(d.startswith("nvjpeg") for d in args.decoders):
        report["nvjpeg_parts"] = decode_parts(args.data, args, device)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
