"""A small, learnable ImageFolder of coloured shapes (one class per shape, a hue leaning to the class, a noisy
background), for the demo, the tests and the benchmarks. Run ``python -m lit_imagenet.data.synthetic --help``."""

from __future__ import annotations

import colorsys
import json
import math
import random
import shutil
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "cross", "ring", "star")
_MARKER = ".complete.json"


def _polygon(kind: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if kind in ("square", "triangle", "star"):  # corners on a circle; the star's odd ones nearer the centre
        n, start = {"square": (4, math.pi / 4), "triangle": (3, -math.pi / 2), "star": (10, -math.pi / 2)}[kind]
        radii = [0.42 if kind == "star" and k % 2 else 1.0 for k in range(n)]
        angles = [start + k * 2 * math.pi / n for k in range(n)]
        pts = [(rad * math.cos(a), rad * math.sin(a)) for rad, a in zip(radii, angles)]
    else:  # the cross: one half, then the other by point symmetry
        w = 0.33
        pts = [(w, 1), (w, w), (1, w), (1, -w), (w, -w), (w, -1)]
        pts += [(-x, -y) for x, y in pts]
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + r * (x * c - y * s), cy + r * (x * s + y * c)) for x, y in pts]


def _colours(rng: random.Random, hue: float) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    while True:
        h = (hue + rng.uniform(-0.05, 0.05)) % 1.0
        fg = tuple(round(255 * v) for v in colorsys.hsv_to_rgb(h, rng.uniform(0.6, 1.0), rng.uniform(0.6, 1.0)))
        bg = tuple(rng.randrange(256) for _ in range(3))
        if sum(abs(a - b) for a, b in zip(fg, bg)) >= 180:
            return fg, bg  # type: ignore[return-value]


def draw_shape(kind: str, size: tuple[int, int], seed: int) -> Image.Image:
    """One RGB image of ``kind`` (one of ``SHAPES``), ``size`` = (width, height), fixed by ``seed``."""
    rng = random.Random(seed)
    width, height = size
    fg, bg = _colours(rng, SHAPES.index(kind) / len(SHAPES))
    noise = np.random.default_rng(seed).normal(0.0, 12.0, size=(height, width, 3))
    img = Image.fromarray(np.clip(np.asarray(bg, dtype=np.float64) + noise, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(img)
    r = rng.uniform(0.22, 0.4) * min(width, height)
    cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif kind == "ring":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fg, width=max(2, int(r * 0.3)))
    else:
        draw.polygon(_polygon(kind, cx, cy, r, rng.uniform(0, 2 * math.pi)), fill=fg)
    return img


def _write(job: tuple[str, str, tuple[int, int], int, int]) -> None:
    path, kind, size, seed, quality = job
    draw_shape(kind, size, seed).save(path, quality=quality)


def make_shapes(
    out: str,
    train_per_class: int = 300,
    val_per_class: int = 60,
    width: int = 96,
    height: int = 96,
    num_classes: int = 6,
    quality: int = 90,
    seed: int = 0,
    processes: int = 1,
) -> Path:
    """Writes a shapes ImageFolder (``train/``, ``val/``) to ``out``, or reuses one made with the same settings, and
    returns its path. ``num_classes`` is 2 to 6; the same ``seed`` gives the same images; ``processes`` draw them."""
    if not 2 <= num_classes <= len(SHAPES):
        raise ValueError(f"num_classes must be between 2 and {len(SHAPES)}. Got {num_classes}")
    root = Path(out)
    settings = {"train_per_class": train_per_class, "val_per_class": val_per_class, "size": [width, height]}
    settings.update(num_classes=num_classes, quality=quality, seed=seed)
    marker = root / _MARKER
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        print(f"Reusing the shapes data in {root}", flush=True)
        return root
    if root.exists():
        if any(root.iterdir()) and not marker.is_file():
            raise FileExistsError(f"{root} exists and was not made by this generator; choose another folder.")
        shutil.rmtree(root)
    jobs = []
    for split, count, offset in (("train", train_per_class, 0), ("val", val_per_class, 10_000_000)):
        for c, kind in enumerate(SHAPES[:num_classes]):
            folder = root / split / kind
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image_seed = seed * 100_000_000 + offset + c * 1_000_000 + i
                jobs.append((str(folder / f"{kind}_{i:06d}.jpg"), kind, (width, height), image_seed, quality))
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            list(pool.map(_write, jobs, chunksize=64))
    else:
        list(map(_write, jobs))
    marker.write_text(json.dumps(settings))
    print(f"Wrote {len(jobs)} images of {num_classes} classes to {root}", flush=True)
    return root


class _Repeated:
    """``steps`` times ``batch``, with a length and a batch size (a list of batches would read as several loaders)."""

    def __init__(self, batch: list[torch.Tensor], steps: int) -> None:
        self.batch, self.steps, self.batch_size = batch, steps, len(batch[1])

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return iter([self.batch] * self.steps)


class SyntheticDataModule(pl.LightningDataModule):
    """The same random uint8 batch of ``batch_size`` square ``crop_size`` images every step, made on the training
    device: ``fit`` with no loading or copying, to measure the training loop itself. ``channels_last=None``: on CUDA.
    """

    def __init__(
        self,
        batch_size: int = 256,
        crop_size: int = 224,
        channels_last: bool | None = None,
        num_classes: int = 1000,
        train_steps: int = 100,
        val_steps: int = 2,
    ) -> None:
        super().__init__()
        if min(batch_size, crop_size, num_classes, train_steps) < 1 or val_steps < 0:
            raise ValueError("batch_size, crop_size, num_classes and train_steps must be positive.")
        self.batch_size, self.crop_size = batch_size, crop_size
        self.num_classes, self.classes = num_classes, [f"class_{i}" for i in range(num_classes)]
        self.train_steps, self.val_steps = train_steps, val_steps
        self.channels_last = channels_last
        self.prefetch_device: torch.device | None = None

    def _batches(self, steps: int) -> _Repeated:
        device = self.prefetch_device or (self.trainer.strategy.root_device if self.trainer is not None else None)
        device = torch.device(device if device is not None else "cpu")
        g = torch.Generator(device=device).manual_seed(0)
        shape = (self.batch_size, 3, self.crop_size, self.crop_size)
        images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
        if self.channels_last or (self.channels_last is None and device.type == "cuda"):
            images = images.contiguous(memory_format=torch.channels_last)
        targets = torch.randint(0, self.num_classes, (self.batch_size,), device=device, generator=g)
        return _Repeated([images, targets], steps)

    def train_dataloader(self) -> _Repeated:
        return self._batches(self.train_steps)

    def val_dataloader(self) -> _Repeated:
        return self._batches(self.val_steps)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(make_shapes)
