"""The nvjpeg decoder's CPU-visible parts: crops, the CPU/GPU split, collation, errors; decoding runs on CPU here."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lit_imagenet.data.augment import Augment, augment_image, erase_boxes, policy_transform
from lit_imagenet.data.crops import CropBox, center_crop_box
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.images import load_rgb_tensor
from lit_imagenet.data.nvjpeg import (
    EncodedBatch,
    EncodedImage,
    EncodedImageFolderDataset,
    collate_encoded,
    gpu_share_picks,
)
from lit_imagenet.data.presets import TrainCrop
from lit_imagenet.data.samplers import EpochSeededSampler
from lit_imagenet.errors import DataError

TA_ERASE = Augment(policy="ta_wide", random_erase=0.5)


def _module(root: Path, decoder: str, **kwargs) -> ImageFolderDataModule:
    return ImageFolderDataModule(str(root), batch_size=6, workers=0, crop_size=32, val_resize=36, decoder=decoder,
                                 seed=3, **kwargs)  # fmt: skip


@pytest.mark.parametrize("share", [1.0, 0.5, 0.0])
def test_training_batches_equal_the_torchvision_decoder(shapes_root: Path, share: float) -> None:
    """Same seed, same crops and flips: on CPU the decoded batch equals the CPU decoder's up to rounding."""
    reference = next(iter(_module(shapes_root, "torchvision").train_dataloader()))
    batch = next(iter(_module(shapes_root, "nvjpeg", gpu_share=share).train_dataloader()))
    assert isinstance(batch, EncodedBatch)
    if share == 1.0:
        assert batch.decoded is None and len(batch.encoded) == 6
    if share == 0.0:
        assert not batch.encoded and batch.decoded is not None
    images, targets = batch.decode("cpu")
    assert images.dtype == torch.uint8 and images.shape == reference[0].shape
    assert torch.equal(targets, reference[1])
    # transforms.v2 resizes in uint8 arithmetic, the GPU path in float: they round a level apart at most.
    diff = (images.int() - reference[0].int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.2


def test_validation_crops_are_the_resize_and_centre_crop(shapes_root: Path) -> None:
    reference = next(iter(_module(shapes_root, "torchvision").val_dataloader()))
    images, targets = next(iter(_module(shapes_root, "nvjpeg").val_dataloader())).decode("cpu")
    assert torch.equal(targets, reference[1])
    # One crop-and-resize instead of a resize and then a crop: the edges are resampled slightly differently.
    assert (images.float() - reference[0].float()).abs().mean() < 2.0


def test_channels_last_batches_stay_channels_last(shapes_root: Path) -> None:
    images, _ = next(iter(_module(shapes_root, "nvjpeg", channels_last=True).train_dataloader())).decode("cpu")
    assert images.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(("height", "width"), [(375, 500), (500, 375), (256, 256), (300, 1200)])
def test_centre_crop_box_matches_resize_then_crop(height: int, width: int) -> None:
    box = center_crop_box(height, width, resize=256, crop=224)
    scale = 256 / min(height, width)
    assert box.height == pytest.approx(224 / scale, abs=1) and box.width == pytest.approx(224 / scale, abs=1)
    assert box.top == pytest.approx((height - box.height) / 2, abs=1)
    assert box.left == pytest.approx((width - box.width) / 2, abs=1)


def test_gpu_share_spreads_evenly() -> None:
    picked = sum(gpu_share_picks(i, 0.3) for i in range(10_000))
    assert 2_800 < picked < 3_200
    assert all(gpu_share_picks(i, 1.0) for i in range(100)) and not any(gpu_share_picks(i, 0.0) for i in range(100))


def test_files_that_are_not_jpeg_are_decoded_by_the_workers(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        folder = tmp_path / split / "a"
        folder.mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(folder / "x.png")
        Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(folder / "y.jpg", quality=90)
    dm = ImageFolderDataModule(str(tmp_path), batch_size=2, workers=0, crop_size=32, val_resize=36, decoder="nvjpeg")
    batch = next(iter(dm.val_dataloader()))
    assert [Path(e.path).name for e in batch.encoded] == ["y.jpg"] and batch.decoded_positions == [0]
    images, _ = batch.decode("cpu")
    assert images.shape == (2, 3, 32, 32)


def test_a_corrupt_jpeg_is_named(shapes_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(shapes_root, root)
    victim = sorted((root / "val").rglob("*.jpg"))[1]
    data = victim.read_bytes()
    victim.write_bytes(data[:200])  # a JPEG header, then nothing
    dm = ImageFolderDataModule(str(root), batch_size=4, workers=0, crop_size=32, val_resize=36, decoder="nvjpeg")
    with pytest.raises(DataError, match=str(victim)):
        for batch in dm.val_dataloader():
            batch.decode("cpu")


def test_collate_refuses_mixed_sizes() -> None:
    data = torch.zeros(10, dtype=torch.uint8)
    items = [
        (EncodedImage(data, CropBox(0, 0, 4, 4), 32, False, "a.jpg"), 0),
        (torch.zeros(3, 16, 16, dtype=torch.uint8), 1),
    ]
    with pytest.raises(ValueError, match="one size"):
        collate_encoded(items, torch.contiguous_format)


@pytest.mark.gpu
def test_pinning_keeps_the_batch(shapes_root: Path) -> None:
    batch = next(iter(_module(shapes_root, "nvjpeg", gpu_share=0.5).train_dataloader()))
    pinned = batch.pin_memory()
    assert pinned.targets.is_pinned() and len(pinned.encoded) == len(batch.encoded)
    assert pinned.blob.is_pinned() and torch.equal(pinned.blob, batch.blob)
    assert all(torch.equal(a.data, b.data) for a, b in zip(pinned.encoded, batch.encoded))


def test_gpu_decode_ahead_is_checked(shapes_root: Path) -> None:
    with pytest.raises(ValueError, match="gpu_decode_ahead must be at least 1. Got 0"):
        _module(shapes_root, "nvjpeg", gpu_decode_ahead=0)


def test_gpu_decode_ahead_reaches_the_loader(shapes_root: Path) -> None:
    assert _module(shapes_root, "nvjpeg", gpu_decode_ahead=4).train_dataloader().decode_ahead == 4


def test_gpu_share_is_checked(shapes_root: Path) -> None:
    with pytest.raises(ValueError, match="gpu_share"):
        _module(shapes_root, "nvjpeg", gpu_share=1.5)


def test_worker_side_decoding_matches_load_rgb_tensor(shapes_root: Path) -> None:
    dm = _module(shapes_root, "nvjpeg", gpu_share=0.0)
    dataset = EncodedImageFolderDataset(dm.samples("val"), dm.eval_transform(), False, 32, (0.08, 1.0), 36, 0.0)
    image, label = dataset[0]
    path, expected_label = dm.samples("val")[0]
    assert label == expected_label
    assert torch.equal(image, dm.eval_transform()(load_rgb_tensor(path)))


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [1, 3])
def test_prefetched_nvjpeg_batches_equal_inline_decoding(shapes_root: Path, ahead: int) -> None:
    """The prefetcher decodes in a thread of its own; the batches must be those decoded inline, in order."""
    from lit_imagenet.data.presets import Uint8Normalize

    device = torch.device("cuda")
    dm = _module(shapes_root, "nvjpeg", gpu_share=0.5, gpu_decode_ahead=ahead)
    inline = [batch.decode(device) for batch in dm.train_dataloader()]
    dm.prefetch_device = device
    prefetched = list(dm.train_dataloader())
    assert len(prefetched) == len(inline) > 2
    norm = Uint8Normalize().to(device)
    for (images, targets), (x, y) in zip(inline, prefetched):
        assert torch.equal(targets, y)
        torch.testing.assert_close(norm(images), x, rtol=0, atol=0)


@pytest.mark.gpu
def test_a_corrupt_jpeg_is_named_through_the_prefetcher(shapes_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(shapes_root, root)
    victim = sorted((root / "val").rglob("*.jpg"))[1]
    victim.write_bytes(victim.read_bytes()[:200])
    dm = ImageFolderDataModule(str(root), batch_size=4, workers=0, crop_size=32, val_resize=36, decoder="nvjpeg")
    dm.prefetch_device = torch.device("cuda")
    with pytest.raises(DataError, match=str(victim)):
        for _ in dm.val_dataloader():
            pass


@pytest.mark.timeout(120)
def test_large_encoded_batches_cross_from_workers_under_a_low_open_file_limit(tmp_path: Path) -> None:
    """Workers hand over the encoded bytes of a whole batch in one shared buffer, not one per image.

    With a buffer per image, a batch of 256 from each of 15 workers needed thousands of open file
    descriptors at once; past the limit the workers' queues failed and the loader hung.
    """
    import resource

    from lit_imagenet.data.synthetic import make_shapes

    root = make_shapes(str(tmp_path / "jpeg"), train_per_class=200, val_per_class=1, width=24, height=24,
                       num_classes=3)  # fmt: skip
    dm = ImageFolderDataModule(str(root), batch_size=300, workers=2, crop_size=16, val_resize=16, decoder="nvjpeg",
                               seed=1)  # fmt: skip
    reference = [batch.decode("cpu") for batch in _module_like(dm, workers=0).train_dataloader()]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(512, hard), hard))  # inherited by the workers
    try:
        batches = [batch.decode("cpu") for batch in dm.train_dataloader()]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(batches) == len(reference) == 2
    for (images, targets), (ref_images, ref_targets) in zip(batches, reference):
        assert torch.equal(targets, ref_targets) and torch.equal(images, ref_images)


def _module_like(dm: ImageFolderDataModule, **changes) -> ImageFolderDataModule:
    kwargs = {**dict(dm.hparams), **changes}
    return ImageFolderDataModule(**kwargs)


def test_compiled_crop_resize_equals_the_python_one() -> None:
    from lit_imagenet.data.nvjpeg import _scripted_resize_crops, resize_crops

    gen = torch.Generator().manual_seed(0)
    pictures = [torch.randint(0, 256, (3, 40 + k, 50 - k), dtype=torch.uint8, generator=gen) for k in range(6)]
    boxes = [[k, 2 * k, 30, 20 + k] for k in range(6)]
    flips = [1, 4]
    expected = resize_crops(pictures, boxes, flips, 16)
    assert expected.shape == (6, 3, 16, 16) and expected.dtype == torch.uint8
    assert torch.equal(_scripted_resize_crops()(pictures, boxes, flips, 16), expected)
    crop = pictures[4][None, :, 4:34, 8:32].float()
    by_hand = torch.nn.functional.interpolate(crop, size=[16, 16], mode="bilinear", antialias=True)
    assert torch.equal(expected[4], by_hand[0].round().clamp(0, 255).to(torch.uint8).flip(-1))


def _worker_transform(augment: Augment | None):
    """The training transform of the images the workers decode: the crop and flip, then ``augment``."""
    crop, policy = TrainCrop(32, (0.08, 1.0)), policy_transform(augment) if augment else None
    return lambda img, seed: augment_image(crop(img, seed), seed, augment, policy) if augment else crop(img, seed)


def _encoded(root: Path, augment: Augment | None, share: float = 1.0, seed: int = 3) -> tuple[EncodedBatch, list]:
    """A training batch of 10 of ``root``'s samples for the nvjpeg decoder, and their ``(index, seed)`` pairs."""
    samples = _module(root, "nvjpeg").samples("train")
    sampler = EpochSeededSampler(samples, seed=seed)
    sampler.set_epoch(1)
    pairs = list(sampler)[:10]
    dataset = EncodedImageFolderDataset(samples, _worker_transform(augment), True, 32, (0.08, 1.0), 36, share,
                                        augment=augment)  # fmt: skip
    return collate_encoded([dataset[pair] for pair in pairs], torch.contiguous_format), pairs


def _augmented_by_hand(plain: torch.Tensor, pairs: list, augment: Augment) -> torch.Tensor:
    policy = policy_transform(augment)
    return torch.stack([augment_image(img, seed, augment, policy) for img, (_, seed) in zip(plain, pairs)])


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_gpu_decoded_images_get_their_seeds_augmentation_once(shapes_root: Path, share: float) -> None:
    """Decoded here on the CPU: each GPU-decoded crop is ``augment_image`` of the plain crop with the sample's seed;
    a worker-decoded one keeps the workers' augmentation, applied once."""
    batch, pairs = _encoded(shapes_root, TA_ERASE, share)
    plain, _ = _encoded(shapes_root, None, share)[0].decode("cpu")
    images, _ = batch.decode("cpu")
    assert batch.augment == TA_ERASE and len(batch.seeds) == len(batch.encoded_positions) > 0
    gpu = batch.encoded_positions
    assert torch.equal(images[gpu], _augmented_by_hand(plain, pairs, TA_ERASE)[gpu])
    if share < 1.0:
        assert batch.decoded_positions and torch.equal(images[batch.decoded_positions], batch.decoded)
        assert not torch.equal(batch.decoded, plain[batch.decoded_positions])  # the workers augmented them
    assert ((images.int() - plain.int()).abs().amax(dim=(1, 2, 3)) > 8).sum() >= len(plain) // 2
    assert torch.equal(_encoded(shapes_root, TA_ERASE, share)[0].decode("cpu")[0], images)
    assert not torch.equal(_encoded(shapes_root, TA_ERASE, share, seed=4)[0].decode("cpu")[0], images)


def test_a_seed_gets_the_same_policy_decoded_by_the_gpu_path_or_by_a_worker(shapes_root: Path) -> None:
    """The same crops, decoded on the GPU path (here on the CPU) and by the workers, get the same policy draws:
    they differ by the resize's rounding alone, far less than the same crops with other draws."""
    augment = Augment(policy="ta_wide")
    gpu, _ = _encoded(shapes_root, augment, 1.0)[0].decode("cpu")
    workers, _ = _encoded(shapes_root, augment, 0.0)[0].decode("cpu")
    plain, pairs = _encoded(shapes_root, None, 0.0)
    other = _augmented_by_hand(plain.decode("cpu")[0], [(i, seed + 1) for i, seed in pairs], augment)
    near = (gpu.float() - workers.float()).abs().mean(dim=(1, 2, 3))
    far = (gpu.float() - other.float()).abs().mean(dim=(1, 2, 3))
    assert near.max() < 1.0 and far.mean() > 10 * near.mean(), (near, far)


def test_erasing_gpu_decoded_images_fills_erase_boxes_with_the_mean(shapes_root: Path) -> None:
    augment = Augment(random_erase=1.0)
    batch, pairs = _encoded(shapes_root, augment)
    plain, _ = _encoded(shapes_root, None)[0].decode("cpu")
    images, _ = batch.decode("cpu")
    boxes = erase_boxes([seed for _, seed in pairs], 32, 32, 1.0)
    assert (boxes[:, 2] > 0).sum() >= len(boxes) - 2
    fill = torch.tensor(augment.fill, dtype=torch.uint8)[:, None]
    for k, (top, left, height, width) in enumerate(boxes.tolist()):
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top : top + height, left : left + width] = True
        assert torch.equal(images[k][:, ~inside], plain[k][:, ~inside]), k
        assert torch.equal(images[k][:, inside], fill.expand(3, int(inside.sum()))), k


@pytest.mark.gpu
def test_cuda_decoded_images_get_their_seeds_augmentation(shapes_root: Path) -> None:
    """On the GPU: an augmented batch repeats for its seed, differs from a plain one, is ``augment_image`` of the
    plain crops with the samples' seeds (the same draws as on the CPU), and erasing alone fills ``erase_boxes``."""
    cuda = torch.device("cuda")
    batch, pairs = _encoded(shapes_root, TA_ERASE)
    plain, _ = _encoded(shapes_root, None)[0].decode(cuda)
    images, _ = batch.decode(cuda)
    assert torch.equal(images, _augmented_by_hand(plain, pairs, TA_ERASE))
    assert torch.equal(_encoded(shapes_root, TA_ERASE)[0].decode(cuda)[0], images)
    assert ((images.int() - plain.int()).abs().amax(dim=(1, 2, 3)) > 8).sum() >= len(plain) // 2
    # The same draws on either device: the CUDA crops augmented on the CPU differ by the kernels' rounding only.
    by_cpu = _augmented_by_hand(plain.cpu(), pairs, TA_ERASE)
    assert (images.cpu().float() - by_cpu.float()).abs().mean(dim=(1, 2, 3)).max() < 2
    erase = Augment(random_erase=1.0)
    erased, _ = _encoded(shapes_root, erase)[0].decode(cuda)
    boxes = erase_boxes([seed for _, seed in pairs], 32, 32, 1.0)
    fill = torch.tensor(erase.fill, dtype=torch.uint8, device=cuda)[:, None]
    for k, (top, left, height, width) in enumerate(boxes.tolist()):
        inside = torch.zeros(32, 32, dtype=torch.bool, device=cuda)
        inside[top : top + height, left : left + width] = True
        assert torch.equal(erased[k][:, ~inside], plain[k][:, ~inside]), k
        assert torch.equal(erased[k][:, inside], fill.expand(3, int(inside.sum()))), k


@pytest.mark.gpu
def test_prefetched_augmented_nvjpeg_batches_equal_inline_decoding(shapes_root: Path) -> None:
    """The prefetcher decodes in its thread and augments in the training thread: the batches are those decoded and
    augmented inline, in order."""
    from functools import partial

    from lit_imagenet.data.prefetch import PrefetchLoader
    from lit_imagenet.data.presets import Uint8Normalize

    cuda = torch.device("cuda")
    samples = _module(shapes_root, "nvjpeg").samples("train")

    def loader(device: torch.device | None) -> PrefetchLoader:
        sampler = EpochSeededSampler(samples, seed=3)
        dataset = EncodedImageFolderDataset(samples, _worker_transform(TA_ERASE), True, 32, (0.08, 1.0), 36, 0.5,
                                            augment=TA_ERASE)  # fmt: skip
        collate = partial(collate_encoded, memory_format=torch.contiguous_format)
        return PrefetchLoader(dataset, batch_size=6, sampler=sampler, collate_fn=collate, device=device)

    inline = [batch.decode(cuda) for batch in loader(None)]
    prefetched = list(loader(cuda))
    assert len(prefetched) == len(inline) == 4
    norm = Uint8Normalize().to(cuda)
    for (images, targets), (x, y) in zip(inline, prefetched):
        assert torch.equal(targets, y)
        torch.testing.assert_close(norm(images), x, rtol=0, atol=0)
