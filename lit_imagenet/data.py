"""ImageFolder data for image classification, collated as uint8 and checked before training.

``root`` holds ``train/`` and ``val/`` (and optionally ``test/``), each with one folder of images
per class. The folders are scanned when the data module is built, so a missing split, an empty
class folder, an empty file or one that is not an image, or train and val splits with different
classes stop the run before any training starts. An image that cannot be decoded raises
``DataError`` naming the file, whether ``verify_images`` finds it up front or a loader worker finds
it on first read.

Batches are collated as uint8 ``(N, 3, H, W)`` tensors in the requested memory format, as NVIDIA
apex's ImageNet example did (its ``fast_collate``): conversion to float and normalisation happen on
the GPU (``lit_imagenet.prefetch``), not in the workers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from PIL import Image
from pytorch_lightning.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler
from torchvision import transforms
from torchvision.transforms import v2 as transforms_v2

from lit_imagenet.dali import DALILoader, batch_dtype, choose_decoder, import_dali
from lit_imagenet.errors import DataError, undecodable_image
from lit_imagenet.gpu_decode import (
    EncodedBatch,
    EncodedImage,
    center_crop_box,
    collate_encoded,
    decode_rgb_bytes,
    gpu_decodable,
    gpu_share_picks,
    jpeg_size,
    random_crop_box,
    read_bytes,
)
from lit_imagenet.prefetch import IMAGENET_MEAN, IMAGENET_STD, PrefetchLoader

DECODERS = ("pil", "torchvision", "nvjpeg", "dali", "auto")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _image_files(folder: Path) -> list[Path]:
    """Every image under ``folder``, sorted; an empty file or a non-image is an error (hidden files are not data)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not _is_hidden(d))
        for name in sorted(filenames):
            if _is_hidden(name):
                continue
            path = Path(dirpath) / name
            if path.suffix.lower() not in IMAGE_EXTENSIONS:
                raise DataError(
                    f"{path} is not an image file (expected one of {', '.join(IMAGE_EXTENSIONS)}); "
                    "move it out of the data folder."
                )
            try:
                size = path.stat().st_size
            except OSError as err:  # a broken link
                raise undecodable_image(path, f"{type(err).__name__}: {err.strerror}") from None
            if size == 0:
                raise undecodable_image(path, "an empty file: 0 bytes")
            found.append(path)
    return found


def scan_split(split_dir: str | Path) -> tuple[list[str], list[tuple[str, int]]]:
    """The class names of an ImageFolder split and its ``(path, class index)`` samples.

    Raises:
        DataError: The folder is missing, has no class folders, or a class folder holds no image,
            a file that is not an image, or an empty file.
    """
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DataError(f"Data folder {split_dir} does not exist; create it with one sub-folder of images per class.")
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not _is_hidden(e.name))
    if not classes:
        raise DataError(f"{split_dir} has no class folders; put the images of each class in a sub-folder of it.")
    samples: list[tuple[str, int]] = []
    for index, name in enumerate(classes):
        files = _image_files(split_dir / name)
        if not files:
            raise DataError(f"Class folder {split_dir / name} holds no images; add images or remove the folder.")
        samples.extend((str(p), index) for p in files)
    return classes, samples


def check_same_classes(train_dir: Path, train: Sequence[str], other_dir: Path, other: Sequence[str]) -> None:
    """Refuses two splits whose class folders differ: their label indices would not match."""
    if list(train) == list(other):
        return
    only_train = sorted(set(train) - set(other))
    only_other = sorted(set(other) - set(train))
    parts = []
    if only_train:
        parts.append(f"only in {train_dir}: {', '.join(only_train[:10])}{' ...' if len(only_train) > 10 else ''}")
    if only_other:
        parts.append(f"only in {other_dir}: {', '.join(only_other[:10])}{' ...' if len(only_other) > 10 else ''}")
    raise DataError(
        f"{train_dir} and {other_dir} have different class folders ({'; '.join(parts)}); "
        "both splits need the same class folders."
    )


def load_rgb(path: str) -> Image.Image:
    """Opens an image as 8-bit RGB (grayscale, palette, CMYK and alpha images included).

    Raises:
        DataError: The file cannot be read or decoded; the message names it.
    """
    try:
        with open(path, "rb") as f:
            img = Image.open(f)
            if img.mode == "P" and "transparency" in img.info:
                img = img.convert("RGBA")
            return img.convert("RGB")
    except Exception as err:  # PIL raises many types for bad files; all mean the same to the user
        raise undecodable_image(path, f"{type(err).__name__}: {err}") from None


_TORCHVISION_DECODES = (".jpg", ".jpeg", ".png", ".webp")


def load_rgb_tensor(path: str) -> Tensor:
    """Decodes an image with ``torchvision.io`` into a uint8 ``(3, H, W)`` tensor (PIL for other formats).

    ``torchvision.io`` decodes JPEG with libjpeg-turbo straight into a tensor, and the random crop
    and resize then run on uint8 tensors: no PIL image is made.

    Raises:
        DataError: The file cannot be read or decoded; the message names it.
    """
    if Path(path).suffix.lower() not in _TORCHVISION_DECODES:
        return torch.from_numpy(np.asarray(load_rgb(path), dtype=np.uint8).copy()).permute(2, 0, 1)
    return decode_rgb_bytes(read_bytes(path), path)


def verify_image_files(paths: Sequence[str], workers: int = 8) -> None:
    """Decodes every image once, in threads, and raises ``DataError`` for the first that fails."""

    def check(path: str) -> None:
        load_rgb(path)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for _ in pool.map(check, paths):
            pass


@contextmanager
def seeded_rng(seed: int | None) -> Iterator[None]:
    """Draws inside come from torch's CPU generator seeded with ``seed``; its state is restored after.

    torchvision's random transforms draw from that global generator: seeding it per sample makes
    the augmentation independent of worker count, order and restarts. Only the CPU generator is
    seeded (``torch.manual_seed`` also seeds every device, and is 15x slower). ``None``: the draws
    come from the generator as it is, and advance it.
    """
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


class ImageFolderDataset(Dataset):
    """``(image, class index)`` pairs from scanned samples, each image opened with ``load_rgb``.

    Args:
        samples: ``(path, class index)`` pairs.
        transform: Applied to each image.
        loader: Opens a path: ``load_rgb`` (a PIL image) or ``load_rgb_tensor`` (a uint8 tensor).
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        transform: Callable[[Any], Any] | None = None,
        loader: Callable[[str], Any] = load_rgb,
    ):
        self.samples = list(samples)
        self.transform = transform
        self.loader = loader

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[Any, int]:
        """``item`` is an index, or ``(index, seed)`` from ``EpochSeededSampler`` to fix the augmentation."""
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, target = self.samples[index]
        img = self.loader(path)
        if self.transform is not None:
            with seeded_rng(seed):
                img = self.transform(img)
        return img, target


class EncodedImageFolderDataset(ImageFolderDataset):
    """Samples for GPU decoding: ``(EncodedImage, class index)``, or a worker-decoded crop for the rest.

    A JPEG picked by ``gpu_share`` is only read and its header parsed; the crop box and flip are
    drawn with the same random draws as ``transform`` makes on the CPU paths (RandomResizedCrop,
    then the flip), so a seed gives the same crop either way. Other files, and the JPEGs left to the
    workers, are decoded with ``load_rgb_tensor`` and transformed here.

    Args:
        samples: ``(path, class index)`` pairs.
        transform: The CPU transform for the images decoded here.
        train: Random crop and flip (training) or resize and centre crop (evaluation).
        crop_size: Side of the output images.
        crop_scale: Range of the crop's area, as for RandomResizedCrop.
        val_resize: Short side before the evaluation centre crop.
        gpu_share: Fraction of the images decoded on the GPU.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        transform: Callable[[Any], Any],
        train: bool,
        crop_size: int,
        crop_scale: tuple[float, float],
        val_resize: int,
        gpu_share: float = 1.0,
    ) -> None:
        super().__init__(samples, transform, load_rgb_tensor)
        self.train = train
        self.crop_size = crop_size
        self.crop_scale = crop_scale
        self.val_resize = val_resize
        self.gpu_share = gpu_share

    def __getitem__(self, item: int | tuple[int, int]) -> tuple[Any, int]:
        index, seed = item if isinstance(item, tuple) else (item, None)
        path, target = self.samples[index]
        if not gpu_share_picks(index, self.gpu_share):
            return super().__getitem__(item)
        data = read_bytes(path)
        if not gpu_decodable(data):
            return super().__getitem__(item)
        height, width = jpeg_size(data, path)
        if not self.train:
            box = center_crop_box(height, width, self.val_resize, self.crop_size)
            return EncodedImage(data, box, self.crop_size, False, path), target
        with seeded_rng(seed):  # the draws of RandomResizedCrop, then of the flip, as on the CPU paths
            box = random_crop_box(height, width, self.crop_scale)
            flip = bool(torch.rand(1) < 0.5)
        return EncodedImage(data, box, self.crop_size, flip, path), target


def collate_uint8(
    batch: Sequence[tuple[Any, int]], memory_format: torch.memory_format = torch.contiguous_format
) -> list[Tensor]:
    """Stacks PIL images (or uint8 ``(3, H, W)`` tensors) and targets into ``[uint8 (N, 3, H, W), int64 (N,)]``.

    All images of a batch must have the same size. With ``torch.channels_last`` the images are
    written straight into an NHWC buffer, which is what channels_last means, so no copy is needed.
    """
    if not batch:
        raise ValueError("Cannot collate an empty batch.")
    targets = torch.tensor([int(t) for _, t in batch], dtype=torch.int64)
    arrays = [_hwc_uint8(img) for img, _ in batch]
    shape = arrays[0].shape
    for i, a in enumerate(arrays):
        if a.shape != shape:
            raise ValueError(f"All images of a batch need one size. Image 0 is {shape}, image {i} is {a.shape}")
    nhwc = torch.from_numpy(np.stack(arrays))
    images = nhwc.permute(0, 3, 1, 2)
    if memory_format != torch.channels_last:
        images = images.contiguous(memory_format=memory_format)
    return [images, targets]


def _hwc_uint8(img: Any) -> np.ndarray:
    if isinstance(img, Tensor):
        if img.dtype != torch.uint8 or img.ndim != 3:
            raise ValueError(f"Expected uint8 (C, H, W) image tensors. Got {img.dtype} of shape {tuple(img.shape)}")
        return img.permute(1, 2, 0).numpy()
    array = np.asarray(img, dtype=np.uint8)
    if array.ndim == 2:
        array = array[:, :, None]
    return array


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of sample ``index`` in ``epoch`` of a run seeded with ``seed``."""
    return (((seed & 0xFFFFFFFF) * 1_000_003 + epoch) * 1_000_003 + index) & 0x7FFFFFFFFFFFFFFF


class EpochSeededSampler(DistributedSampler):
    """Training order fixed by ``(seed, epoch)``, resumable part-way through an epoch.

    It yields ``(index, augmentation seed)`` pairs, so that a sample's crop and flip depend only on
    the seed, the epoch and the sample, not on which worker loads it or whether the run restarted.
    Like ``DistributedSampler`` it shards (and pads) across ``num_replicas`` processes; with one
    process it is a seeded shuffle. ``resume_at`` makes the next pass over ``epoch`` start after the
    samples already trained on, so a run killed mid-epoch continues with the very same batches.

    Args:
        dataset: The training dataset.
        seed: Seed of the order and of the augmentation.
        num_replicas: Number of processes.
        rank: This process's rank.
    """

    def __init__(self, dataset: Dataset, seed: int, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self._resume: tuple[int, int] | None = None

    def resume_at(self, epoch: int, samples_done: int) -> None:
        """Sets the epoch, and skips its first ``samples_done`` samples in the next pass only."""
        self.set_epoch(epoch)
        self._resume = (epoch, samples_done)

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        indices = list(super().__iter__())
        start = 0
        if self._resume is not None and self._resume[0] == self.epoch:
            start = self._resume[1]
        self._resume = None
        epoch, seed = self.epoch, self.seed
        return iter([(i, sample_seed(seed, epoch, i)) for i in indices[start:]])


def resume_position(trainer: pl.Trainer, batches_per_epoch: int) -> tuple[int, int]:
    """``(epoch, batches already trained in it)`` for a run restored from a checkpoint (``(0, 0)`` otherwise).

    Read from the fit loop's restored progress, which Lightning loads before it asks for the loader.
    """
    loop = trainer.fit_loop
    if not loop.restarting:
        return trainer.current_epoch, 0
    epoch = max(loop.epoch_progress.current.started - 1, 0)
    done = loop.epoch_loop.batch_progress.current.processed
    if done >= batches_per_epoch:
        return epoch + 1, 0
    return epoch, done


class UnpaddedDistributedSampler(DistributedSampler):
    """Gives each rank every ``num_replicas``-th sample, without padding the shards to one length.

    ``DistributedSampler`` repeats samples so that every rank gets as many; that biases validation
    metrics whenever the split does not divide by the number of processes. Here the shards differ
    by at most one sample and every sample is seen exactly once, so summed metrics are exact.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(rank, len(dataset), num_replicas))  # type: ignore[arg-type]
        self.total_size = len(dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


class ImageFolderDataModule(pl.LightningDataModule):
    """ImageFolder splits under ``root`` as uint8 batches, ready for the GPU-side prefetcher.

    Args:
        root: Folder holding ``train/`` and ``val/`` (and optionally ``test/``), each with one
            sub-folder of images per class.
        batch_size: Images per batch in each process.
        workers: Loader worker processes per training process; they persist across epochs.
        crop_size: Side of the square crops fed to the network.
        val_resize: Validation images are resized so that their short side is this long, then
            centre-cropped to ``crop_size``.
        crop_scale: Range of the crop's area, as a fraction of the image, for RandomResizedCrop.
        channels_last: Collate batches in channels_last memory format. ``None``: on when the run
            uses a CUDA device.
        pin_memory: Put batches in page-locked memory, for asynchronous copies to the GPU.
        verify_images: Decode every image once before training, to find unreadable files up front.
        predict_root: Folder of images (searched recursively) to classify with ``predict``.
        decoder: ``pil`` decodes and augments PIL images, as the reference did; ``torchvision``
            decodes with ``torchvision.io`` and crops and resizes uint8 tensors; ``nvjpeg`` has the
            workers read the files and decodes, crops and resizes the JPEGs on the GPU in batches
            (``lit_imagenet.gpu_decode``), for when the CPU cores cannot decode fast enough; ``dali``
            reads, decodes, crops, resizes and normalises in an NVIDIA DALI pipeline (``lit_imagenet.dali``;
            on CUDA the GPU and its hardware JPEG decoder do the work; ``workers`` is then its number of
            CPU threads); ``auto`` picks ``dali`` on CUDA when DALI is installed, else ``nvjpeg`` on CUDA,
            else ``pil``, and logs its choice.
        gpu_share: With ``decoder: nvjpeg``, the fraction of the images decoded on the GPU; the
            workers decode the rest with ``torchvision.io``. Lower it when the GPU is the bottleneck
            and the CPU cores have time to spare.
        gpu_decode_ahead: With ``decoder: nvjpeg``, how many batches are queued for decoding on the
            GPU while the current one trains. More even out slow batches; each holds a decoded batch
            in GPU memory.
        seed: Seed of the training order and augmentation. ``None``: the run's ``--seed_everything``.
            A run resumed from a checkpoint keeps the seed it was started with.
    """

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 256,
        workers: int = 4,
        crop_size: int = 224,
        val_resize: int = 256,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        channels_last: bool | None = None,
        pin_memory: bool = True,
        verify_images: bool = False,
        predict_root: str | None = None,
        seed: int | None = None,
        decoder: Literal["pil", "torchvision", "nvjpeg", "dali", "auto"] = "pil",
        gpu_share: float = 1.0,
        gpu_decode_ahead: int = 2,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1. Got {batch_size}")
        if workers < 0:
            raise ValueError(f"workers must not be negative. Got {workers}")
        if crop_size < 1 or val_resize < crop_size:
            raise ValueError(f"Need 0 < crop_size <= val_resize. Got crop_size={crop_size}, val_resize={val_resize}")
        if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1. Got {list(crop_scale)}")
        if root is None and predict_root is None:
            raise DataError("No data given; set --data.root to a folder with train/ and val/ sub-folders.")
        self.save_hyperparameters()
        self.root = Path(root) if root is not None else None
        self.batch_size = batch_size
        self.workers = workers
        self.crop_size = crop_size
        self.val_resize = val_resize
        self.crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.channels_last = channels_last
        self.pin_memory = pin_memory
        self.predict_root = Path(predict_root) if predict_root is not None else None
        self.seed = seed
        if decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {', '.join(map(repr, DECODERS))}. Got {decoder!r}")
        if decoder == "dali":
            import_dali()
        if not 0.0 <= gpu_share <= 1.0:
            raise ValueError(f"gpu_share must be between 0 and 1. Got {gpu_share}")
        if gpu_decode_ahead < 1:
            raise ValueError(f"gpu_decode_ahead must be at least 1. Got {gpu_decode_ahead}")
        self.decoder = decoder
        self._auto_choice: str | None = None
        self.gpu_share = float(gpu_share)
        self.gpu_decode_ahead = gpu_decode_ahead
        #: Set by the ``CUDAPrefetch`` callback; ``None`` leaves transfer and normalisation to the model.
        self.prefetch_device: torch.device | None = None
        self.mean = IMAGENET_MEAN
        self.std = IMAGENET_STD

        self.classes: list[str] = []
        self._splits: dict[str, list[tuple[str, int]]] = {}
        if self.root is not None:
            if not self.root.is_dir():
                raise DataError(
                    f"Data root {self.root} does not exist; point --data.root at a folder with train/ and val/."
                )
            self.classes, self._splits["train"] = scan_split(self.root / "train")
            for split in ("val", "test"):
                if split == "test" and not (self.root / split).is_dir():
                    continue
                classes, samples = scan_split(self.root / split)
                check_same_classes(self.root / "train", self.classes, self.root / split, classes)
                self._splits[split] = samples
        if self.predict_root is not None:
            if not self.predict_root.is_dir():
                raise DataError(f"Prediction folder {self.predict_root} does not exist.")
            files = _image_files(self.predict_root)
            if not files:
                raise DataError(f"Prediction folder {self.predict_root} holds no images.")
            self._splits["predict"] = [(str(p), i) for i, p in enumerate(files)]
        if verify_images:
            verify_image_files([p for samples in self._splits.values() for p, _ in samples], workers=max(1, workers))

    @property
    def num_classes(self) -> int | None:
        """Number of classes in the training split (``None`` without one)."""
        return len(self.classes) or None

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class folder name to label index, as the model's outputs are ordered."""
        return {name: i for i, name in enumerate(self.classes)}

    def samples(self, split: str) -> list[tuple[str, int]]:
        """``(path, label)`` pairs of a split (``train``, ``val``, ``test`` or ``predict``)."""
        if split not in self._splits:
            raise DataError(f"There is no {split!r} split; the data module has {sorted(self._splits)}.")
        return self._splits[split]

    def _transforms(self) -> Any:
        # transforms.v2 resizes uint8 tensors as uint8 (several times faster than v1, which converts
        # them to float); both draw the same random numbers, so a seed gives the same crops.
        return transforms if self.decoder_in_use() == "pil" else transforms_v2

    def train_transform(self) -> Callable[[Any], Any]:
        """RandomResizedCrop and horizontal flip, on PIL images (``pil``) or uint8 tensors (the others)."""
        t = self._transforms()
        return t.Compose([t.RandomResizedCrop(self.crop_size, scale=self.crop_scale), t.RandomHorizontalFlip()])

    def eval_transform(self) -> Callable[[Any], Any]:
        """Resize of the short side, then centre crop; on PIL images (``pil``) or uint8 tensors (the others)."""
        t = self._transforms()
        return t.Compose([t.Resize(self.val_resize), t.CenterCrop(self.crop_size)])

    def _on_cuda(self) -> bool:
        return self.prefetch_device is not None or (
            self.trainer is not None and self.trainer.strategy.root_device.type == "cuda"
        )

    def decoder_in_use(self) -> str:
        """``decoder``, or for ``auto`` the decoder it stands for on this run's device (logged when it changes)."""
        if self.decoder != "auto":
            return self.decoder
        choice, reason = choose_decoder(self._on_cuda())
        if choice != self._auto_choice:
            rank_zero_info(f"Decoder: {choice} (--data.decoder auto: {reason}).")
            self._auto_choice = choice
        return choice

    def _memory_format(self) -> torch.memory_format:
        use = self._on_cuda() if self.channels_last is None else self.channels_last
        return torch.channels_last if use else torch.contiguous_format

    def _data_seed(self) -> int:
        if self.seed is not None:
            return self.seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))  # set by seed_everything / --seed_everything

    def _loader(self, split: str, train: bool) -> PrefetchLoader | DALILoader:
        decoder = self.decoder_in_use()
        transform = self.train_transform() if train else self.eval_transform()
        dataset: ImageFolderDataset
        collate: Callable[..., Any]
        if decoder == "nvjpeg":
            dataset = EncodedImageFolderDataset(
                self.samples(split), transform, train, self.crop_size, self.crop_scale, self.val_resize, self.gpu_share
            )
            collate = partial(collate_encoded, memory_format=self._memory_format())
        else:
            loader = load_rgb_tensor if decoder == "torchvision" else load_rgb
            dataset = ImageFolderDataset(self.samples(split), transform, loader)
            collate = partial(collate_uint8, memory_format=self._memory_format())
        sampler: DistributedSampler | None = None
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        if train:
            sampler = EpochSeededSampler(dataset, self._data_seed(), world, rank)
            if self.trainer is not None:
                epoch, done = resume_position(self.trainer, math.ceil(len(sampler) / self.batch_size))
                sampler.resume_at(epoch, done * self.batch_size)
        elif world > 1:
            sampler = UnpaddedDistributedSampler(dataset, world, rank)
        if decoder == "dali":
            return self._dali_loader(split, train, sampler)
        return PrefetchLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=False,
            sampler=sampler,
            num_workers=self.workers,
            collate_fn=collate,
            pin_memory=self.pin_memory and self._on_cuda(),
            persistent_workers=self.workers > 0,
            drop_last=False,
            device=self.prefetch_device,
            mean=self.mean,
            std=self.std,
            decode_ahead=self.gpu_decode_ahead,
        )

    def _dali_loader(self, split: str, train: bool, sampler: DistributedSampler | None) -> DALILoader:
        device = self.prefetch_device
        if device is None and self.trainer is not None and self.trainer.strategy.root_device.type == "cuda":
            device = self.trainer.strategy.root_device
        return DALILoader(
            self.samples(split),
            self.batch_size,
            train,
            self.crop_size,
            self.val_resize,
            self.crop_scale,
            threads=self.workers,
            sampler=sampler,
            device=device,
            channels_last=self._memory_format() == torch.channels_last,
            dtype=batch_dtype(self.trainer.precision if self.trainer is not None else None),
            mean=self.mean,
            std=self.std,
        )

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Decodes an ``EncodedBatch`` on ``device`` (when the prefetcher has not); other batches as usual."""
        if isinstance(batch, EncodedBatch):
            return batch.decode(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def train_dataloader(self) -> PrefetchLoader | DALILoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> PrefetchLoader | DALILoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> PrefetchLoader | DALILoader:
        return self._loader("test" if "test" in self._splits else "val", train=False)

    def predict_dataloader(self) -> PrefetchLoader | DALILoader:
        return self._loader("predict", train=False)
