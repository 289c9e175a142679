"""The DALI decoder: batches against PIL's, crops fixed by the seed, errors, resume, sharding; CPU pipelines here."""

import gc
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image

from lit_imagenet.data.augment import Augment, erase_boxes
from lit_imagenet.data.crops import CROP_RATIO, CROP_TRIES, CropBox, crop_draws, crop_windows, flips
from lit_imagenet.data.dali.loader import DALILoader, batch_dtype, dali_install_command
from lit_imagenet.data.dali.pipeline import pipeline_seed
from lit_imagenet.data.datamodule import ImageFolderDataModule, choose_decoder
from lit_imagenet.data.prefetch import PrefetchLoader
from lit_imagenet.data.presets import IMAGENET_STD, Uint8Normalize
from lit_imagenet.data.samplers import EpochSeededSampler, UnpaddedDistributedSampler
from lit_imagenet.errors import ConfigError, DataError
from tests.cli_args import SMALL_ARCH, fit_args
from tests.runs import final_checkpoint, network
from tests.test_data import _CollectsGarbage
from tests.test_resume import _start, kill_when

STD_255 = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
SIZES = [(40, 50), (61, 37), (120, 45), (45, 120), (33, 33), (200, 20), (57, 43), (64, 64)]  # (width, height)


def reference_crop_window(height: int, width: int, draws: np.ndarray, ratio=CROP_RATIO) -> tuple[int, ...]:
    """RandomResizedCrop's rule restated one image at a time: the first try that fits, placed at random; else the
    largest centred box with an aspect ratio in ``ratio``."""
    area = float(height) * float(width)
    for k in range(CROP_TRIES):
        s, r = draws[k], draws[CROP_TRIES + k]
        w = math.floor(math.sqrt(area * s * r) + 0.5)
        h = math.floor(math.sqrt(area * s / r) + 0.5)
        if 0 < w <= width and 0 < h <= height:
            top = math.floor(draws[2 * CROP_TRIES] * (height - h + 1))
            left = math.floor(draws[2 * CROP_TRIES + 1] * (width - w + 1))
            return (top, left, h, w)
    w = min(width, math.floor(height * ratio[1] + 0.5))
    h = min(height, math.floor(width / ratio[0] + 0.5))
    return ((height - h) // 2, (width - w) // 2, h, w)


def crop_window(height: int, width: int, draws: np.ndarray) -> CropBox:
    """The package's crop of one image."""
    return CropBox(*crop_windows(np.array([[height, width]]), draws[None])[0].tolist())


def levels(normalised: torch.Tensor, reference_uint8: torch.Tensor) -> torch.Tensor:
    """Per-pixel difference between a normalised batch and a uint8 one, in whole grey levels (DALI resizes in uint8)."""
    return ((normalised.float() - Uint8Normalize()(reference_uint8)) * STD_255).abs().round()


def _module(root: Path, **kwargs) -> ImageFolderDataModule:
    settings = dict(batch_size=6, workers=2, crop_size=32, val_resize=36, decoder="dali", seed=3)
    return ImageFolderDataModule(str(root), **{**settings, **kwargs})


@pytest.fixture(scope="module")
def varied_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Noisy JPEGs of many sizes and aspect ratios (one extreme), two classes, both splits."""
    root = tmp_path_factory.mktemp("varied")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, name in enumerate("ab"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for k, (w, h) in enumerate(SIZES):
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                pixels[: h // 2] //= 2  # darker top half: a vertical flip or offset shows
                pixels[:, : w // 3, c] = 255  # a bright band on the left: a mirror shows
                Image.fromarray(pixels).save(folder / f"{k}.jpg", quality=95)
    return root


pytestmark = pytest.mark.dali


@pytest.mark.parametrize("channels_last", [False, True])
def test_validation_batches_equal_pil_to_a_grey_level(varied_root: Path, shapes_root: Path, channels_last) -> None:
    """Resize of the short side and centre crop, placed as torchvision places them: off by one pixel would fail."""
    for root in (varied_root, shapes_root):
        kwargs = dict(batch_size=64, crop_size=32, val_resize=36, channels_last=channels_last)
        pil = next(iter(ImageFolderDataModule(str(root), workers=0, **kwargs).val_dataloader()))
        images, targets = next(iter(_module(root, **kwargs).val_dataloader()))
        assert images.dtype == torch.float32 and images.shape == pil[0].shape
        assert images.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        assert targets.dtype == torch.int64 and torch.equal(targets, pil[1])
        diff = levels(images, pil[0])
        # Measured: at most 1 level (mean 0.13-0.2); libjpeg-turbo in both, two antialiased bilinear resizes.
        assert diff.max() <= 2 and diff.mean() < 0.3, (root.name, diff.max(), diff.mean())


def _pil_training_batch(
    dm: ImageFolderDataModule, order: list[tuple[int, int]], size: int, shift: int = 0
) -> torch.Tensor:
    """The crops the DALI pipeline should cut, by PIL: ``crop_window`` from each sample's draws (moved ``shift``
    pixels to the right), resize, flip."""
    samples = dm.samples("train")
    draws = crop_draws([seed for _, seed in order], dm.crop_scale)
    mirrored = flips(draws)
    out = []
    for k, (index, _) in enumerate(order):
        img = Image.open(samples[index][0]).convert("RGB")
        box = crop_window(img.height, img.width, draws[k])
        left = min(box.left + shift, img.width - box.width)
        crop = img.crop((left, box.top, left + box.width, box.top + box.height))
        pixels = torch.from_numpy(np.asarray(crop.resize((size, size), Image.BILINEAR)).copy()).permute(2, 0, 1)
        out.append(pixels.flip(-1) if mirrored[k] else pixels)
    return torch.stack(out)


@pytest.mark.parametrize("scale", [(0.08, 1.0), (0.9, 1.0)])
def test_training_batches_are_the_drawn_crops(varied_root: Path, scale) -> None:
    """Each sample's crop, flip and normalisation, against PIL applying the same window (the fallback included)."""
    dm = _module(varied_root, batch_size=8, crop_scale=scale)
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(2)
    order = list(loader.sampler)
    images = torch.cat([x for x, _ in loader])
    diff = levels(images, _pil_training_batch(dm, order, 32))
    # Measured on these noise images: mean 0.19 / 0.24 levels, 98% of values within 2 (when DALI's antialiasing
    # filter shrinks a crop to half or less, it weighs neighbours slightly differently from PIL's).
    assert diff.mean() < 0.4 and (diff <= 2).float().mean() > 0.97, (diff.mean(), diff.max())
    # The bound tells crops apart: the same windows one pixel to the right are far off.
    assert levels(images, _pil_training_batch(dm, order, 32, shift=1)).mean() > 10 * diff.mean()


def test_crop_windows_equal_crop_window_image_by_image() -> None:
    """The batch computation of the crop windows equals RandomResizedCrop's rule, the fallback included."""
    rng = np.random.default_rng(1)
    n = 4096
    sizes = np.stack([rng.integers(1, 900, n), rng.integers(1, 900, n)], 1).astype(np.int32)
    sizes[:64, 0], sizes[:64, 1] = rng.integers(1, 6, 64), rng.integers(200, 900, 64)  # no try fits: the centre
    draws = crop_draws(rng.integers(0, 2**62, n).tolist(), (0.08, 1.0))
    draws[64:512, :10] = 0.95 + 0.05 * draws[64:512, :10]  # large areas: some tries fail before one fits

    boxes = crop_windows(sizes, draws)
    expected = [reference_crop_window(int(h), int(w), d) for (h, w), d in zip(sizes, draws)]
    assert [tuple(int(v) for v in box) for box in boxes] == expected
    assert all(b[0] == 0 and b[2] == h for b, (h, _) in zip(expected[:64], sizes))  # the fallback was taken
    area = sizes[64:512, 0].astype(float) * sizes[64:512, 1]
    first_w = np.floor(np.sqrt(area * draws[64:512, 0] * draws[64:512, 10]) + 0.5)
    first_h = np.floor(np.sqrt(area * draws[64:512, 0] / draws[64:512, 10]) + 0.5)
    first_fails = (first_w > sizes[64:512, 1]) | (first_h > sizes[64:512, 0])
    assert first_fails.sum() > 50 and (boxes[64:512, 0][first_fails] >= 0).all()  # later tries were taken too


def test_image_sizes_read_from_headers_equal_pil(tmp_path: Path) -> None:
    """Sizes from the files' headers (the crop windows' input): JPEG with EXIF, progressive, PNG, grey, CMYK."""
    from PIL import Image

    from lit_imagenet.data.images import ImageSizes, image_size
    from lit_imagenet.data.index import SampleTable

    rng = np.random.default_rng(0)
    paths = []
    for k, (mode, ext, options) in enumerate([
        ("RGB", "jpg", {}), ("RGB", "jpg", {"progressive": True}), ("L", "jpg", {}),
        ("RGB", "jpg", {"exif": b"Exif\x00\x00" + bytes(60_000), "icc_profile": bytes(30_000)}),  # frame after 64 KiB
        ("CMYK", "jpg", {}), ("RGB", "png", {}), ("L", "png", {}), ("RGB", "bmp", {}),
    ]):  # fmt: skip
        img = Image.fromarray(rng.integers(0, 256, (37 + k, 53 - k, 3), dtype=np.uint8)).convert(mode)
        path = tmp_path / f"{k}.{ext}"
        img.save(path, **options)
        paths.append(str(path))
    expected = [Image.open(p).size[::-1] for p in paths]
    assert [image_size(p) for p in paths] == expected
    (tmp_path / "bad.jpg").write_bytes(b"\xff\xd8\xff" + bytes(100))
    sizes = ImageSizes(SampleTable.from_pairs(tmp_path, [(p, 0) for p in [*paths, str(tmp_path / "bad.jpg")]]))
    sizes.read_ahead(np.arange(len(paths) + 1)[::-1])  # the thread leaves the bad file to get
    assert sizes.get(np.array([3, 0, 3])).tolist() == [list(expected[3]), list(expected[0]), list(expected[3])]
    sizes.stop()
    assert sizes.get(np.arange(len(paths))).tolist() == [list(e) for e in expected]
    with pytest.raises(DataError, match=f"^Cannot decode image {tmp_path / 'bad.jpg'} .*replace or remove the file"):
        sizes.get(np.array([0, len(paths), 1]))


def test_image_sizes_take_the_read_ahead_headers_as_they_are_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reading worker's chunks are taken as the samples asked for reach them; the first ``start`` are read by
    ``get`` itself."""
    from lit_imagenet.data.images import ImageSizes
    from lit_imagenet.data.index import SampleTable

    monkeypatch.setattr(ImageSizes, "CHUNK", 64)
    paths = []
    for k in range(4):
        Image.new("RGB", (30 + k, 20 + k)).save(tmp_path / f"{k}.jpg")
        paths.append(str(tmp_path / f"{k}.jpg"))
    count = 6_000
    sizes = ImageSizes(SampleTable.from_pairs(tmp_path, [(paths[i % 4], 0) for i in range(count)]))
    sizes.read_ahead(np.arange(count), start=100)
    try:
        sizes.get(np.arange(100))
        assert int((sizes.sizes[:, 0] > 0).sum()) == 100  # read here: nothing taken from the worker yet
        sizes.get(np.arange(100, 1_000))
        assert int((sizes.sizes[:, 0] > 0).sum()) == 100 + 15 * 64  # whole chunks, up to the samples asked for
    finally:
        sizes.stop()
    assert sizes.get(np.arange(count)).tolist() == [[20 + i % 4, 30 + i % 4] for i in range(count)]


def test_crop_window_follows_random_resized_crop() -> None:
    """Area within crop_scale, aspect ratio within (3/4, 4/3), inside the image; else the centred fallback."""
    draws = crop_draws(list(range(2000)), (0.2, 0.7))
    tops, areas = [], []
    for d in draws:
        box = crop_window(300, 400, d)
        assert 0 <= box.top and box.top + box.height <= 300 and 0 <= box.left and box.left + box.width <= 400
        assert 0.2 * 0.95 <= box.height * box.width / 120_000 <= 0.7 * 1.05
        assert 3 / 4 * 0.95 <= box.width / box.height <= 4 / 3 * 1.05
        tops.append(box.top / (300 - box.height + 1))
        areas.append(box.height * box.width / 120_000)
    assert abs(np.mean(tops) - 0.5) < 0.03 and abs(np.mean(areas) - 0.45) < 0.02  # uniform draws
    assert 0.45 < flips(draws).mean() < 0.55
    assert crop_window(20, 200, draws[0]) == (0, 86, 20, 27)  # nothing fits: the centre, at ratio 4/3


def test_same_seed_same_batches_other_seed_or_epoch_other_crops(shapes_root: Path) -> None:
    def epoch(seed: int, number: int) -> list[list[torch.Tensor]]:
        loader = _module(shapes_root, seed=seed).train_dataloader()
        loader.sampler.set_epoch(number)
        return list(loader)

    first, again = epoch(5, 0), epoch(5, 0)
    assert len(first) == 4  # 24 images, batches of 6
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    for other in (epoch(6, 0), epoch(5, 1)):
        assert not torch.equal(torch.cat([b[1] for b in other]), torch.cat([b[1] for b in first]))
        assert not any(torch.equal(a[0], b[0]) for a, b in zip(first, other))


def test_a_resumed_epoch_continues_with_the_very_same_batches(shapes_root: Path) -> None:
    whole = _module(shapes_root).train_dataloader()
    whole.sampler.set_epoch(1)
    expected = list(whole)
    resumed = _module(shapes_root).train_dataloader()
    resumed.sampler.resume_at(1, 2 * 6)  # two batches of epoch 1 were trained before the run stopped
    rest = list(resumed)
    assert len(rest) == len(expected) - 2
    for (x, y), (ex, ey) in zip(rest, expected[2:]):
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert len(list(resumed)) == len(expected)  # only the first pass skips


def _augmented(root: Path, augment: Augment | None, seed: int = 3, epoch: int = 1, skip: int = 0) -> DALILoader:
    """A training loader of ``root`` with ``augment``, at ``epoch`` (resumed after ``skip`` samples)."""
    samples = _module(root).samples("train")
    sampler = EpochSeededSampler(samples, seed=seed)
    sampler.resume_at(epoch, skip)
    return DALILoader(samples, 6, True, 32, 36, (0.08, 1.0), 2, sampler=sampler, augment=augment)


def _epoch(loader: DALILoader) -> tuple[torch.Tensor, torch.Tensor]:
    batches = list(loader)
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


@pytest.mark.parametrize("policy", ["ta_wide", "ra"])
def test_an_augmented_epoch_differs_from_a_plain_one_and_repeats_for_its_seed(shapes_root: Path, policy) -> None:
    augment = Augment(policy=policy, ra_magnitude=15, random_erase=0.5)
    plain, labels = _epoch(_augmented(shapes_root, None))
    assert torch.equal(_epoch(_augmented(shapes_root, Augment()))[0], plain)  # no augmentation: today's batches
    first, first_labels = _epoch(_augmented(shapes_root, augment))
    assert torch.equal(first_labels, labels) and first.shape == plain.shape
    changed = (first - plain).abs().amax(dim=(1, 2, 3)) > 0.1
    assert changed.sum() >= len(plain) // 2, changed  # the policy (and erasing) changed most images
    assert torch.equal(_epoch(_augmented(shapes_root, augment))[0], first)
    other = _epoch(_augmented(shapes_root, augment, seed=4))[0]
    assert not torch.equal(other, first)
    # A resumed epoch: the same batches again for the same position.
    resumed = _epoch(_augmented(shapes_root, augment, skip=12))[0]
    assert resumed.shape[0] == 12 and torch.equal(_epoch(_augmented(shapes_root, augment, skip=12))[0], resumed)


def test_erased_boxes_are_erase_boxes_filled_with_the_mean(shapes_root: Path) -> None:
    """With erasing alone: each image is the plain one outside ``erase_boxes``' box (mirrored crops included) and
    the normalised fill, about 0, inside it."""
    loader = _augmented(shapes_root, Augment(random_erase=1.0))
    seeds = np.array([seed for _, seed in loader.sampler])
    erased, _ = _epoch(loader)
    plain, _ = _epoch(_augmented(shapes_root, None))
    boxes = erase_boxes(seeds, 32, 32, 1.0)
    assert (boxes[:, 2] > 0).sum() >= len(boxes) - 2  # nearly every box fits at these sizes
    for k, (top, left, height, width) in enumerate(boxes.tolist()):
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top : top + height, left : left + width] = True
        assert torch.equal(erased[k][:, ~inside], plain[k][:, ~inside]), k
        assert erased[k][:, inside].abs().max() < 0.01, k  # round(255 * mean) normalised
        assert height == 0 or plain[k][:, inside].abs().max() > 0.1, k  # the box was not blank before


def test_augmix_with_dali_is_refused_in_one_line(shapes_root: Path) -> None:
    with pytest.raises(ConfigError) as error:
        _augmented(shapes_root, Augment(policy="augmix"))
    assert str(error.value) == (
        "--data.auto_augment augmix is not available with --data.decoder dali, which has no AugMix: "
        "choose ta_wide or ra, or the pil, torchvision or nvjpeg decoder."
    )


def test_a_training_loader_needs_an_epoch_seeded_sampler(shapes_root: Path) -> None:
    samples = _module(shapes_root).samples("train")
    with pytest.raises(ValueError, match="^A training DALILoader takes its order from an EpochSeededSampler. Got None"):
        DALILoader(samples, 6, True, 32, 36, (0.08, 1.0), 2, sampler=None)


def test_the_policys_pipeline_seed_follows_seed_epoch_resume_and_rank() -> None:
    seeds = {pipeline_seed(*args) for args in [(3, 1, 0, 0), (4, 1, 0, 0), (3, 2, 0, 0), (3, 1, 12, 0), (3, 1, 0, 1)]}
    assert len(seeds) == 5 and all(0 <= s < 2**31 for s in seeds)
    assert pipeline_seed(3, 1, 12, 0) == pipeline_seed(3, 1, 12, 0)


def test_each_epoch_gets_a_pipeline_of_the_samplers_order(shapes_root: Path, monkeypatch) -> None:
    """One loader over several epochs, a resume and a restored seed: each epoch's batches are those of a loader
    asked for that epoch alone, from one pipeline built from that epoch's samples."""
    builds: list[tuple[int, int]] = []
    build = DALILoader._build

    def counted(self, indices, *args):
        builds.append((int(self.sampler.epoch), len(indices)))
        return build(self, indices, *args)

    def alone(epoch: int, seed: int = 3) -> list[list[torch.Tensor]]:
        loader = _module(shapes_root, batch_size=5, seed=seed).train_dataloader()
        loader.sampler.set_epoch(epoch)
        return list(loader)

    def same(got: list[list[torch.Tensor]], expected: list[list[torch.Tensor]]) -> bool:
        return len(got) == len(expected) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, expected)
        )

    expected, reseeded = [alone(epoch) for epoch in range(3)], alone(2, seed=4)
    assert [len(b[0]) for b in expected[0]] == [5, 5, 5, 5, 4]  # 24 images: the last batch is not padded
    monkeypatch.setattr(DALILoader, "_build", counted)
    loader = _module(shapes_root, batch_size=5).train_dataloader()
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)  # as Lightning does at each epoch's start
        assert same(list(loader), expected[epoch])
    assert builds == [(0, 24), (1, 24), (2, 24)]
    loader.sampler.resume_at(1, 10)  # two batches of epoch 1 were trained on
    assert same(list(loader), expected[1][2:]) and builds[3:] == [(1, 14)]
    loader.sampler.set_epoch(2)
    loader.sampler.seed = 4  # a checkpoint's seed, restored
    assert same(list(loader), reseeded)


def test_an_evaluation_pipeline_is_built_once_and_gives_the_same_batches_every_pass(
    varied_root: Path, monkeypatch
) -> None:
    """A validation pass that reads every file keeps its pipeline for the next pass; one left part-way does not.
    With a batch limit the reader holds only those batches' files, so that each pass reads them all."""
    builds: list[int] = []
    build = DALILoader._build

    def counted(self, indices, *args):
        builds.append(len(indices))
        return build(self, indices, *args)

    monkeypatch.setattr(DALILoader, "_build", counted)
    dm = _module(varied_root, batch_size=4)
    dm.setup("fit")
    loader = dm.val_dataloader()
    count = len(dm.samples("val"))
    first = list(loader)
    assert len(first) == len(loader) == -(-count // 4) and builds == [count]
    for _ in range(2):
        again = list(loader)
        assert builds == [count]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again, strict=True))
    passes = iter(loader)
    next(passes)  # a sanity check's two batches, then training: the pipeline is read part-way
    next(passes)
    assert [b[1].tolist() for b in list(loader)] == [b[1].tolist() for b in first]  # built again, from the start
    assert builds == [count, count]

    builds.clear()
    limited = DALILoader(dm.samples("val"), 4, False, 32, 36, (0.08, 1.0), threads=2, sampler=None, max_batches=2)
    assert len(limited) == 2
    assert [b[1].tolist() for b in limited] == [b[1].tolist() for b in first[:2]]
    assert [b[1].tolist() for b in limited] == [b[1].tolist() for b in first[:2]]
    assert builds == [8]  # the files of 2 batches, read by one pipeline twice


def test_the_data_module_gives_an_integer_batch_limit_to_the_evaluation_loaders(shapes_root: Path) -> None:
    trainer = pl.Trainer(limit_val_batches=3, limit_test_batches=0.5, logger=False, enable_checkpointing=False)
    dm = _module(shapes_root)
    dm.trainer = trainer
    dm.setup("fit")
    assert dm.val_dataloader().max_batches == 3
    assert dm.test_dataloader().max_batches is None  # a fraction: Lightning shortens the pass itself
    assert dm.train_dataloader().max_batches is None
    with pytest.raises(ValueError, match="hw_decoder_load must be between 0 and 1. Got 1.5"):
        _module(shapes_root, hw_decoder_load=1.5)


@pytest.mark.parametrize("content", [b"", b"not an image at all", "truncated", "half"])
def test_an_undecodable_image_is_named(shapes_root: Path, tmp_path: Path, content) -> None:
    root = tmp_path / "data"
    shutil.copytree(shapes_root, root)
    victim = sorted((root / "train").rglob("*.jpg"))[13]
    data = victim.read_bytes()
    victim.write_bytes({"truncated": data[:200], "half": data[: len(data) // 2]}.get(content, content))
    with pytest.raises(DataError, match=f"^Cannot decode image {victim} .*replace or remove the file"):
        for _ in _module(root, batch_size=4).train_dataloader():
            pass


def test_png_grayscale_cmyk_and_other_formats_train(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("a", "b"):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            img = Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8))
            img.save(folder / "rgb.png")
            img.convert("L").save(folder / "gray.jpg", quality=95)
            img.convert("CMYK").save(folder / "cmyk.jpg", quality=95)
            img.convert("P").save(folder / "palette.png")
            img.convert("RGBA").save(folder / "alpha.png")
            img.save(folder / "lossless.webp", lossless=True)
            img.save(folder / "bitmap.bmp")
    kwargs = dict(batch_size=14, crop_size=32, val_resize=36)
    pil = next(iter(ImageFolderDataModule(str(tmp_path), workers=0, **kwargs).val_dataloader()))
    images, _ = next(iter(_module(tmp_path, **kwargs).val_dataloader()))
    assert levels(images, pil[0]).amax(dim=(1, 2, 3)).max() <= 1  # measured: 1 for each of the 7 formats
    (train,) = list(_module(tmp_path, **kwargs).train_dataloader())
    assert train[0].shape == (14, 3, 32, 32) and torch.isfinite(train[0]).all()


@pytest.fixture(scope="module")
def one_per_class(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """14 classes of one image each: a batch's labels tell which files were read."""
    root = tmp_path_factory.mktemp("one_per_class")
    for split in ("train", "val"):
        for c in range(14):
            (root / split / f"c{c:02d}").mkdir(parents=True)
            Image.new("RGB", (20, 16), (c * 15, 0, 0)).save(root / split / f"c{c:02d}" / "x.jpg")
    return root


def test_two_processes_read_disjoint_shards_of_every_file(one_per_class: Path) -> None:
    dm = _module(one_per_class, batch_size=4, crop_size=16, val_resize=16)
    samples = {split: dm.samples(split) for split in ("train", "val")}
    seen = {"train": [], "val": []}
    for rank in (0, 1):
        train = EpochSeededSampler(samples["train"], seed=3, num_replicas=2, rank=rank)
        val = UnpaddedDistributedSampler(samples["val"], 2, rank)
        for split, sampler, is_train in (("train", train, True), ("val", val, False)):
            loader = DALILoader(samples[split], 4, is_train, 16, 16, (0.08, 1.0), 1, sampler=sampler)
            labels = [int(label) for _, batch_labels in loader for label in batch_labels]
            assert len(labels) == 7 and len(loader) == 2  # batches of 4 and 3
            seen[split].append(set(labels))
    for split in ("train", "val"):
        assert not seen[split][0] & seen[split][1] and seen[split][0] | seen[split][1] == set(range(14))


def test_sigkill_mid_epoch_then_resume_equals_an_uninterrupted_run(learnable_root: Path, tmp_path: Path) -> None:
    """As tests/test_resume.py, with DALI: 144 images in batches of 8, 18 steps an epoch, killed inside an epoch. The
    killed run waits 0.3 s after each step, so that the watcher reads its step checkpoints however fast DALI is and
    however loaded the machine; the wait changes nothing that is trained."""

    def args(out: Path, *extra: str) -> list[str]:
        return fit_args(
            learnable_root, out, "--data.decoder", "dali", "--trainer.max_epochs", "2", "--trainer.deterministic",
            "true", "--seed_everything", "7", "--step_checkpoint.every_n_train_steps", "1",
            "--trainer.limit_val_batches", "1", *extra,
            batch_size=8, workers=2, arch=SMALL_ARCH,
        )  # fmt: skip

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run beside the one that is killed
        whole_run = _start(args(whole), tmp_path)
        whole_output = pool.submit(whole_run.communicate, timeout=300)
        slow = tmp_path / "slow.yaml"
        slow.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.SlowSteps\n"
                        "      init_args: {seconds: 0.3}\n")  # fmt: skip
        killed = _start(args(cut, "--config", str(slow)), tmp_path)
        killed_at = kill_when(killed, cut, lambda step: step >= 4 and step % 18, timeout=300)
        out, _ = whole_output.result()
    assert whole_run.returncode == 0, out[-3000:]

    proc = _start(args(cut, "--ckpt_path", "last"), tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Resuming from" in out, out[-3000:]
    final_whole, final_cut = network(final_checkpoint(whole)), network(final_checkpoint(cut))
    assert torch.load(final_checkpoint(cut), weights_only=True)["global_step"] == 36
    different = [k for k in final_whole if not torch.equal(final_whole[k], final_cut[k])]
    assert final_whole.keys() == final_cut.keys() and not different, (killed_at, different[:5])


def test_dali_threads_come_from_the_cores_not_from_workers_and_the_loader_has_a_length(
    shapes_root: Path, monkeypatch
) -> None:
    loader = _module(shapes_root, dali_threads=3, workers=15, batch_size=5).train_dataloader()
    assert isinstance(loader, DALILoader) and loader.threads == 3 and len(loader) == 5 and loader.batch_size == 5
    for cores, threads in ((16, 8), (32, 8), (8, 4), (2, 2), (1, 2)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert _module(shapes_root, workers=15).val_dataloader().threads == threads
    with pytest.raises(ValueError, match="dali_threads must be at least 1. Got 0"):
        _module(shapes_root, dali_threads=0)


def test_predict_batches_carry_the_sample_indices(shapes_root: Path) -> None:
    dm = ImageFolderDataModule(predict_root=str(shapes_root / "val"), batch_size=4, workers=1, crop_size=32,
                               val_resize=36, decoder="dali")  # fmt: skip
    batches = list(dm.predict_dataloader())
    assert torch.equal(torch.cat([index for _, index in batches]), torch.arange(15))
    pil = ImageFolderDataModule(predict_root=str(shapes_root / "val"), batch_size=15, workers=0, crop_size=32,
                                val_resize=36)  # fmt: skip
    assert levels(torch.cat([x for x, _ in batches]), next(iter(pil.predict_dataloader()))[0]).max() <= 1


def test_batches_are_float16_for_16_bit_precisions() -> None:
    assert batch_dtype("16-mixed") == batch_dtype("16-true") == torch.float16
    assert batch_dtype("32-true") == batch_dtype("bf16-mixed") == batch_dtype(None) == torch.float32


def test_float16_batches_equal_float32_ones_rounded(shapes_root: Path) -> None:
    loader = _module(shapes_root).val_dataloader()
    full = next(iter(loader))[0]
    loader.dtype = torch.float16
    half = next(iter(loader))[0]
    assert half.dtype == torch.float16 and torch.equal(half, full.half())


def test_a_missing_dali_names_the_install_command(shapes_root: Path, monkeypatch, capsys) -> None:
    from lit_imagenet.cli import main

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # import nvidia.dali now raises ImportError
    with pytest.raises(ConfigError, match=r"needs NVIDIA DALI, which is not installed; run pip install 'lit_"):
        _module(shapes_root)
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--data.root", str(shapes_root), "--data.decoder", "dali", "--trainer.accelerator", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: --data.decoder dali needs NVIDIA DALI, which is not installed; run {dali_install_command()} "
        "or choose another --data.decoder."
    )
    assert choose_decoder(on_cuda=True)[0] == "nvjpeg"


def test_install_command_matches_the_torch_cuda_version(monkeypatch) -> None:
    for cuda, extra in (("13.0", "dali-cuda130"), ("12.8", "dali-cuda120"), (None, "dali-cuda130")):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        assert dali_install_command() == f"pip install 'lit_imagenet[{extra}]'"


def test_auto_picks_dali_on_cuda_else_pil_and_says_why(shapes_root: Path, tmp_path: Path, caplog) -> None:
    import nvidia.dali

    assert choose_decoder(on_cuda=True) == (
        "dali", f"the run is on one CUDA device and NVIDIA DALI {nvidia.dali.__version__} is installed"
    )  # fmt: skip
    assert choose_decoder(on_cuda=True, processes=2) == (
        "nvjpeg", "the run has 2 CUDA processes, where nvjpeg measured faster than dali"
    )  # fmt: skip
    assert choose_decoder(on_cuda=False) == ("pil", "the run is not on a CUDA device")
    dm = _module(shapes_root, decoder="auto")
    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=1, limit_val_batches=1,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    from lit_imagenet import ImageClassifier

    with caplog.at_level("INFO"):
        trainer.fit(ImageClassifier("resnet18", num_classes=3), dm)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decoder:")]
    assert lines == ["Decoder: pil (--data.decoder auto: the run is not on a CUDA device)."]
    assert type(trainer.train_dataloader).__name__ == "PrefetchLoader"
    caplog.clear()
    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=1, limit_val_batches=1,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    with caplog.at_level("INFO"):
        trainer.fit(ImageClassifier("resnet18", num_classes=3), _module(shapes_root, decoder="dali"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decoder:")]
    assert lines == ["Decoder: dali (--data.decoder dali)."]  # said once, for the loaders of both splits


def test_importing_the_package_does_not_import_dali() -> None:
    modules = "lit_imagenet, lit_imagenet.data.datamodule, lit_imagenet.cli"
    code = f"import sys, {modules}; print('nvidia.dali' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[1],
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}, check=True)  # fmt: skip
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["16-mixed", "32-true"])
def test_mixed_decoder_batches_on_the_gpu_and_a_short_fit(learnable_root: Path, tmp_path: Path, precision) -> None:
    """On CUDA: the ``mixed`` decoder's batches reach the model on the device, in the training dtype, channels_last,
    not normalised twice (equal to the CPU pipeline's to a few levels), and a short fit learns."""
    from lit_imagenet import ImageClassifier

    pl.seed_everything(0)  # the model's initial weights: an unseeded run can stay at chance after a few epochs
    dm = ImageFolderDataModule(str(learnable_root), batch_size=16, workers=4, crop_size=32, val_resize=36,
                               decoder="dali", seed=1)  # fmt: skip
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, lr=0.4, warmup_epochs=0, milestones=[6])
    seen: dict = {}

    class Check(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            images = batch[0]
            seen.setdefault("train", (images.device.type, images.dtype,
                                      images.is_contiguous(memory_format=torch.channels_last)))  # fmt: skip

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            seen.setdefault("val", (batch[0].detach().float().cpu(), batch[1].cpu()))

    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="gpu", devices=1, precision=precision, max_epochs=8,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         callbacks=[Check()])  # fmt: skip
    trainer.fit(model, dm)
    dtype = torch.float16 if precision == "16-mixed" else torch.float32
    assert seen["train"] == ("cuda", dtype, True)
    assert type(trainer.train_dataloader).__name__ == "DALILoader" and trainer.train_dataloader.device.type == "cuda"
    cpu_dm = ImageFolderDataModule(str(learnable_root), batch_size=16, workers=2, crop_size=32, val_resize=36,
                                   decoder="dali")  # fmt: skip
    cpu_images, cpu_targets = next(iter(cpu_dm.val_dataloader()))
    gpu_images, gpu_targets = seen["val"]
    assert torch.equal(gpu_targets, cpu_targets)
    # nvJPEG and libjpeg-turbo differ by about a grey level on average; normalising twice would be far off.
    assert ((gpu_images - cpu_images) * STD_255).abs().mean() < 3
    assert torch.isfinite(trainer.callback_metrics["train/loss_epoch"])
    assert trainer.callback_metrics["val/top1"] > 1 / 3 + 0.1


@pytest.mark.gpu
def test_the_mixed_pipeline_augments_as_the_cpu_one(shapes_root: Path) -> None:
    """On the GPU: a ta_wide epoch repeats for its seed and differs from a plain one; erasing alone erases
    ``erase_boxes``' boxes (mirrored crops included) with the normalised mean, about 0, and leaves the rest."""

    def epoch(augment: Augment | None, seed: int = 3) -> torch.Tensor:
        loader = _augmented(shapes_root, augment, seed=seed)
        loader = DALILoader(loader.samples, 6, True, 32, 36, (0.08, 1.0), 2, sampler=loader.sampler,
                            device=torch.device("cuda"), augment=augment)  # fmt: skip
        return torch.cat([x for x, _ in loader]).cpu()

    plain, policy = epoch(None), Augment(policy="ta_wide")
    first = epoch(policy)
    assert torch.equal(epoch(policy), first) and not torch.equal(first, plain)
    assert ((first - plain).abs().amax(dim=(1, 2, 3)) > 0.1).sum() >= len(plain) // 2
    erased = epoch(Augment(random_erase=1.0))
    seeds = np.array([seed for _, seed in _augmented(shapes_root, None).sampler])
    boxes = erase_boxes(seeds, 32, 32, 1.0)
    assert (boxes[:, 2] > 0).sum() >= len(boxes) - 2
    for k, (top, left, height, width) in enumerate(boxes.tolist()):
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top : top + height, left : left + width] = True
        torch.testing.assert_close(erased[k][:, ~inside], plain[k][:, ~inside], rtol=0, atol=0.02)  # a level
        assert erased[k][:, inside].abs().max() < 0.01, k


def test_loader_workers_forked_after_a_dali_pipeline_became_garbage_keep_running(shapes_root: Path) -> None:
    """A pipeline left in a garbage cycle, freed by a worker's collector, would end the worker with a segfault."""

    class Cycle:
        pass

    gc.disable()
    try:
        cycle = Cycle()
        cycle.cycle, cycle.loader = cycle, _module(shapes_root).train_dataloader()
        next(iter(cycle.loader))  # its pipelines built and running
        del cycle
        assert len(list(PrefetchLoader(_CollectsGarbage(), batch_size=2, num_workers=1))) == 2  # collects in the worker
    finally:
        gc.enable()
    gc.collect()
