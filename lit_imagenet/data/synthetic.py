"""A small, learnable ImageFolder of coloured shapes (one class per shape, a hue leaning to the class, a noisy
background), for the demo, the tests and the benchmarks. Run ``python -m lit_imagenet.data.synthetic --help``."""

from __future__ import annotations

import colorsys
import json
import math
import random
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
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


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(make_shapes)
