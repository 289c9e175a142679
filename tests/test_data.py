import gc
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image

from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.datasets import collate_uint8
from lit_imagenet.data.images import load_rgb, load_rgb_tensor
from lit_imagenet.data.prefetch import PrefetchLoader
from lit_imagenet.data.samplers import UnpaddedDistributedSampler
from lit_imagenet.errors import DataError
from lit_imagenet.training.module import ImageClassifier


def reference_fast_collate(batch, memory_format):
    """The example's fast_collate, restated: PIL images to a uint8 NCHW tensor in memory_format."""
    targets = torch.tensor([t for _, t in batch], dtype=torch.int64)
    w, h = batch[0][0].size
    out = torch.zeros((len(batch), 3, h, w), dtype=torch.uint8).contiguous(memory_format=memory_format)
    for i, (img, _) in enumerate(batch):
        arr = np.asarray(img, dtype=np.uint8)
        if arr.ndim < 3:
            arr = np.expand_dims(arr, axis=-1)
        out[i] += torch.from_numpy(np.rollaxis(arr, 2))
    return out, targets


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_collate_equals_reference(memory_format: torch.memory_format) -> None:
    rng = np.random.default_rng(0)
    batch = [(Image.fromarray(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)), t) for t in (3, 0, 7)]
    images, targets = collate_uint8(batch, memory_format)
    ref_images, ref_targets = reference_fast_collate(batch, memory_format)
    assert images.dtype == torch.uint8 and images.shape == (3, 3, 12, 20)
    assert torch.equal(images, ref_images) and torch.equal(targets, ref_targets)
    assert images.is_contiguous(memory_format=memory_format)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_collate_of_uint8_tensors_is_in_the_memory_format_asked_for(memory_format: torch.memory_format) -> None:
    """torchvision's images are (3, H, W) tensors, whose (H, W, 3) views numpy stacks in their own layout."""
    images = [torch.randint(0, 256, (3, 6, 5), dtype=torch.uint8) for _ in range(4)]
    batch, targets = collate_uint8([(image, k) for k, image in enumerate(images)], memory_format)
    assert batch.is_contiguous(memory_format=memory_format) and torch.equal(batch, torch.stack(images))
    assert targets.tolist() == [0, 1, 2, 3]


def test_collate_refuses_images_of_different_sizes() -> None:
    batch = [(Image.new("RGB", (8, 8)), 0), (Image.new("RGB", (9, 8)), 1)]
    with pytest.raises(ValueError, match="one size"):
        collate_uint8(batch)


@pytest.mark.parametrize("mode", ["L", "P", "CMYK", "RGBA", "PNG-P-transparent"])
def test_images_of_any_mode_become_rgb(tmp_path: Path, mode: str) -> None:
    if mode == "PNG-P-transparent":
        img = Image.new("P", (10, 6), 3)
        img.info["transparency"] = 3
        path = tmp_path / "t.png"
        img.save(path, transparency=3)
    else:
        img = Image.new(mode, (10, 6))
        path = tmp_path / ("x.jpg" if mode in ("L", "CMYK") else "x.png")
        img.save(path)
    out = load_rgb(str(path))
    assert out.mode == "RGB" and out.size == (10, 6)


@pytest.mark.parametrize("loader", [load_rgb, load_rgb_tensor], ids=["pil", "torchvision"])
@pytest.mark.parametrize("content", [b"", b"not an image at all", "truncated"])
def test_undecodable_image_names_the_file(tmp_path: Path, content, loader) -> None:
    path = tmp_path / "bad.jpg"
    if content == "truncated":
        Image.new("RGB", (64, 64), (200, 10, 10)).save(path, quality=90)
        path.write_bytes(path.read_bytes()[:300])
    else:
        path.write_bytes(content)
    with pytest.raises(DataError, match="bad.jpg"):
        loader(str(path))


def test_datamodule_reads_classes_and_batches(shapes_root: Path) -> None:
    dm = ImageFolderDataModule(str(shapes_root), batch_size=4, workers=0, crop_size=32, val_resize=36)
    assert dm.num_classes == 3 and dm.classes == ["circle", "square", "triangle"]
    assert dm.class_to_idx == {"circle": 0, "square": 1, "triangle": 2}
    images, targets = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)
    assert targets.dtype == torch.int64
    val = [t for _, t in dm.val_dataloader()]
    assert sum(len(t) for t in val) == 15


def _make_split(root: Path, split: str, classes: dict[str, int]) -> None:
    for name, count in classes.items():
        folder = root / split / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(folder / f"{i}.png")


@pytest.mark.parametrize(
    "layout, message",
    [
        ("no_root", "does not exist"),
        ("no_val", "val does not exist"),
        ("empty_class", "holds no images"),
        ("mismatch", "different class folders"),
        ("stray_file", "is not an image file"),
        ("no_classes", "has no class folders"),
    ],
)
def test_bad_layouts_are_refused_before_training(tmp_path: Path, layout: str, message: str) -> None:
    root = tmp_path / "data"
    if layout != "no_root":
        _make_split(root, "train", {"a": 2, "b": 2})
        if layout != "no_val":
            _make_split(root, "val", {"a": 1, "c": 1} if layout == "mismatch" else {"a": 1, "b": 1})
    if layout == "empty_class":
        (root / "train" / "c").mkdir()
        (root / "val" / "c").mkdir()
    if layout == "stray_file":
        (root / "train" / "a" / "notes.txt").write_text("hello")
    if layout == "no_classes":
        for p in (root / "val").iterdir():
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
    with pytest.raises(DataError, match=message):
        ImageFolderDataModule(str(root), workers=0)


def test_hidden_files_are_not_data(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _make_split(root, "train", {"a": 2, "b": 2})
    _make_split(root, "val", {"a": 1, "b": 1})
    (root / "train" / "a" / ".DS_Store").write_bytes(b"\0")
    assert len(ImageFolderDataModule(str(root), workers=0).samples("train")) == 4


def test_verify_images_finds_a_corrupt_file_up_front(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _make_split(root, "train", {"a": 2, "b": 2})
    _make_split(root, "val", {"a": 1, "b": 1})
    (root / "val" / "b" / "broken.png").write_bytes(b"\x89PNG garbage")
    ImageFolderDataModule(str(root), workers=0)  # found only when read
    with pytest.raises(DataError, match="broken.png"):
        ImageFolderDataModule(str(root), workers=0, verify_images=True)


@pytest.mark.parametrize("split", ["train", "val", "predict"])
def test_an_empty_file_is_refused_by_the_scan_with_the_decode_error(tmp_path: Path, split: str) -> None:
    root = tmp_path / "data"
    _make_split(root, "train", {"a": 2, "b": 2})
    _make_split(root, "val", {"a": 1, "b": 1})
    _make_split(root, "predict", {"a": 1})
    empty = root / split / "a" / "empty.jpg"
    empty.write_bytes(b"")
    with pytest.raises(DataError) as scanned:  # without verify_images, before any image is read
        if split == "predict":
            ImageFolderDataModule(predict_root=str(root / "predict"), workers=0)
        else:
            ImageFolderDataModule(str(root), workers=0)
    with pytest.raises(DataError) as read:
        load_rgb(str(empty))
    for err in (scanned, read):  # the same sentence as for any undecodable image
        assert str(err.value).startswith(f"Cannot decode image {empty} (")
        assert str(err.value).endswith("); replace or remove the file.")
    assert "0 bytes" in str(scanned.value)


def test_a_link_to_a_missing_file_is_refused_by_the_scan(tmp_path: Path) -> None:
    root = tmp_path / "data"
    _make_split(root, "train", {"a": 2, "b": 2})
    _make_split(root, "val", {"a": 1, "b": 1})
    gone = root / "train" / "a" / "gone.jpg"
    gone.symlink_to(tmp_path / "nowhere.jpg")
    with pytest.raises(DataError, match=f"^Image {gone} is a broken link; replace or remove it.$"):
        ImageFolderDataModule(str(root), workers=0)


def test_an_empty_file_stops_the_command_line_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from lit_imagenet.cli import main

    root = tmp_path / "data"
    _make_split(root, "train", {"a": 2, "b": 2})
    _make_split(root, "val", {"a": 1, "b": 1})
    (root / "train" / "b" / "empty.png").write_bytes(b"")
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--data.root", str(root), "--trainer.default_root_dir", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: Cannot decode image {root / 'train' / 'b' / 'empty.png'} (an empty file: 0 bytes); "
        "replace or remove the file."
    )


@pytest.mark.parametrize("n, world", [(15, 2), (13, 4), (3, 4), (8, 2)])
def test_unpadded_sampler_sees_every_sample_once(n: int, world: int) -> None:
    dataset = list(range(n))
    shards = [list(UnpaddedDistributedSampler(dataset, world, r)) for r in range(world)]
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert [len(UnpaddedDistributedSampler(dataset, world, r)) for r in range(world)] == [len(s) for s in shards]


@pytest.mark.parametrize("mode", ["L", "P", "CMYK", "RGBA"])
def test_torchvision_decoder_gives_rgb_uint8_tensors(tmp_path: Path, mode: str) -> None:
    path = tmp_path / ("x.jpg" if mode in ("L", "CMYK") else "x.png")
    Image.new(mode, (10, 6)).save(path)
    out = load_rgb_tensor(str(path))
    assert out.dtype == torch.uint8 and out.shape == (3, 6, 10)


def test_torchvision_decoder_matches_pil_batches(shapes_root: Path) -> None:
    kwargs = dict(batch_size=15, workers=0, crop_size=32, val_resize=36)
    pil = next(iter(ImageFolderDataModule(str(shapes_root), **kwargs).val_dataloader()))
    tv = next(iter(ImageFolderDataModule(str(shapes_root), decoder="torchvision", **kwargs).val_dataloader()))
    assert tv[0].dtype == torch.uint8 and tv[0].shape == pil[0].shape
    assert torch.equal(tv[1], pil[1])
    # Two JPEG decoders and two antialiased resizes: equal up to a few levels of 255.
    assert (tv[0].float() - pil[0].float()).abs().mean() < 4.0


def test_torchvision_decoder_augments_reproducibly_per_sample(shapes_root: Path) -> None:
    dm = ImageFolderDataModule(str(shapes_root), batch_size=6, workers=0, crop_size=24, val_resize=36,
                               decoder="torchvision", seed=5)  # fmt: skip
    first = next(iter(dm.train_dataloader()))
    again = next(iter(ImageFolderDataModule(str(shapes_root), batch_size=6, workers=0, crop_size=24, val_resize=36,
                                            decoder="torchvision", seed=5).train_dataloader()))  # fmt: skip
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_every_decoder_cuts_the_crop_and_flip_of_the_crop_rule(shapes_root: Path) -> None:
    """pil and torchvision (TrainCrop), nvjpeg's workers and DALI's external source: one box and flip per seed."""
    from torchvision.transforms.v2 import functional as F

    from lit_imagenet.data.crops import crop_and_flip
    from lit_imagenet.data.dali.pipeline import CropSource
    from lit_imagenet.data.images import image_size

    def module(decoder: str) -> ImageFolderDataModule:
        return ImageFolderDataModule(str(shapes_root), batch_size=4, workers=0, crop_size=24, val_resize=36,
                                     crop_scale=(0.2, 0.9), decoder=decoder, seed=11)  # fmt: skip

    order = list(module("pil").train_dataloader().sampler)[:8]
    paths = [module("pil").samples("train")[i][0] for i, _ in order]
    sizes = np.array([image_size(p) for p in paths], dtype=np.int32)
    rule = [crop_and_flip(int(h), int(w), seed, (0.2, 0.9)) for (h, w), (_, seed) in zip(sizes, order)]
    assert len({box for box, _ in rule}) == len(rule) and {flip for _, flip in rule} == {True, False}
    for decoder, load in (("pil", load_rgb), ("torchvision", load_rgb_tensor)):
        dataset = module(decoder).train_dataloader().dataset
        for item, path, (box, flip) in zip(order, paths, rule):
            want = F.resized_crop(load(path), box.top, box.left, box.height, box.width, [24, 24], antialias=True)
            want = F.horizontal_flip(want) if flip else want
            got = dataset[item][0]
            assert np.array_equal(np.asarray(got), np.asarray(want)), (decoder, path)
    nvjpeg = module("nvjpeg").train_dataloader().dataset
    assert [(nvjpeg[item][0].box, nvjpeg[item][0].flip) for item in order] == rule
    picked = np.array([i for i, _ in order])
    where = {int(i): k for k, i in enumerate(picked)}
    source = CropSource(picked, np.array([seed for _, seed in order], dtype=np.uint64),
                        lambda rows: sizes[[where[int(i)] for i in rows]], 8, (0.2, 0.9))  # fmt: skip
    anchor, shape, mirror = source(0)
    dali = [((int(y), int(x), int(h), int(w)), bool(m)) for (x, y), (w, h), m in zip(anchor, shape, mirror)]
    assert dali == [(tuple(box), flip) for box, flip in rule]


def _loader_workers() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.parametrize("persistent", [False, True])
def test_evaluation_workers_stop_at_the_last_batch_unless_persistent(shapes_root: Path, persistent: bool) -> None:
    """Lightning reads a pass by count and never asks for one batch more: the loader must stop its workers itself."""
    dm = ImageFolderDataModule(str(shapes_root), batch_size=4, workers=2, crop_size=16, val_resize=18,
                               persistent_eval_workers=persistent)  # fmt: skip
    loader = dm.val_dataloader()
    assert not _loader_workers()
    batches = iter(loader)
    read = [next(batches) for _ in range(len(loader))]  # 15 images: 4 batches, the iterator not run out
    assert len(_loader_workers()) == (2 if persistent else 0)
    again = list(loader)  # and the next pass reads the same batches
    assert len(read) == len(again) == 4
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(read, again))
    del batches, loader


@pytest.mark.parametrize("limit_val_batches", [1.0, 1])
def test_training_runs_without_the_evaluation_workers_by_default(
    shapes_root: Path, tmp_path: Path, limit_val_batches: float
) -> None:
    """After the sanity check and each validation, whole or cut short, training runs with its own workers alone."""
    counted: list[int] = []

    class CountWorkers(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
            counted.append(len(_loader_workers()))

    dm = ImageFolderDataModule(str(shapes_root), batch_size=8, workers=2, crop_size=16, val_resize=18)
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, lr=0.01, warmup_epochs=0, milestones=[])
    trainer = pl.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=limit_val_batches, accelerator="cpu",
                         num_sanity_val_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[CountWorkers()], default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, dm)
    assert counted == [2, 2, 2, 2]  # the sanity check's and epoch 0's validation workers stopped


class _FreedCycle:
    """An object in a garbage cycle whose destructor writes down the process that ran it."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.cycle = self

    def __del__(self) -> None:
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


class _CollectsGarbage(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()
        return torch.tensor(i)


def _freed_by(log: Path, forks: Callable[[], object]) -> list[str]:
    """The processes that ran the destructor of a garbage cycle left uncollected while ``forks`` forked."""
    gc.disable()
    try:
        _FreedCycle(log)
        forks()
    finally:
        gc.enable()
    gc.collect()
    return log.read_text().split()


def test_loader_workers_leave_the_parents_garbage_alone(tmp_path: Path) -> None:
    """A worker's collector must not free the parent's cycles: a DALI pipeline's destructor there ends the worker."""
    loader = PrefetchLoader(_CollectsGarbage(), batch_size=2, num_workers=1)
    assert _freed_by(tmp_path / "freed", lambda: list(loader)) == [str(os.getpid())]


def test_on_cuda_the_prefetcher_pins_and_the_loader_starts_no_pin_thread(shapes_root: Path) -> None:
    """DataLoader's pin thread would pin every batch the workers hand over; the prefetcher pins only those it copies."""
    data = list(range(4))
    on_cuda = PrefetchLoader(data, batch_size=2, pin_memory=True, device="cuda")
    assert on_cuda.pins_in_prefetcher and on_cuda.pin_memory is False
    plain = PrefetchLoader(data, batch_size=2, pin_memory=True)
    assert not plain.pins_in_prefetcher and plain.pin_memory is True
    unpinned = PrefetchLoader(data, batch_size=2, pin_memory=False, device="cuda")
    assert not unpinned.pins_in_prefetcher and unpinned.pin_memory is False

    dm = ImageFolderDataModule(str(shapes_root), batch_size=4, workers=0, crop_size=32, val_resize=36)
    dm.prefetch_device = torch.device("cuda")  # as CUDAPrefetch sets it on a CUDA run
    assert all(loader.pins_in_prefetcher for loader in (dm.train_dataloader(), dm.val_dataloader()))
    dm = ImageFolderDataModule(str(shapes_root), batch_size=4, workers=0, crop_size=32, pin_memory=False)
    dm.prefetch_device = torch.device("cuda")
    assert not dm.train_dataloader().pins_in_prefetcher
