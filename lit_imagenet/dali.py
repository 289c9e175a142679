"""NVIDIA DALI data path (``--data.decoder dali``): decode, crop, resize, flip and normalise in DALI's C++ threads.

DALI is an optional dependency (``pip install 'lit_imagenet[dali-cuda130]'``, or ``[dali-cuda120]`` for a
torch built for CUDA 12); it is imported only when this decoder is used. The pipeline is the one of
DALI's ResNet-50 example: ``readers.file`` reads the files, the decoder fuses decoding with the crop
(ROI decoding; on CUDA the ``mixed`` decoder, which hands part of the JPEGs to the GPU's hardware
decoder), ``resize`` scales the crop, and ``crop_mirror_normalize`` flips, normalises and lays the batch
out. On a CUDA device every step after file reading runs on the GPU and the batch reaches the model
with no further copy; elsewhere the same pipeline runs on the CPU (``device_id=None``).

The data module's sampler gives the order: the training order, shard of each process and
augmentation seed of each sample are those of the other decoders (``EpochSeededSampler``), and
validation shards are ``UnpaddedDistributedSampler``'s. Each process's reader gets the files of its
own shard, rather than the whole list with DALI's ``shard_id``/``num_shards``, whose shards differ in
length: under DDP every process must train the same number of batches.

DALI's own random crop (``decoders.image_random_crop``) draws from generators that advance with every
batch, so a run resumed part-way through an epoch could not draw the same crops again. Here the crop
window is computed in the pipeline from the image size (read from the header by ``peek_image_shape``)
and uniform numbers derived from each sample's seed, with RandomResizedCrop's rule (up to ten tries of
an area fraction in ``crop_scale`` and an aspect ratio in (3/4, 4/3), else a centre crop), and
``decoders.image_slice`` decodes that window: the same fused ROI decoding. ``crop_window`` is the rule
in Python. A pass starts a new pipeline reading the files in the sampler's order, so a resumed epoch
starts at the first batch not yet trained on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Sampler

from lit_imagenet.errors import ConfigError, DataError
from lit_imagenet.gpu_decode import CropBox
from lit_imagenet.prefetch import IMAGENET_MEAN, IMAGENET_STD

if TYPE_CHECKING:
    from types import ModuleType

CROP_RATIO = (3 / 4, 4 / 3)
CROP_TRIES = 10
HW_DECODER_LOAD = 0.65
# Batches DALI may have read beyond the one it hands over when an error surfaces: its output queue
# (prefetch_queue_depth, 2 by default) and the file reader's own queue.
_BATCHES_AHEAD = 3
_DRAWS = 2 * CROP_TRIES + 3  # area fractions, aspect ratios, top, left, flip


def dali_install_command() -> str:
    """The ``pip install`` that brings the DALI build matching this torch's CUDA (CUDA 13 for CPU builds)."""
    cuda = torch.version.cuda
    flavour = "cuda120" if cuda is not None and cuda.startswith("12.") else "cuda130"
    return f"pip install 'lit_imagenet[dali-{flavour}]'"


def import_dali() -> ModuleType:
    """``nvidia.dali``, imported.

    Raises:
        ConfigError: DALI is not installed (or does not load); the message says what to install.
    """
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


def choose_decoder(on_cuda: bool) -> tuple[str, str]:
    """The decoder ``auto`` stands for, and why: DALI on CUDA when it imports, else nvJPEG on CUDA, else PIL."""
    if not on_cuda:
        return "pil", "the run is not on a CUDA device"
    try:
        dali = import_dali()
    except ConfigError:
        return "nvjpeg", f"the run is on CUDA and NVIDIA DALI is not installed ({dali_install_command()} adds it)"
    return "dali", f"the run is on CUDA and NVIDIA DALI {dali.__version__} is installed"


def batch_dtype(precision: str | None) -> torch.dtype:
    """The dtype of DALI's normalised batches for a Lightning precision: float16 for ``16-*``, else float32.

    DALI has no bfloat16 output; bfloat16 runs get float32 (autocast casts it, ``bf16-true`` converts it).
    """
    return torch.float16 if str(precision).startswith("16") else torch.float32


def crop_draws(
    seeds: Sequence[int] | np.ndarray, scale: tuple[float, float], ratio: tuple[float, float] = CROP_RATIO
) -> np.ndarray:
    """Per sample, the random numbers of its crop and flip, fixed by its augmentation seed.

    Returns a float64 ``(N, 23)`` array: ten area fractions drawn from ``scale``, ten aspect ratios
    drawn log-uniformly from ``ratio``, then uniform numbers in [0, 1) for the top and left of the crop
    and for the flip (mirrored when below 0.5).

    Args:
        seeds: The samples' augmentation seeds (``EpochSeededSampler``'s).
        scale: Range of the crop's area, as a fraction of the image.
        ratio: Range of the crop's aspect ratio (width / height).
    """
    seeds_u = np.asarray(seeds, dtype=np.uint64).reshape(-1)
    steps = np.arange(1, _DRAWS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    with np.errstate(over="ignore"):  # SplitMix64: wrapping 64-bit arithmetic is the point
        x = seeds_u[:, None] + steps[None, :]
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    u = (x >> np.uint64(11)).astype(np.float64) * 2.0**-53
    t = CROP_TRIES
    out = u.copy()
    out[:, :t] = scale[0] + (scale[1] - scale[0]) * u[:, :t]
    low, high = math.log(ratio[0]), math.log(ratio[1])
    out[:, t : 2 * t] = np.exp(low + (high - low) * u[:, t : 2 * t])
    return out


def crop_window(height: int, width: int, draws: np.ndarray, ratio: tuple[float, float] = CROP_RATIO) -> CropBox:
    """The crop the training pipeline cuts from a ``height`` x ``width`` image with one row of ``crop_draws``.

    RandomResizedCrop's rule: the first of the tries whose box fits in the image, placed at random;
    when none fits, the largest centred box with an aspect ratio in ``ratio``.

    Args:
        height: Image height in pixels.
        width: Image width in pixels.
        draws: One row of ``crop_draws``.
        ratio: The aspect ratio range the draws were made for.
    """
    area = float(height) * float(width)
    for k in range(CROP_TRIES):
        s, r = draws[k], draws[CROP_TRIES + k]
        w = math.floor(math.sqrt(area * s * r) + 0.5)
        h = math.floor(math.sqrt(area * s / r) + 0.5)
        if 0 < w <= width and 0 < h <= height:
            top = math.floor(draws[2 * CROP_TRIES] * (height - h + 1))
            left = math.floor(draws[2 * CROP_TRIES + 1] * (width - w + 1))
            return CropBox(top, left, h, w)
    w = min(width, math.floor(height * ratio[1] + 0.5))
    h = min(height, math.floor(width / ratio[0] + 0.5))
    return CropBox((height - h) // 2, (width - w) // 2, h, w)


def flips(draws: np.ndarray) -> np.ndarray:
    """Which samples of ``crop_draws`` are mirrored, as int32 0 or 1."""
    return (draws[:, 2 * CROP_TRIES + 2] < 0.5).astype(np.int32)


def _crop_window_nodes(shape: Any, draws: Any, ratio: tuple[float, float]) -> tuple[Any, Any]:
    """``crop_window`` in DALI operations on each sample's ``(H, W, C)`` and draws: ``(anchor, size)``, x first."""
    import nvidia.dali.fn as fn
    import nvidia.dali.math as dmath
    import nvidia.dali.types as types

    t = CROP_TRIES
    height, width = shape[0], shape[1]
    area = height * width
    s, r = draws[0:t], draws[t : 2 * t]
    w = dmath.floor(dmath.sqrt(area * s * r) + 0.5)
    h = dmath.floor(dmath.sqrt(area * s / r) + 0.5)
    fits = (w <= width) & (h <= height) & (w > 0) & (h > 0)
    # The first box that fits: fitting tries are ranked t, t-1, ... 1 and the top rank picks it. DALI's
    # reductions take no float64; the ranks and sizes are whole numbers, exact in float32.
    rank = fn.cast(fits * types.Constant(np.arange(t, 0, -1, dtype=np.int32)), dtype=types.FLOAT)
    best = fn.reductions.max(rank)
    found = best > 0
    picked = (rank == best) & found
    fit_w = fn.reductions.max(fn.cast(picked * w, dtype=types.FLOAT))
    fit_h = fn.reductions.max(fn.cast(picked * h, dtype=types.FLOAT))
    w = found * fit_w + (1 - found) * dmath.min(width, dmath.floor(height * ratio[1] + 0.5))
    h = found * fit_h + (1 - found) * dmath.min(height, dmath.floor(width / ratio[0] + 0.5))
    top = found * dmath.floor(draws[2 * t] * (height - h + 1)) + (1 - found) * dmath.floor((height - h) / 2)
    left = found * dmath.floor(draws[2 * t + 1] * (width - w + 1)) + (1 - found) * dmath.floor((width - w) / 2)
    anchor = fn.cast(fn.stack(left, top), dtype=types.INT32)
    size = fn.cast(fn.stack(w, h), dtype=types.INT32)
    return anchor, size


def _eval_geometry(shape: Any, resize: int, crop: int) -> tuple[Any, Any, Any, Any]:
    """torchvision's ``Resize(resize)`` size and ``CenterCrop(crop)`` position, as DALI operations.

    The long side is ``int(resize * long / short)`` and the crop starts at ``round((side - crop) / 2)``
    (half to even), as torchvision computes them, so the batches match the other decoders' to a grey level.
    """
    import nvidia.dali.math as dmath

    height, width = shape[0], shape[1]
    wide = width >= height
    new_h = wide * resize + (1 - wide) * dmath.floor(resize * height / width)
    new_w = (1 - wide) * resize + wide * dmath.floor(resize * width / height)

    def half_to_even(x: Any) -> Any:
        whole = dmath.floor(x)
        odd = whole - 2 * dmath.floor(whole / 2)
        return whole + (x - whole > 0.5) + (x - whole == 0.5) * odd

    # crop_mirror_normalize places the crop at pos * (side - crop): a whole number of pixels here.
    pos_y = half_to_even((new_h - crop) / 2) / dmath.max(new_h - crop, 1)
    pos_x = half_to_even((new_w - crop) / 2) / dmath.max(new_w - crop, 1)
    return new_w, new_h, pos_x, pos_y


class _DrawSource:
    """The external source of a training pipeline: batch ``i``'s crop draws and flips, in the reader's order.

    Drawn batch by batch (microseconds each): an epoch's worth for ImageNet would take 235 MB.
    """

    def __init__(self, seeds: Sequence[int], batch_size: int, scale: tuple[float, float]) -> None:
        self.seeds = np.asarray(seeds, dtype=np.uint64)
        self.batch_size = batch_size
        self.scale = scale
        self.batches = max(1, math.ceil(len(self.seeds) / batch_size))

    def __call__(self, iteration: int) -> tuple[np.ndarray, np.ndarray]:
        # The reader pads the last batch with its last sample and then starts over: the same here.
        start = (iteration % self.batches) * self.batch_size
        rows = np.minimum(np.arange(start, start + self.batch_size), len(self.seeds) - 1)
        draws = crop_draws(self.seeds[rows], self.scale)
        return draws, flips(draws)


class DALILoader:
    """Batches ``[images, int64 labels]`` from a DALI pipeline, normalised and ready for the model.

    An iterable like a ``DataLoader``: it has a ``sampler`` (Lightning sets the epoch of a training
    sampler), a ``batch_size`` and a length, and each pass builds a pipeline that reads the samples in
    the sampler's order. Images are ``(N, 3, S, S)`` in ``dtype``, channels_last when asked, on
    ``device`` (a CUDA device: DALI's ``mixed`` decoder and GPU operators) or on the CPU.

    Args:
        samples: ``(path, class index)`` pairs of the split.
        batch_size: Images per batch.
        train: Random crop and flip (training) or resize and centre crop (evaluation).
        crop_size: Side of the output images.
        val_resize: Short side before the evaluation centre crop.
        crop_scale: Range of the crop's area, as a fraction of the image.
        threads: DALI's CPU threads.
        sampler: The order: ``(index, augmentation seed)`` pairs for training (``EpochSeededSampler``),
            indices for evaluation; ``None`` reads every sample in order.
        device: A CUDA device for the pipeline, or ``None`` for the CPU.
        channels_last: Lay the batch out as channels_last.
        dtype: ``torch.float32`` or ``torch.float16``.
        mean: Per-channel mean of images scaled to [0, 1].
        std: Per-channel standard deviation of images scaled to [0, 1].
        hw_decoder_load: On CUDA, the share of the JPEGs sent to the GPU's hardware JPEG decoder.
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
    ) -> None:
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"DALI batches are float32 or float16. Got {dtype}")
        if device is not None and device.type != "cuda":
            device = None
        import_dali()
        self.samples = list(samples)
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
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.hw_decoder_load = hw_decoder_load
        self._active: Generator[list[Tensor], None, None] | None = None

    def __len__(self) -> int:
        count = len(self.sampler) if self.sampler is not None else len(self.samples)  # type: ignore[arg-type]
        return math.ceil(count / self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's seed, saved in checkpoints, as ``PrefetchLoader`` saves it."""
        seed = getattr(self.sampler, "seed", None)
        return {} if seed is None else {"seed": int(seed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "seed" in state_dict and hasattr(self.sampler, "seed"):
            self.sampler.seed = int(state_dict["seed"])  # type: ignore[union-attr]

    def _order(self) -> tuple[list[int], list[int]]:
        """The sample indices of this pass and, for training, their augmentation seeds."""
        if self.sampler is None:
            return list(range(len(self.samples))), []
        items = list(self.sampler)
        if self.train:
            return [int(i) for i, _ in items], [int(s) for _, s in items]
        return [int(i) for i in items], []

    def _pipeline(self, files: list[str], labels: list[int], seeds: list[int]) -> Any:
        from nvidia.dali import fn, pipeline_def, types

        cuda = self.device is not None
        device_id = None
        # EXIF orientation is left alone, as PIL and torchvision.io leave it on the other paths.
        decode_args: dict[str, Any] = {"output_type": types.RGB, "adjust_orientation": False}
        if self.device is not None:
            device_id = self.device.index if self.device.index is not None else torch.cuda.current_device()
            decode_args["hw_decoder_load"] = self.hw_decoder_load
        decode_device = "mixed" if cuda else "cpu"
        size = self.crop_size

        # seed: nothing is drawn in the pipeline, the crops come from the samples' seeds
        @pipeline_def(batch_size=self.batch_size, num_threads=self.threads, device_id=device_id, seed=0)
        def pipeline() -> tuple[Any, Any]:
            encoded, label = fn.readers.file(
                files=files, labels=labels, random_shuffle=False, pad_last_batch=True, name="Reader"
            )
            shape = fn.peek_image_shape(encoded, adjust_orientation=False, dtype=types.FLOAT64)
            mirror: Any = 0
            if self.train:
                draws, mirror = fn.external_source(
                    source=_DrawSource(seeds, self.batch_size, self.crop_scale),
                    num_outputs=2,
                    batch=True,
                    dtype=[types.FLOAT64, types.INT32],
                )
                anchor, box = _crop_window_nodes(shape, draws, CROP_RATIO)
                images = fn.decoders.image_slice(
                    encoded, anchor, box, normalized_anchor=False, normalized_shape=False, device=decode_device,
                    **decode_args,
                )  # fmt: skip
                images = fn.resize(images, resize_x=size, resize_y=size, antialias=True)
                crop: dict[str, Any] = {}
            else:
                images = fn.decoders.image(encoded, device=decode_device, **decode_args)
                new_w, new_h, pos_x, pos_y = _eval_geometry(shape, self.val_resize, size)
                images = fn.resize(
                    images, resize_x=fn.cast(new_w, dtype=types.FLOAT), resize_y=fn.cast(new_h, dtype=types.FLOAT),
                    antialias=True,
                )  # fmt: skip
                crop = {
                    "crop": (size, size),
                    "crop_pos_x": fn.cast(pos_x, dtype=types.FLOAT),
                    "crop_pos_y": fn.cast(pos_y, dtype=types.FLOAT),
                }
            images = fn.crop_mirror_normalize(
                images,
                dtype=types.FLOAT16 if self.dtype == torch.float16 else types.FLOAT,
                output_layout="HWC" if self.channels_last else "CHW",
                mean=[255 * m for m in self.mean],
                std=[255 * s for s in self.std],
                mirror=mirror,
                **crop,
            )
            label = fn.reshape(fn.cast(label, dtype=types.INT64), shape=[])
            return images, label.gpu() if cuda else label

        return pipeline()

    def __iter__(self) -> Iterator[list[Tensor]]:
        if self._active is not None:
            self._active.close()  # a pass left part-way (limit_*_batches): its pipeline goes first
        self._active = self._batches()
        return self._active

    def _batches(self) -> Generator[list[Tensor], None, None]:
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        indices, seeds = self._order()
        if not indices:  # a shard with no samples, or an epoch resumed after its last batch
            return
        files = [self.samples[i][0] for i in indices]
        labels = [int(self.samples[i][1]) for i in indices]
        source = None
        batch = 0
        try:
            pipe = self._pipeline(files, labels, seeds)
            source = DALIGenericIterator(
                [pipe], ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL
            )
            while True:
                try:
                    out = next(source)[0]
                except StopIteration:
                    return
                images = out["images"]
                if self.channels_last:
                    images = images.permute(0, 3, 1, 2)  # NHWC memory seen as NCHW: channels_last, no copy
                yield [images, out["labels"]]
                batch += 1
        except RuntimeError as err:
            raise _named_error(err, files, batch, self.batch_size, self.threads) from None
        finally:
            del source


def _named_error(err: RuntimeError, files: list[str], batch: int, batch_size: int, threads: int) -> Exception:
    """A ``DataError`` naming the file that DALI failed on, or ``err`` when no file is to blame.

    DALI reports a decoding error without the file's name, for a batch that may be up to a few ahead
    of the one asked for (it prepares batches in advance): the files of those batches are decoded
    once more with PIL, and the first that fails is named with PIL's reason. A file that PIL reads
    but DALI does not is named when DALI's message names it.
    """
    from lit_imagenet.data import load_rgb  # here: data.py imports this module

    window = files[batch * batch_size : (batch + 1 + _BATCHES_AHEAD) * batch_size]

    def check(path: str) -> DataError | None:
        try:
            load_rgb(path)
        except DataError as bad:
            return bad
        return None

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for found in pool.map(check, window):
            if found is not None:
                return found
    message = str(err)
    for path in window:
        if path in message:
            lines = [line.strip() for line in message.splitlines() if path in line]
            reason = re.sub(r"\s+", " ", lines[0]) if lines else "DALI cannot decode it"
            return DataError(f"Cannot decode image {path} ({reason}); replace or remove the file.")
    return err
