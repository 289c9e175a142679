"""The DALI loader (``--data.decoder dali``): an iterable of batches, like a ``DataLoader``, over DALI pipelines.

DALI is an optional dependency (``pip install 'lit_imagenet[dali-cuda130]'``, or ``[dali-cuda120]`` for a
torch built for CUDA 12); it is imported only when this decoder is used. On a CUDA device every step
after file reading runs on the GPU and the batch reaches the model with no further copy; elsewhere the
same pipeline (``lit_imagenet.data.dali.pipeline``) runs on the CPU.

The data module's sampler gives the order: the training order, shard of each process and
augmentation seed of each sample are those of the other decoders (``EpochSeededSampler``), and
validation shards are ``UnpaddedDistributedSampler``'s. Each process's reader gets the files of its
own shard, rather than the whole list with DALI's ``shard_id``/``num_shards``, whose shards differ in
length: under DDP every process must train the same number of batches.

A pipeline reads the files in the sampler's order, so a resumed epoch starts at the first batch not
yet trained on. Building a pipeline takes a noticeable time, so pipelines are kept and built ahead:
when epochs are short one pipeline reads several in a row, each padded to whole batches, and the
pipeline of the next epochs is built in a thread while validation and checkpointing run.
"""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import Sampler

from lit_imagenet.data import dali_primer
from lit_imagenet.data.dali.pipeline import CropSource, GeometrySource, build_pipeline
from lit_imagenet.data.images import ImageSizes, load_rgb
from lit_imagenet.data.index import SampleTable
from lit_imagenet.data.presets import IMAGENET_MEAN, IMAGENET_STD
from lit_imagenet.data.samplers import EpochSeededSampler, moves_by_epoch
from lit_imagenet.errors import ConfigError, DataError, undecodable_image

if TYPE_CHECKING:
    from types import ModuleType

HW_DECODER_LOAD = 0.65
# Batches DALI may have read beyond the one it hands over when an error surfaces: its output queue
# (prefetch_queue_depth, 2 by default) and the file reader's own queue.
_BATCHES_AHEAD = 3
# A training pipeline reads as many whole epochs as fit in PASS_SAMPLES samples, PASS_EPOCHS at most: building
# one takes the best part of a second, a good share of a short epoch (ImageNet's on 64 GPUs is 20,000 images a
# process), while the epochs' orders take about a microsecond per sample to draw and 100 bytes to hold.
PASS_SAMPLES = 262_144
PASS_EPOCHS = 16
#: Why no list file could be made in this process, once it has been said.
_NO_LIST_FILE: list[str] = []
# The first batches of a long pass come from a pipeline of their own, whose build does not grow with the
# dataset's size; the one of the rest, whose reader takes a list of every file of the pass, is built while
# they train.
HEAD_BATCHES = 64


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


def batch_dtype(precision: str | None) -> torch.dtype:
    """The dtype of DALI's normalised batches for a Lightning precision: float16 for ``16-*``, else float32.

    DALI has no bfloat16 output; bfloat16 runs get float32 (autocast casts it, ``bf16-true`` converts it).
    """
    return torch.float16 if str(precision).startswith("16") else torch.float32


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
        max_batches: Evaluation only: the batches a pass reads (Lightning's ``limit_*_batches``), None
            for all. The reader then holds only their files, so that each pass reads them all and the
            pipeline is kept for the next pass instead of being built again (its buffers stay
            allocated, on the GPU on CUDA, between passes).
        pass_samples: Training only: a pipeline reads as many whole epochs as fit in this many samples
            (at least one, ``PASS_EPOCHS`` at most), so that short epochs do not each pay for building one.
        epochs: Training only: the run's number of epochs (Lightning's ``max_epochs``), None when not
            known: no pipeline is built ahead for epochs beyond it.
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
        pass_samples: int = PASS_SAMPLES,
        epochs: int | None = None,
    ) -> None:
        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"DALI batches are float32 or float16. Got {dtype}")
        if device is not None and device.type != "cuda":
            device = None
        import_dali()
        self.samples = SampleTable.of(samples)
        self.batch_size = batch_size
        self.train = train
        self.crop_size = crop_size
        self.val_resize = val_resize
        self.crop_scale = crop_scale
        self.threads = max(1, threads)
        self.sampler = sampler
        self.device = device
        if device is not None and device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # pipelines may be built in another thread
        self.channels_last = channels_last
        self.dtype = dtype
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.hw_decoder_load = hw_decoder_load
        self.max_batches = None if train or max_batches is None else max(0, int(max_batches))
        self.pass_samples = pass_samples
        self.head_batches = HEAD_BATCHES
        self.epochs = epochs if epochs is not None and epochs > 0 else None
        self._kept: _Pass | None = None  # a pipeline ready for the next pass (see ``_batches``)
        self._sizes = ImageSizes(self.samples)  # read from the headers as the batches need them
        self._active: Generator[list[Tensor], None, None] | None = None
        self._builder: ThreadPoolExecutor | None = None
        self._building: Future[_Pass | None] | None = None  # the next training pipeline, being built

    def __len__(self) -> int:
        count = len(self.sampler) if self.sampler is not None else len(self.samples)  # type: ignore[arg-type]
        batches = math.ceil(count / self.batch_size)
        return batches if self.max_batches is None else min(batches, self.max_batches)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's seed, saved in checkpoints, as ``PrefetchLoader`` saves it."""
        seed = getattr(self.sampler, "seed", None)
        return {} if seed is None else {"seed": int(seed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "seed" in state_dict and hasattr(self.sampler, "seed"):
            self.sampler.seed = int(state_dict["seed"])  # type: ignore[union-attr]

    def _eval_order(self) -> np.ndarray:
        """The sample indices of an evaluation pass."""
        if self.sampler is None:
            indices = np.arange(len(self.samples), dtype=np.int64)
        else:
            indices = np.fromiter(iter(self.sampler), dtype=np.int64)
        if self.max_batches is not None:
            indices = indices[: self.max_batches * self.batch_size]
        return indices

    def _training_epochs(self, sampler: Sampler | None) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(epoch, sample indices, augmentation seeds)`` of the epochs a training pipeline reads, in order.

        ``sampler``'s current epoch (part of it when resumed), then, for a sampler whose order moves by
        epoch, the epochs after it, as many whole ones as fit in ``pass_samples`` samples (``PASS_EPOCHS``
        at most), drawn from copies of it.
        """
        if sampler is None:
            count = len(self.samples)
            return [(0, np.arange(count, dtype=np.int64), np.zeros(count, dtype=np.uint64))]
        epoch = int(getattr(sampler, "epoch", 0))
        epochs = [(epoch, *_next_pass(sampler))]
        if moves_by_epoch(sampler):
            full = max(1, len(sampler))  # type: ignore[arg-type]
            end = epoch + min(PASS_EPOCHS, max(1, self.pass_samples // full))
            for later in range(epoch + 1, end if self.epochs is None else min(end, self.epochs)):
                ahead = copy.copy(sampler)
                ahead.set_epoch(later)  # type: ignore[attr-defined]
                epochs.append((later, *_next_pass(ahead)))
        return epochs

    def _pipeline(self, indices: np.ndarray, seeds: np.ndarray | None) -> Any:
        """The pipeline of samples ``indices``, built.

        Its reader takes their list as a file of ``path label`` lines (``SampleTable.listing``), made for it in
        memory (``_list_file``) and closed once it is built, or, where the table cannot be listed
        (``SampleTable.listable``) or no such file can be made, as lists of paths and labels, which take DALI
        seconds a million paths to take over, holding the interpreter that the training loop needs meanwhile.
        """
        source: CropSource | GeometrySource
        if seeds is not None:
            source = CropSource(indices, seeds, self._sizes.get, self.batch_size, self.crop_scale)
        else:
            source = GeometrySource(indices, self._sizes.get, self.batch_size, self.val_resize, self.crop_size)
        listed = self._list_file(indices) if self.samples.listable() else None
        if listed is not None:
            handle, path = listed
            files: dict[str, Any] = {"files": None, "labels": None, "file_list": path, "file_root": self.samples.root}
        else:
            files = {"files": self.samples.paths(indices), "labels": self.samples.labels[indices].tolist()}
        dali_primer.settle()  # DALI's decoder, started at launch (training.warmup): this build finds it ready
        try:
            pipe = build_pipeline(
                source=source, batch_size=self.batch_size, threads=self.threads,
                device_id=None if self.device is None else self.device.index, crop_size=self.crop_size,
                dtype=self.dtype, channels_last=self.channels_last, mean=self.mean, std=self.std,
                hw_decoder_load=self.hw_decoder_load, **files,
            )  # fmt: skip
            pipe.build()  # its reader reads the list here
        finally:
            if listed is not None:
                os.close(handle)
        dali_primer.release()  # what it started stays with the process; its buffers go
        return pipe

    def _list_file(self, indices: np.ndarray) -> tuple[int, str] | None:
        """A file listing samples ``indices`` for a reader, in memory: its descriptor and a path that opens it while
        the descriptor is open; ``None`` where none can be made.

        It is written nowhere and goes with its descriptor, so that a process killed while a pipeline is built
        (a list of ImageNet's training files is about 42 MB) leaves nothing behind. Where none can be made, the
        process says why once, in one line, and the readers take lists of paths instead: the same batches, slower
        to build.
        """
        handle = None
        try:
            handle = os.memfd_create("lit_imagenet_dali_list", os.MFD_CLOEXEC)
            path = f"/proc/self/fd/{handle}"
            if not os.path.exists(path):
                raise OSError(f"{path} does not open it: /proc is not mounted")
            view = memoryview(self.samples.listing(indices))
            while view:
                view = view[os.write(handle, view) :]
            return handle, path
        except (AttributeError, OSError) as error:  # AttributeError: no memfd_create on this system
            if handle is not None:
                os.close(handle)
            if not _NO_LIST_FILE:  # said once a process
                _NO_LIST_FILE.append(str(error))
                reason = error.strerror if isinstance(error, OSError) and error.strerror else error
                rank_zero_warn(
                    f"DALI's readers take lists of paths, slower to build: no list file could be made ({reason})."
                )
            return None

    def _start(self, sampler: Sampler | None = None, split: bool = False) -> _Pass | None:
        """Builds the pipeline of a pass in the sampler's current order; DALI prepares its first batch meanwhile.

        Training reads the order of ``sampler``, the loader's own by default (a resumed epoch's skip is then
        used up), or a copy of it for a pipeline built ahead.

        A training pipeline reads the epochs of ``_training_epochs`` one after the other, each padded to
        whole batches with its last sample (as DALI's reader pads a last batch); the padding is cut from
        each epoch's last batch. The images' sizes, which the crops need, are read from their headers as
        the batches need them, and ahead of them in a thread, so nothing is read for the whole pass first.

        With ``split``, a pass longer than twice ``head_batches`` starts with a pipeline of its first
        ``head_batches`` batches alone, whose build does not grow with the dataset's size, and the
        pipeline of the rest (``_Pass.rest``) is built in the loader's thread while they train.
        """
        sampler = self.sampler if sampler is None else sampler
        seed = getattr(sampler, "seed", None)
        if not self.train:
            indices = self._eval_order()
            return self._build(indices, None, [(0, len(indices))], seed, indices) if len(indices) else None
        epochs = self._training_epochs(sampler)
        indices, seeds = _padded(epochs, self.batch_size)
        if len(indices) == 0:  # a shard with no samples, or an epoch resumed after its last batch
            return None
        head = self.head_batches * self.batch_size
        if not split or len(epochs[0][1]) <= 2 * head:
            return self._build(indices, seeds, [(epoch, len(order)) for epoch, order, _ in epochs], seed, indices)
        first, order, drawn = epochs[0]
        spans = [(first, len(order) - head)] + [(epoch, len(later)) for epoch, later, _ in epochs[1:]]
        started = self._build(indices[:head], seeds[:head], [(first, head)], seed, read_ahead=indices)
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dali-pipeline")
        started.rest = self._builder.submit(self._build, indices[head:], seeds[head:], spans, seed, None)
        return started

    def _build(
        self,
        indices: np.ndarray,
        seeds: np.ndarray | None,
        spans: list[tuple[int, int]],
        seed: int | None,
        read_ahead: np.ndarray | None,
    ) -> _Pass:
        """The pipeline that reads ``indices`` (with their ``seeds`` for training) behind DALI's iterator.

        ``read_ahead``: the order whose headers the size thread is to read ahead of the batches (``None``: the
        one it reads already, for the rest of a pass whose first part started it).
        """
        from nvidia.dali.plugin.base_iterator import LastBatchPolicy
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        if read_ahead is not None:
            # The first batches' sizes are read as DALI prepares them; the thread reads on from there.
            self._sizes.read_ahead(read_ahead[(1 + _BATCHES_AHEAD) * self.batch_size :])
        try:
            pipe = self._pipeline(indices, seeds)
            source = DALIGenericIterator(
                [pipe], ["images", "labels"], reader_name="Reader", last_batch_policy=LastBatchPolicy.PARTIAL
            )
        except RuntimeError as err:
            raise _named_error(err, self._window(indices, 0), self.threads) from None
        return _Pass(source, indices, spans, seed)

    def _window(self, indices: np.ndarray, batch: int) -> list[str]:
        """The files of batch ``batch`` of a pass and of the batches DALI may have read beyond it."""
        return self.samples.paths(indices[batch * self.batch_size : (batch + 1 + _BATCHES_AHEAD) * self.batch_size])

    def _continues(self, kept: _Pass) -> bool:
        """Whether a kept pipeline's next batches are those the sampler asks for now."""
        if not self.train:
            return np.array_equal(kept.indices, self._eval_order())
        epoch, _ = kept.spans[kept.span]
        return (
            epoch == getattr(self.sampler, "epoch", None)
            and kept.seed == getattr(self.sampler, "seed", None)
            and (not isinstance(self.sampler, EpochSeededSampler) or self.sampler.skips() == 0)
        )

    def _start_next_epoch(self) -> None:
        """Moves the sampler on to its next epoch and builds that epoch's pipeline in a thread of the loader's.

        Building one holds the thread that does it for the best part of a second (longer with several
        epochs' orders to draw), mostly in DALI's code, which lets other threads run: the training loop
        goes on to validation and checkpointing meanwhile, and the next ``__iter__`` waits for it.
        """
        self.sampler.set_epoch(int(self.sampler.epoch) + 1)  # type: ignore[union-attr]
        if self._builder is None:
            self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dali-pipeline")
        self._building = self._builder.submit(self._start_ahead, copy.copy(self.sampler))

    def _start_ahead(self, sampler: Sampler) -> _Pass | None:
        try:
            return self._start(sampler)
        except DataError:
            return None  # the pass asked for next builds it again, and stops on the error there

    def __iter__(self) -> Iterator[list[Tensor]]:
        if self._active is not None:
            self._active.close()  # a pass left part-way (limit_*_batches): its pipeline goes first
        building, self._building = self._building, None
        if building is not None:
            self._kept = building.result()
        kept, self._kept = self._kept, None
        started: _Pass | None | bool = False
        if kept is not None and self._continues(kept):
            started = kept  # the next epoch of a training pipeline, or an evaluation one rewound
        elif kept is not None:
            kept.source = None  # another epoch or order is asked for (a resume): that pipeline goes
        self._active = self._batches(started)
        return self._active

    def _batches(self, started: _Pass | None | bool) -> Generator[list[Tensor], None, None]:
        """Yields the batches of one epoch (training) or one pass (evaluation) of a pipeline.

        Building a pipeline takes a good part of a second, holding the GIL, so pipelines are kept:
        - a training pipeline reads several epochs when they are short (``pass_samples``), and is kept
          after each epoch's last batch for the next epoch; it goes once its last epoch is read, and the
          pipeline of the following epochs is built then, so that it reads, decodes and resizes its
          first batches during validation and checkpointing instead of the GPU waiting for them at the
          next epoch's start (``PrefetchLoader`` moves its workers on likewise);
        - an evaluation pipeline that hands over the last batch of its files is rewound and kept for
          the next pass, which reads the same files.
        Lightning stops asking once it has an epoch's last batch.
        """
        current = self._start(split=True) if started is False else started
        if current is None:
            return
        early = self.train and moves_by_epoch(self.sampler)
        try:
            while True:
                _, count = current.spans[current.span]
                total = math.ceil(count / self.batch_size)
                whole = current.rest is None  # else the epoch goes on in the pipeline of its rest
                if total == 0 and whole:
                    self._epoch_read(current, early)
                for batch in range(total):
                    try:
                        out = next(current.source)[0]
                    except StopIteration:  # not expected: the reader holds every batch of its epochs
                        break
                    current.read += 1
                    images, labels = out["images"], out["labels"]
                    if self.channels_last:
                        images = images.permute(0, 3, 1, 2)  # NHWC memory seen as NCHW: channels_last, no copy
                    if batch == total - 1 and whole:
                        last = count - batch * self.batch_size
                        if last < images.shape[0]:
                            images, labels = images[:last], labels[:last]  # padding: a view, no copy
                        self._epoch_read(current, early)
                    yield [images, labels]
                if whole:
                    return
                rest = current.rest.result()  # built meanwhile; a data error of its first batches is raised here
                current.source, current.rest = None, None
                current = rest
        except RuntimeError as err:
            raise _named_error(err, self._window(current.indices, current.read), self.threads) from None
        finally:
            if current is not self._kept:
                current.source = None

    def _epoch_read(self, current: _Pass, early: bool) -> None:
        """After an epoch's last batch: the pipeline is kept for what it reads next, or goes."""
        current.span += 1
        if not self.train:
            current.source.reset()  # all its files read: back to the first batch, for the next pass
            current.span, current.read = 0, 0
            self._kept = current
        elif current.span < len(current.spans):
            self._kept = current  # it reads on into the next epoch while this one ends
            self.sampler.set_epoch(current.spans[current.span][0])  # type: ignore[union-attr]
        elif early and (self.epochs is None or current.spans[-1][0] + 1 < self.epochs):
            current.source = None  # this pipeline is done: it goes before the next one is built
            self._start_next_epoch()


class _Pass:
    """A pipeline (behind DALI's iterator), the samples it reads in order, and where it is in them.

    ``spans`` are the ``(epoch, samples)`` of the epochs it reads (one span for evaluation), ``span``
    the one it reads next, ``read`` the batches handed over so far, ``seed`` the sampler's seed;
    ``rest``, for the first part of an epoch, the pipeline of the rest of it, being built.
    """

    def __init__(self, source: Any, indices: np.ndarray, spans: list[tuple[int, int]], seed: int | None) -> None:
        self.source = source
        self.indices = indices
        self.spans = spans
        self.span = 0
        self.read = 0
        self.seed = seed
        self.rest: Future[_Pass] | None = None


def _padded(epochs: list[tuple[int, np.ndarray, np.ndarray]], batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The indices and seeds of ``epochs`` one after the other, each padded to whole batches with its last sample."""
    indices, seeds = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.uint64)]
    for _, order, drawn in epochs:
        if len(order):
            short = -len(order) % batch_size
            indices += [order, np.repeat(order[-1:], short)]
            seeds += [drawn, np.repeat(drawn[-1:], short)]
    return np.concatenate(indices), np.concatenate(seeds)


def _next_pass(sampler: Sampler) -> tuple[np.ndarray, np.ndarray]:
    """The sample indices and augmentation seeds of ``sampler``'s next pass, as its iterator gives them."""
    if isinstance(sampler, EpochSeededSampler):
        return sampler.next_pass()
    items = list(sampler)
    return np.array([i for i, _ in items], dtype=np.int64), np.array([s for _, s in items], dtype=np.uint64)


def _named_error(err: RuntimeError, window: list[str], threads: int) -> Exception:
    """A ``DataError`` naming the file of ``window`` that DALI failed on, or ``err`` when no file is to blame.

    DALI reports a decoding error without the file's name, for a batch that may be up to a few ahead
    of the one asked for (it prepares batches in advance): the files of those batches are decoded
    once more with PIL, and the first that fails is named with PIL's reason. A file that PIL reads
    but DALI does not is named when DALI's message names it.
    """

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
            return undecodable_image(path, re.sub(r"\s+", " ", lines[0]) if lines else "DALI cannot decode it")
    return err
