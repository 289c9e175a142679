"""The DALI loader (``--data.decoder dali``, an optional dependency imported only then), like a ``DataLoader``: the
sampler gives the order, shard and seeds; each training epoch builds a pipeline, evaluation passes reuse one."""

from __future__ import annotations

import math
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from lit_imagenet.data.augment import Augment
from lit_imagenet.data.dali.pipeline import build_pipeline, pipeline_seed
from lit_imagenet.data.images import ImageSizes, load_rgb
from lit_imagenet.data.index import SampleTable
from lit_imagenet.data.prefetch import SamplerSeed
from lit_imagenet.data.presets import IMAGENET_MEAN, IMAGENET_STD
from lit_imagenet.data.samplers import EpochSeededSampler
from lit_imagenet.errors import ConfigError, DataError, undecodable_image

HW_DECODER_LOAD = 0.65
# Batches DALI may have read beyond the one it hands over when an error surfaces (its queue and the reader's).
_BATCHES_AHEAD = 3


def dali_install_command() -> str:
    """The ``pip install`` that brings the DALI build matching this torch's CUDA (CUDA 13 for CPU builds)."""
    flavour = "cuda120" if str(torch.version.cuda).startswith("12.") else "cuda130"
    return f"pip install 'lit_imagenet[dali-{flavour}]'"


def import_dali() -> ModuleType:
    """``nvidia.dali``, imported; a ``ConfigError`` saying what to install when it is missing or does not load."""
    try:
        import nvidia.dali as dali
        import nvidia.dali.plugin.pytorch  # noqa: F401  (the iterator that hands DALI's batches to torch)
    except Exception as err:  # ImportError, or an OSError from a DALI build that does not load here
        reason = "is not installed" if isinstance(err, ImportError) else f"does not load ({type(err).__name__}: {err})"
        raise ConfigError(
            f"--data.decoder dali needs NVIDIA DALI, which {reason}; run {dali_install_command()} "
            "or choose another --data.decoder."
        ) from None
    return dali


def batch_dtype(precision: str | None) -> torch.dtype:
    """The dtype of DALI's batches for a Lightning precision: float16 for ``16-*``, else float32 (DALI has no bf16)."""
    return torch.float16 if str(precision).startswith("16") else torch.float32


class DALILoader(SamplerSeed):
    """Batches ``[(N, 3, S, S) images, int64 labels]`` from a DALI pipeline, normalised, on ``device`` or the CPU;
    iterable like a ``DataLoader``, with a ``sampler``, a ``batch_size`` and a length.

    Args:
        samples: ``(path, class index)`` pairs of the split.
        batch_size: Images per batch.
        train: Random crop and flip (training) or resize and centre crop (evaluation).
        crop_size, val_resize: The side of the output images; the short side before the evaluation centre crop.
        crop_scale: Range of the crop's area, as a fraction of the image.
        threads: DALI's CPU threads.
        sampler: An ``EpochSeededSampler`` for training; for evaluation, indices, or ``None`` for all in order.
        device: A CUDA device for the pipeline, or ``None`` for the CPU.
        channels_last, dtype: Lay the batch out as channels_last; its dtype, ``torch.float32`` or ``torch.float16``.
        mean, std: Per-channel mean and standard deviation of images scaled to [0, 1].
        hw_decoder_load: On CUDA, the share of the JPEGs sent to the GPU's hardware JPEG decoder.
        max_batches: Evaluation only: the batches a pass reads (Lightning's ``limit_*_batches``), None for all.
        augment: Training only: the auto-augment policy (``ta_wide``, ``ra``, drawn in the pipeline) and random erasing.

    Raises:
        ConfigError: ``augment``'s policy is ``augmix``, which DALI does not have.
        ValueError: ``train`` without an ``EpochSeededSampler``.
    """

    batch_sampler = None  # batches are formed in the pipeline; Lightning looks for this as on a DataLoader

    def __init__(
        self,
        samples: Sequence[tuple[str, int]],
        batch_size: int,
        train: bool,
        crop_size: int,
        val_resize: int,
        crop_scale: tuple[float, float],
        threads: int,
        sampler: Sampler | None = None,
        device: torch.device | None = None,
        channels_last: bool = False,
        dtype: torch.dtype = torch.float32,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        hw_decoder_load: float = HW_DECODER_LOAD,
        max_batches: int | None = None,
        augment: Augment | None = None,
    ) -> None:
        if train and augment is not None and augment.policy == "augmix":
            raise ConfigError(
                "--data.auto_augment augmix is not available with --data.decoder dali, which has no AugMix: "
                "choose ta_wide or ra, or the pil, torchvision or nvjpeg decoder."
            )
        if train and not isinstance(sampler, EpochSeededSampler):
            raise ValueError(f"A training DALILoader takes its order from an EpochSeededSampler. Got {sampler!r}")
        import_dali()
        if device is not None and device.type != "cuda":
            device = None
        if device is not None and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.samples = SampleTable.of(samples)
        self.batch_size = batch_size
        self.train = train
        self.crop_size = crop_size
        self.val_resize = val_resize
        self.crop_scale = crop_scale
        self.threads = max(1, threads)
        self.sampler = sampler
        self.device = device
        self.channels_last = channels_last
        self.dtype = dtype
        self.mean, self.std = tuple(mean), tuple(std)
        self.hw_decoder_load = hw_decoder_load
        self.max_batches = None if train or max_batches is None else max(0, int(max_batches))
        self.augment = augment if train and augment else None
        self.sizes = ImageSizes(self.samples)  # read from the headers as the batches need them
        self._kept: tuple[Any, np.ndarray] | None = None  # an evaluation pipeline at its first batch, and its order
        self._active: Generator[list[Tensor], None, None] | None = None

    def __len__(self) -> int:
        count = len(self.sampler) if self.sampler is not None else len(self.samples)  # type: ignore[arg-type]
        batches = math.ceil(count / self.batch_size)
        return batches if self.max_batches is None else min(batches, self.max_batches)

    def _order(self) -> tuple[np.ndarray, np.ndarray | None, int]:
        """The sample indices of the next pass, and for training their augmentation seeds; the pipeline's seed."""
        if self.train and isinstance(self.sampler, EpochSeededSampler):
            s = self.sampler
            seed = pipeline_seed(s.seed, s.epoch, s.skips(), s.rank) if self.augment else 0
            return (*s.next_pass(), seed)
        indices = np.arange(len(self.samples)) if self.sampler is None else np.fromiter(self.sampler, dtype=np.int64)
        return indices[: len(self) * self.batch_size], None, 0  # limited to ``max_batches``

    def _build(self, indices: np.ndarray, seeds: np.ndarray | None, seed: int) -> Any:
        """DALI's iterator over a pipeline of samples ``indices`` (``build_pipeline``)."""
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        # The first batches' sizes are read as DALI prepares them; a loader worker reads on from there.
        self.sizes.read_ahead(indices, start=(1 + _BATCHES_AHEAD) * self.batch_size)
        try:
            pipe = build_pipeline(self, indices, seeds, seed)  # built by the iterator
            return DALIGenericIterator(
                [pipe], ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL
            )
        except RuntimeError as err:
            raise self._named_error(err, indices, 0) from None

    def __iter__(self) -> Iterator[list[Tensor]]:
        if self._active is not None:
            self._active.close()  # a pass left part-way (limit_*_batches): its pipeline goes first
        self._active = self._batches()
        return self._active

    def _batches(self) -> Generator[list[Tensor], None, None]:
        """The batches of one pass; an evaluation pipeline that read all its files is rewound for the next."""
        indices, seeds, seed = self._order()
        kept, self._kept = self._kept, None
        source = kept[0] if kept is not None and np.array_equal(kept[1], indices) else None
        del kept  # a pipeline of another order goes before one is built
        if source is None:
            if len(indices) == 0:  # a shard with no samples, or an epoch resumed after its last batch
                return
            source = self._build(indices, seeds, seed)
        total = math.ceil(len(indices) / self.batch_size)
        try:
            for read in range(total):
                out = next(source)[0]
                images, labels = out["images"], out["labels"]
                if self.channels_last:
                    images = images.permute(0, 3, 1, 2)  # NHWC memory seen as NCHW: channels_last, no copy
                if read == total - 1 and not self.train:
                    source.reset()  # all its files read: back to the first batch, for the next pass
                    self._kept = (source, indices)
                elif read == total - 1:
                    source = None  # the epoch's pipeline goes; the next epoch builds its own
                yield [images, labels]
        except RuntimeError as err:
            raise self._named_error(err, indices, read) from None

    def _named_error(self, err: RuntimeError, indices: np.ndarray, batch: int) -> Exception:
        """A ``DataError`` naming the file DALI failed on in batch ``batch`` of a pass, or ``err``: DALI's errors may
        not name it and may come from a batch a few ahead, so the first of their files that PIL fails on is named."""
        window = self.samples.paths(indices[batch * self.batch_size : (batch + 1 + _BATCHES_AHEAD) * self.batch_size])
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for found in pool.map(_decode_error, window):
                if found is not None:
                    return found
        for line in str(err).splitlines():
            path = next((path for path in window if path in line), None)
            if path is not None:
                return undecodable_image(path, " ".join(line.split()))
        return err


def _decode_error(path: str) -> DataError | None:
    try:
        load_rgb(path)
    except DataError as bad:
        return bad
    return None
