"""Batches that reach the GPU already normalised, one step ahead of the compute.

The idea is NVIDIA apex's ImageNet ``data_prefetcher`` (also timm's ``PrefetchLoader``): workers
collate uint8 images, which are a quarter of the bytes of float32; the main process copies batch
N+1 to the GPU on a side CUDA stream, converts it to float and normalises it there while the
default stream still computes batch N; the hand-over makes the default stream wait for the side
stream and records the tensors on it, so the caching allocator does not recycle their memory too
early.

Page-locked (pinned) host memory makes those copies asynchronous. Torch's caching host allocator
rounds each block up to a power of two and keeps it for reuse, so a run holds as many blocks as it
ever had batches pinned at once. ``DataLoader``'s pin thread pins every batch as soon as a worker hands
it over: with 15 workers two batches ahead and batches of 256, the training process held 31 blocks of
64 MiB (1.9 GiB) on an H200. On CUDA the prefetcher pins instead, in its own thread, only the batches
it is about to copy: a few blocks.

``PrefetchLoader`` is a ``DataLoader``, so Lightning injects its ``DistributedSampler`` and calls
``set_epoch`` on it as for any loader. Its ``device`` is set by the ``CUDAPrefetch`` callback (here,
below the LightningModule, which attaches it); on anything but a CUDA device it iterates like a plain
``DataLoader`` and the model normalises the uint8 batch itself after Lightning's transfer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.profiler import record_function
from torch.utils.data import DataLoader
from typing_extensions import override

from lit_imagenet.compat import stop_workers
from lit_imagenet.data.forking import forks_skip_parent_garbage
from lit_imagenet.data.presets import IMAGENET_MEAN, IMAGENET_STD, Uint8Normalize
from lit_imagenet.data.samplers import moves_by_epoch


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(b, device) for b in batch)
    return batch


def _pinned(batch: Any) -> Any:
    """``batch`` with its tensors in page-locked memory (those already there are kept, not copied)."""
    if isinstance(batch, Tensor):
        return batch if batch.is_pinned() else batch.pin_memory()
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pinned(b) for b in batch)
    if hasattr(batch, "pin_memory"):
        return batch.pin_memory()  # an EncodedBatch
    return batch


def _record(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            _record(b, stream)


class CUDAPrefetcher:
    """Iterates ``source`` ahead of the training loop, copying and normalising each batch on a side stream.

    A batch is a list or tuple whose first element is a uint8 image tensor; every tensor in it is
    moved to ``device``, and the images are normalised to float32. Such batches are prepared one
    step ahead.

    A batch with a ``decode(device)`` method (an ``EncodedBatch`` of JPEGs for nvJPEG) is decoded in
    a background thread, on a stream of its own: nvJPEG's batched decode blocks the calling thread
    until the GPU has finished, and done inline that wait would stall the launching of the current
    training step. Up to ``decode_ahead`` batches are queued for that thread, so that a batch which
    takes longer than a step to decode is made up by the next ones. Decoded batches wait in uint8;
    the hand-over makes the training stream wait for the batch's work on the device (not on the
    host) and normalises it there.

    With ``pin``, batches are not expected in page-locked memory: that thread pins each one (those
    already pinned are kept as they are), copies it to the device and normalises it on its stream, up to
    ``decode_ahead`` batches ahead, so that only those batches are pinned at any time, and the training
    stream only waits for them.

    In a profiler trace the host side shows as ``prefetch: next batch`` (waiting for the loader),
    ``prefetch: wait for decode`` (the training loop waiting for the decode thread) and
    ``prefetch: decode`` (the decode thread's work, pinning and copying included).
    """

    def __init__(
        self,
        source: Iterator[Any],
        device: torch.device,
        normalize: Uint8Normalize,
        decode_ahead: int = 2,
        pin: bool = False,
    ) -> None:
        if decode_ahead < 1:
            raise ValueError(f"decode_ahead must be at least 1. Got {decode_ahead}")
        self.source = source
        self.device = device
        self.normalize = normalize.to(device)
        self.decode_ahead = decode_ahead
        self.pin = pin
        self.stream = torch.cuda.Stream(device=device)
        # The constants were copied to the device on the current stream; the side stream reads them.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self._decoder: ThreadPoolExecutor | None = None
        self._decode_stream: torch.cuda.Stream | None = None
        self._pending: deque[Future[tuple[Any, torch.cuda.Event | None]]] = deque()
        self._exhausted = False
        self._preload()

    def _normalized(self, batch: Any) -> Any:
        if isinstance(batch, (list, tuple)) and isinstance(batch[0], Tensor) and batch[0].dtype == torch.uint8:
            return [self.normalize(batch[0]), *batch[1:]]
        return batch

    def _decode(self, batch: Any) -> tuple[Any, torch.cuda.Event]:
        # Runs in the decode thread: the current device and stream are per thread.
        assert self._decode_stream is not None
        stream = self._decode_stream
        with record_function("prefetch: decode"), torch.cuda.device(self.device), torch.cuda.stream(stream):
            if self.pin:
                batch = _pinned(batch)  # freed for reuse once the copy below has run
            if hasattr(batch, "decode"):
                out = batch.decode(self.device)  # kept in uint8 while queued: a quarter of the bytes of float32
            else:
                out = self._normalized(_to_device(batch, self.device))
            done = torch.cuda.Event()
            done.record(stream)
        return out, done

    def _preload(self) -> None:
        """Queues batches until ``decode_ahead`` encoded batches, or one plain batch, are on their way."""
        while not self._exhausted:
            depth = self.decode_ahead if self._decoder is not None else 1
            if len(self._pending) >= depth:
                return
            try:
                with record_function("prefetch: next batch"):
                    batch = next(self.source)
            except StopIteration:
                self._exhausted = True
                if self._decoder is not None:
                    self._decoder.shutdown(wait=False)  # the queued batches still finish
                return
            if self.pin or hasattr(batch, "decode"):
                if self._decoder is None:
                    self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-decode")
                    self._decode_stream = torch.cuda.Stream(device=self.device)
                    self._decode_stream.wait_stream(torch.cuda.current_stream(self.device))  # the constants' copy
                self._pending.append(self._decoder.submit(self._decode, batch))
                continue
            with torch.cuda.stream(self.stream):
                out = self._normalized(_to_device(batch, self.device))
            ready: Future[tuple[Any, torch.cuda.Event | None]] = Future()
            ready.set_result((out, None))
            self._pending.append(ready)

    def __iter__(self) -> CUDAPrefetcher:
        return self

    def __next__(self) -> Any:
        if not self._pending:
            raise StopIteration
        with record_function("prefetch: wait for decode"):
            batch, done = self._pending.popleft().result()  # an error from decoding is raised here, in the loop
        current = torch.cuda.current_stream(self.device)
        if done is None:
            current.wait_stream(self.stream)
            _record(batch, current)
        else:
            current.wait_event(done)
            _record(batch, current)
            batch = self._normalized(batch)  # a decoded batch, on the training stream: one small kernel
        self._preload()
        return batch


class PrefetchLoader(DataLoader):
    """A ``DataLoader`` that, given a CUDA ``device``, yields batches through a ``CUDAPrefetcher``.

    With a CUDA ``device``, ``pin_memory=True`` is carried out by the prefetcher, batch by batch as it
    copies them (``CUDAPrefetcher``'s ``pin``): ``DataLoader`` gets ``pin_memory=False``, so that it starts
    no pin thread, and ``pins_in_prefetcher`` is set.

    Args:
        *args: Passed to ``DataLoader``.
        device: Where batches go; ``None`` or a non-CUDA device iterates like a plain ``DataLoader``.
        mean: Per-channel mean for normalisation on the GPU.
        std: Per-channel standard deviation for normalisation on the GPU.
        decode_ahead: Encoded batches queued for decoding on the GPU (see ``CUDAPrefetcher``, which checks it).
        **kwargs: Passed to ``DataLoader``.
    """

    def __init__(
        self,
        *args: Any,
        device: torch.device | str | None = None,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        decode_ahead: int = 2,
        **kwargs: Any,
    ) -> None:
        self.device = torch.device(device) if device is not None else None
        self.pins_in_prefetcher = bool(kwargs.get("pin_memory")) and self._prefetches()
        if self.pins_in_prefetcher:
            kwargs["pin_memory"] = False  # no pin thread: the prefetcher pins
        super().__init__(*args, **kwargs)
        self.mean = tuple(mean)
        self.std = tuple(std)
        self.decode_ahead = decode_ahead
        self._next_epoch: tuple[int, Iterator[Any]] | None = None
        self._pass_workers: Iterator[Any] | None = None  # the iterator of a pass whose workers stop with it

    def _prefetches(self) -> bool:
        return self.device is not None and self.device.type == "cuda"

    def stop_workers(self) -> None:
        """Stops the worker processes of the pass under way, unless they are persistent; the next pass starts others.

        A pass stops them itself once it has its last batch; this is for a pass that ends earlier
        (``--trainer.limit_val_batches``, the sanity check): ``CUDAPrefetch`` calls it at each
        evaluation's end.
        """
        source, self._pass_workers = self._pass_workers, None
        if source is not None:
            stop_workers(source)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's seed, saved in checkpoints: a resumed run keeps the data order it started with.

        Where in the epoch to resume is not kept here (this loader runs ahead of training); the data
        module reads it from the trainer's restored progress.
        """
        seed = getattr(self.sampler, "seed", None)
        return {} if seed is None else {"seed": int(seed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "seed" in state_dict and hasattr(self.sampler, "seed"):
            self.sampler.seed = int(state_dict["seed"])

    def _stops_workers_with_each_pass(self) -> bool:
        return not self.persistent_workers and self.num_workers > 0

    def _starts_next_epoch_early(self) -> bool:
        # Only a shuffling sampler that knows its epoch (a training sampler) is moved on, and only
        # persistent workers keep decoding between two iterations.
        return self.persistent_workers and moves_by_epoch(self.sampler)

    def _start_next_epoch(self) -> None:
        epoch = int(self.sampler.epoch) + 1  # type: ignore[attr-defined]
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        self._next_epoch = (epoch, self._new_pass())

    def _new_pass(self) -> Iterator[Any]:
        with forks_skip_parent_garbage():  # DataLoader's iterator forks the workers (once, for persistent ones)
            return super().__iter__()

    def _epoch(self, source: Iterator[Any]) -> Iterator[Any]:
        """Yields the pass's batches; on its last one, starts the workers on the next epoch or stops them.

        Lightning stops asking once it has the pass's last batch (it counts them), so the loader's
        iterator never runs out by itself. Persistent training workers would sit idle through
        validation and checkpointing and start the next epoch only when asked, with the GPU waiting
        for its first batches: started here, they decode during that time instead. Workers that are not
        persistent (evaluation's, by default) would live on, holding their memory, until the next pass
        replaced the iterator: they are stopped here, once the last batch is in hand.
        """
        early = self._starts_next_epoch_early()
        total = len(self) if early or self._stops_workers_with_each_pass() else -1
        count = 0
        for batch in source:
            count += 1
            if count == total:
                if early:
                    # The loader's iterator is the persistent one: once it is moved on to the next
                    # epoch, this pass must not ask it for more.
                    self._start_next_epoch()
                else:
                    stop_workers(source)
                    if self._pass_workers is source:
                        self._pass_workers = None
                yield batch
                return
            yield batch
        if early and count > 0:  # a shorter pass (resumed part-way) ran out
            self._start_next_epoch()

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        early, self._next_epoch = self._next_epoch, None
        if early is not None and early[0] == getattr(self.sampler, "epoch", None):
            source = early[1]  # started when the last epoch ran out, for the epoch asked for now
        else:
            source = self._new_pass()
        if self._stops_workers_with_each_pass():
            self.stop_workers()  # a pass left unfinished
            self._pass_workers = source
        source = self._epoch(source)
        if not self._prefetches():
            return source
        normalize = Uint8Normalize(self.mean, self.std)
        return CUDAPrefetcher(source, self.device, normalize, self.decode_ahead, pin=self.pins_in_prefetcher)


class CUDAPrefetch(pl.Callback):
    """Turns on the side-stream prefetcher (``PrefetchLoader``) when the run is on a CUDA device.

    Lightning creates the loaders and draws their first batch before any epoch-start hook runs, so
    the device is handed to the data module in ``setup``; the data module's ``PrefetchLoader`` then
    copies and normalises each batch on a side stream, one step ahead. On other devices nothing
    changes and the model normalises the uint8 batches itself. A data module takes part by having a
    ``prefetch_device`` attribute.

    At the end of each validation, test and prediction it stops the worker processes of that pass
    (``PrefetchLoader.stop_workers``) unless they are persistent, also when the pass read fewer
    batches than its loader has (the sanity check, ``limit_val_batches``): training then runs with
    its own workers alone.

    ``ImageClassifier`` attaches it (``configure_callbacks``), so a plain ``Trainer().fit(model, data)``
    prefetches; on the command line ``--prefetch.enabled`` configures that one. A ``CUDAPrefetch`` given
    to the Trainer takes its place.

    Args:
        enabled: Set to ``False`` to transfer batches the plain way, on the default stream.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        datamodule = trainer.datamodule
        if datamodule is None or not hasattr(datamodule, "prefetch_device"):
            return
        device = trainer.strategy.root_device
        datamodule.prefetch_device = device if self.enabled and device.type == "cuda" else None

    @classmethod
    def _stop_workers(cls, loaders: Any) -> None:
        if isinstance(loaders, PrefetchLoader):
            loaders.stop_workers()
        elif isinstance(loaders, (list, tuple, dict)):
            for loader in loaders.values() if isinstance(loaders, dict) else loaders:
                cls._stop_workers(loader)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_workers(trainer.val_dataloaders)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_workers(trainer.test_dataloaders)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_workers(trainer.predict_dataloaders)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        datamodule = trainer.datamodule
        if datamodule is not None and hasattr(datamodule, "prefetch_device"):
            datamodule.prefetch_device = None
