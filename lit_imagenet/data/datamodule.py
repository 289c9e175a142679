"""The data module: ImageFolder splits under a root as uint8 batches (or DALI's), one loader per split."""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from lit_imagenet.data.augment import Augment, Policy
from lit_imagenet.data.dali import HW_DECODER_LOAD, DALILoader, batch_dtype, dali_install_command, import_dali
from lit_imagenet.data.datasets import ImageFolderDataset, collate_uint8
from lit_imagenet.data.folders import scan_predict, scan_root
from lit_imagenet.data.images import load_rgb, load_rgb_tensor, verify_image_files
from lit_imagenet.data.index import SampleTable, default_index_dir
from lit_imagenet.data.nvjpeg import EncodedBatch, EncodedImageFolderDataset, collate_encoded
from lit_imagenet.data.prefetch import PrefetchLoader
from lit_imagenet.data.presets import IMAGENET_MEAN, IMAGENET_STD, TrainCrop, eval_transform
from lit_imagenet.data.samplers import split_sampler
from lit_imagenet.errors import ConfigError, DataError

DECODERS = ("pil", "torchvision", "nvjpeg", "dali", "auto")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


#: The default ``workers``: 4, or fewer where the process has fewer cores (more would only wait for them).
DEFAULT_WORKERS = min(4, usable_cores())


def choose_decoder(on_cuda: bool, processes: int = 1) -> tuple[str, str]:
    """What ``auto`` stands for, and why: on one CUDA process DALI if installed, else on CUDA nvJPEG, else PIL."""
    if not on_cuda:
        return "pil", "the run is not on a CUDA device"
    if processes > 1:
        return "nvjpeg", f"the run has {processes} CUDA processes, where nvjpeg measured faster than dali"
    try:
        dali = import_dali()
    except ConfigError:
        return "nvjpeg", f"the run is on CUDA and NVIDIA DALI is not installed ({dali_install_command()} adds it)"
    return "dali", f"the run is on one CUDA device and NVIDIA DALI {dali.__version__} is installed"


class ImageFolderDataModule(pl.LightningDataModule):
    """ImageFolder splits under ``root`` as uint8 batches, ready for the GPU-side prefetcher.

    Args:
        root: Folder holding ``train/``, ``val/`` (and optionally ``test/``), each with one sub-folder per class.
        batch_size: Images per batch in each process.
        workers: Loader worker processes per training process (``pil``, ``torchvision``, ``nvjpeg``).
        crop_size: Side of the square evaluation crops (and of the training crops unless ``train_crop_size``).
        val_resize: Short side validation images are resized to before the centre crop of ``crop_size``.
        crop_scale: Range of the crop's area, as a fraction of the image, for RandomResizedCrop.
        channels_last: Collate batches in channels_last memory format. ``None``: on a CUDA device.
        pin_memory: Collate batches into page-locked memory (on CUDA the prefetcher pins them anyway).
        verify_images: Decode every image once before training, to find unreadable files up front.
        predict_root: Folder of images (searched recursively) to classify with ``predict``.
        decoder: ``pil`` (as the reference), ``torchvision`` (``torchvision.io``), ``nvjpeg`` (workers read, the
            GPU decodes and crops), ``dali`` (a DALI pipeline of ``dali_threads``, no workers), or ``auto``:
            ``dali`` on one CUDA device when installed, else ``nvjpeg`` on CUDA, else ``pil``.
        gpu_share: With ``decoder: nvjpeg``, the fraction of the images decoded on the GPU; the workers do the rest.
        gpu_decode_ahead: On CUDA, the batches the prefetcher's thread prepares ahead; each holds GPU memory.
        hw_decoder_load: With ``decoder: dali`` on CUDA, the fraction of JPEGs sent to the hardware decoder.
        seed: Seed of the training order and augmentation. ``None``: ``--seed_everything``; resuming keeps it.
        index: Keep each split's file list in an index file; a split whose folders changed is scanned again.
        index_dir: The index files' folder. ``None``: ``$LIT_IMAGENET_CACHE/index`` or ``~/.cache/lit_imagenet/index``.
        dali_threads: With ``decoder: dali``, the pipeline's CPU threads. ``None``: half this process's cores, 2-8.
        persistent_eval_workers: Keep the validation, test and predict loader workers between passes.
        train_crop_size: Side of the square training crops (FixRes: train at 176, evaluate at ``val_resize`` 232 and
            ``crop_size`` 224). ``None``: ``crop_size``.
        auto_augment: Policy applied to each training crop after the flip: ``ta_wide`` (TrivialAugmentWide), ``ra``
            (RandAugment) or ``augmix`` (AugMix), torchvision's, bilinear. ``None``: none.
        ra_magnitude: RandAugment's magnitude (0-30) with ``auto_augment: ra``.
        augmix_severity: AugMix's severity (1-10) with ``auto_augment: augmix``.
        random_erase: Probability of torchvision's ``RandomErasing`` of a training crop, after the policy.
        ra_reps: Repeated augmentation: an epoch shows ``1 / ra_reps`` of the training images ``ra_reps`` times each,
            differently augmented on different processes; an epoch keeps the split's length. 1: off.
    """

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 256,
        workers: int = DEFAULT_WORKERS,
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
        hw_decoder_load: float = HW_DECODER_LOAD,
        index: bool = True,
        index_dir: str | None = None,
        dali_threads: int | None = None,
        persistent_eval_workers: bool = False,
        train_crop_size: int | None = None,
        auto_augment: Policy | None = None,
        ra_magnitude: int = 9,
        augmix_severity: int = 3,
        random_erase: float = 0.0,
        ra_reps: int = 1,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1. Got {batch_size}")
        if workers < 0:
            raise ConfigError(f"workers must not be negative. Got {workers}")
        if crop_size < 1 or val_resize < crop_size:
            raise ConfigError(f"Need 0 < crop_size <= val_resize. Got crop_size={crop_size}, val_resize={val_resize}")
        if train_crop_size is not None and train_crop_size < 1:
            raise ConfigError(f"train_crop_size must be at least 1 (or null for crop_size). Got {train_crop_size}")
        if ra_reps < 1:
            raise ConfigError(f"ra_reps must be at least 1 (1: no repeated augmentation). Got {ra_reps}")
        if not 0 < crop_scale[0] <= crop_scale[1] <= 1:
            raise ConfigError(f"crop_scale must satisfy 0 < low <= high <= 1. Got {list(crop_scale)}")
        if root is None and predict_root is None:
            raise DataError("No data given; set --data.root to a folder with train/ and val/ sub-folders.")
        if decoder not in DECODERS:
            raise ConfigError(f"decoder must be one of {', '.join(map(repr, DECODERS))}. Got {decoder!r}")
        if decoder == "dali":
            import_dali()
        if not 0.0 <= gpu_share <= 1.0:
            raise ConfigError(f"gpu_share must be between 0 and 1. Got {gpu_share}")
        if gpu_decode_ahead < 1:
            raise ConfigError(f"gpu_decode_ahead must be at least 1. Got {gpu_decode_ahead}")
        if not 0.0 <= hw_decoder_load <= 1.0:
            raise ConfigError(f"hw_decoder_load must be between 0 and 1. Got {hw_decoder_load}")
        if dali_threads is not None and dali_threads < 1:
            raise ConfigError(f"dali_threads must be at least 1. Got {dali_threads}")
        self.save_hyperparameters()
        self.root = Path(root) if root is not None else None
        self.batch_size = batch_size
        self.workers = workers
        self.crop_size = crop_size
        self.val_resize = val_resize
        self.crop_scale = (float(crop_scale[0]), float(crop_scale[1]))
        self.train_crop_size = crop_size if train_crop_size is None else train_crop_size
        self.ra_reps = ra_reps
        self.channels_last = channels_last
        self.pin_memory = pin_memory
        self.seed = seed
        self.decoder = decoder
        self._decoder_logged: str | None = None
        self.gpu_share = float(gpu_share)
        self.gpu_decode_ahead = gpu_decode_ahead
        self.hw_decoder_load = float(hw_decoder_load)
        self.dali_threads = dali_threads
        self.persistent_eval_workers = persistent_eval_workers
        #: Set by the ``CUDAPrefetch`` callback; ``None`` leaves transfer and normalisation to the model.
        self.prefetch_device: torch.device | None = None
        self.mean, self.std = IMAGENET_MEAN, IMAGENET_STD
        self.augment = Augment(
            policy=auto_augment, ra_magnitude=ra_magnitude, augmix_severity=augmix_severity,
            random_erase=random_erase, fill=Augment.fill_of(self.mean),
        )  # fmt: skip
        #: The processes and batch size of the run whose checkpoint this run resumes from (``load_state_dict``).
        self._saved: dict[str, int] | None = None
        self.classes: list[str] = []
        self._splits: dict[str, SampleTable] = {}
        if self.root is not None:
            where = (Path(index_dir) if index_dir is not None else default_index_dir()) if index else None
            self.classes, self._splits = scan_root(self.root, where)
        if predict_root is not None:
            self._splits["predict"] = scan_predict(Path(predict_root))
        if verify_images:
            verify_image_files([p for samples in self._splits.values() for p, _ in samples], workers=workers)

    @property
    def num_classes(self) -> int | None:
        """Number of classes in the training split (``None`` without one)."""
        return len(self.classes) or None

    @property
    def class_to_idx(self) -> dict[str, int]:
        """Class folder name to label index, as the model's outputs are ordered."""
        return {name: i for i, name in enumerate(self.classes)}

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on from the same sample (``split_sampler``), and the training split's size."""
        world = self.trainer.world_size if self.trainer is not None else 1
        train = len(self._splits["train"]) if "train" in self._splits else 0
        return {"world_size": world, "batch_size": self.batch_size, "ra_reps": self.ra_reps, "train_samples": train}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = {key: int(state_dict[key]) for key in ("world_size", "batch_size", "ra_reps") if key in state_dict}
        self._saved = saved if "world_size" in saved and "batch_size" in saved else None
        before, now = state_dict.get("train_samples"), len(self._splits.get("train", ()))
        if before and now and int(before) != now:
            rank_zero_warn(
                f"The training split has {now:,} images, the run of the checkpoint had {before:,}: its epoch goes on "
                "in the order of the new split, where some images may come twice and others not at all."
            )

    def samples(self, split: str) -> SampleTable:
        """``(path, label)`` pairs of a split (``train``, ``val``, ``test`` or ``predict``), as numpy arrays."""
        if split not in self._splits:
            raise DataError(f"There is no {split!r} split; the data module has {sorted(self._splits)}.")
        return self._splits[split]

    def eval_transform(self) -> Callable[[Any], Any]:
        """Resize of the short side, then centre crop; on PIL images (``pil``) or uint8 tensors (the others)."""
        return eval_transform(self.val_resize, self.crop_size, tensors=self.decoder_in_use() != "pil")

    def _device(self) -> torch.device | None:
        """The prefetcher's device, else the run's CUDA device; ``None`` off CUDA."""
        if self.prefetch_device is not None or self.trainer is None:
            return self.prefetch_device
        device = self.trainer.strategy.root_device
        return device if device.type == "cuda" else None

    def decoder_in_use(self) -> str:
        """``decoder``, or for ``auto`` the decoder it stands for on this run's devices; logged when it changes."""
        if self.decoder == "auto":
            processes = self.trainer.world_size if self.trainer is not None else 1
            choice, reason = choose_decoder(self._device() is not None, processes)
            line = f"Decoder: {choice} (--data.decoder auto: {reason})."
        else:
            choice, line = self.decoder, f"Decoder: {self.decoder} (--data.decoder {self.decoder})."
        if choice != self._decoder_logged:
            rank_zero_info(line)
            self._decoder_logged = choice
        return choice

    def _loader(self, split: str, train: bool, stage: str = "val") -> PrefetchLoader | DALILoader:
        decoder, samples, device = self.decoder_in_use(), self.samples(split), self._device()
        channels_last = device is not None if self.channels_last is None else self.channels_last
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        crop, augment = (self.train_crop_size, self.augment) if train else (self.crop_size, Augment())
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))  # --seed_everything
        saved = self._saved if train else None
        sampler = split_sampler(samples, train, seed, self.trainer, self.batch_size, saved, self.ra_reps)
        if decoder == "dali":
            processes = self.trainer.num_devices if self.trainer is not None else 1
            # An int of --trainer.limit_*_batches; a fraction (1.0: all) Lightning applies to the loader's length.
            limit = getattr(self.trainer, f"limit_{stage}_batches", None)
            limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
            threads = self.dali_threads or max(2, min(8, usable_cores() // max(1, processes) // 2))
            return DALILoader(
                samples, self.batch_size, train, crop, self.val_resize, self.crop_scale, threads=threads, device=device,
                sampler=sampler, channels_last=channels_last, augment=augment, mean=self.mean,
                std=self.std, dtype=batch_dtype(self.trainer.precision if self.trainer is not None else None),
                hw_decoder_load=self.hw_decoder_load, max_batches=None if train else limit,
            )  # fmt: skip
        transform = TrainCrop(self.train_crop_size, self.crop_scale, self.augment) if train else self.eval_transform()
        if decoder == "nvjpeg":
            dataset: ImageFolderDataset = EncodedImageFolderDataset(
                samples, transform, train, crop, self.crop_scale, self.val_resize, self.gpu_share, augment=augment
            )
            collate = partial(collate_encoded, memory_format=memory_format)
        else:
            dataset = ImageFolderDataset(samples, transform, load_rgb_tensor if decoder == "torchvision" else load_rgb)
            collate = partial(collate_uint8, memory_format=memory_format)
        return PrefetchLoader(
            dataset, batch_size=self.batch_size, sampler=sampler, num_workers=self.workers, collate_fn=collate,
            pin_memory=self.pin_memory and device is not None, device=self.prefetch_device,
            persistent_workers=self.workers > 0 and (train or self.persistent_eval_workers),
            mean=self.mean, std=self.std, decode_ahead=self.gpu_decode_ahead,
        )  # fmt: skip

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
        return self._loader("test" if "test" in self._splits else "val", train=False, stage="test")

    def predict_dataloader(self) -> PrefetchLoader | DALILoader:
        return self._loader("predict", train=False, stage="predict")
