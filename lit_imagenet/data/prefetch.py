"""Batches copied to the GPU and normalised on a side stream one step ahead of the compute (apex's
``data_prefetcher``). On anything but CUDA, ``PrefetchLoader`` iterates like a plain ``DataLoader``."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
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

# A batch on the device, the event its copy recorded, and the augmentations left to the iterating thread.
_Copied = tuple[Any, torch.cuda.Event, Callable[[Tensor], Tensor] | None]


def _map(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(b, fn) for b in batch)
    return batch


def _pinned(batch: Any) -> Any:
    if not isinstance(batch, (Tensor, list, tuple)) and hasattr(batch, "pin_memory"):
        return batch.pin_memory()  # an EncodedBatch
    return _map(batch, lambda t: t if t.is_pinned() else t.pin_memory())


class CUDAPrefetcher:
    """Iterates ``source`` one batch ahead, copying it to ``device`` and normalising its uint8 images on a side stream.
    A batch with a ``decode(device)`` method (nvJPEG's, which blocks its thread), and with ``pin`` every batch, is
    pinned, copied and decoded in a thread and stream of its own, up to ``decode_ahead`` batches ahead."""

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
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self._decoder: ThreadPoolExecutor | None = None
        self._decode_stream: torch.cuda.Stream | None = None
        self._pending: deque[Future[_Copied]] = deque()
        self._exhausted = False
        self._preload()

    def _normalized(self, batch: Any) -> Any:
        if isinstance(batch, (list, tuple)) and isinstance(batch[0], Tensor) and batch[0].dtype == torch.uint8:
            return [self.normalize(batch[0]), *batch[1:]]
        return batch

    def _copy(self, batch: Any, stream: torch.cuda.Stream) -> _Copied:
        # Also runs in the decode thread, whose current device and stream are its own.
        augment = None
        with record_function("prefetch: copy"), torch.cuda.device(self.device), torch.cuda.stream(stream):
            if self.pin:
                batch = _pinned(batch)  # freed for reuse once the copy below has run
            if hasattr(batch, "decode"):
                augment = getattr(batch, "gpu_augment", None)  # run by the iterating thread, as torch's generators are
                out = batch.decode(self.device, augment=augment is None)  # uint8 while queued: a quarter of float32
            else:
                out = self._normalized(_map(batch, lambda t: t.to(self.device, non_blocking=True)))
            done = torch.cuda.Event()
            done.record(stream)
        return out, done, augment

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
                self._pending.append(self._decoder.submit(self._copy, batch, self._decode_stream))
                continue
            ready: Future[_Copied] = Future()
            ready.set_result(self._copy(batch, self.stream))
            self._pending.append(ready)

    def __iter__(self) -> CUDAPrefetcher:
        return self

    def __next__(self) -> Any:
        if not self._pending:
            raise StopIteration
        with record_function("prefetch: wait for decode"):
            batch, done, augment = self._pending.popleft().result()  # an error from decoding is raised here
        current = torch.cuda.current_stream(self.device)
        current.wait_event(done)
        _map(batch, lambda t: t.record_stream(current))
        if augment is not None:
            with record_function("prefetch: augment"):
                batch = [augment(batch[0]), *batch[1:]]
        batch = self._normalized(batch)  # a decoded batch's images, on the training stream: one small kernel
        self._preload()
        return batch


class SamplerSeed:
    """A loader's ``state_dict``: its sampler's seed, saved in checkpoints, so that a resumed run keeps its order."""

    sampler: Any

    def state_dict(self) -> dict[str, Any]:
        seed = getattr(self.sampler, "seed", None)
        return {} if seed is None else {"seed": int(seed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "seed" in state_dict and hasattr(self.sampler, "seed"):
            self.sampler.seed = int(state_dict["seed"])


class PrefetchLoader(SamplerSeed, DataLoader):
    """A ``DataLoader`` that, given a CUDA ``device``, yields batches through a ``CUDAPrefetcher`` normalising with
    ``mean`` and ``std``, which then does ``pin_memory`` (``pins_in_prefetcher``); else a plain ``DataLoader``."""

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
        on_cuda = self.device is not None and self.device.type == "cuda"
        self.pins_in_prefetcher = bool(kwargs.get("pin_memory")) and on_cuda
        if self.pins_in_prefetcher:
            kwargs["pin_memory"] = False  # no pin thread: the prefetcher pins
        super().__init__(*args, **kwargs)
        self.mean, self.std = tuple(mean), tuple(std)
        self.decode_ahead = decode_ahead
        self._pass_workers: Iterator[Any] | None = None  # the iterator of a pass whose workers stop with it

    def stop_workers(self) -> None:
        """Stops the non-persistent workers of a pass that ended before its last batch (``limit_val_batches``)."""
        source, self._pass_workers = self._pass_workers, None
        if source is not None:
            stop_workers(source)

    def _epoch(self, source: Iterator[Any]) -> Iterator[Any]:
        """Yields the pass's batches, stopping its workers at the last one (they would hold memory)."""
        total = len(self)
        for count, batch in enumerate(islice(source, total), 1):
            if count == total:
                stop_workers(source)
                if self._pass_workers is source:
                    self._pass_workers = None
            yield batch

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        with forks_skip_parent_garbage():  # DataLoader's iterator forks the workers (once, for persistent ones)
            source = super().__iter__()
        if not self.persistent_workers and self.num_workers > 0:
            self.stop_workers()  # a pass left unfinished
            self._pass_workers = source
            source = self._epoch(source)
        if self.device is None or self.device.type != "cuda":
            return source
        normalize = Uint8Normalize(self.mean, self.std)
        return CUDAPrefetcher(source, self.device, normalize, self.decode_ahead, pin=self.pins_in_prefetcher)


class CUDAPrefetch(pl.Callback):
    """Turns on the prefetcher (``PrefetchLoader``) on a CUDA device unless ``enabled=False``, through the data module's
    ``prefetch_device``; stops each evaluation's non-persistent workers at its end. ``ImageClassifier`` attaches one."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if hasattr(trainer.datamodule, "prefetch_device"):  # None has none
            device = trainer.strategy.root_device
            trainer.datamodule.prefetch_device = device if self.enabled and device.type == "cuda" else None

    @staticmethod
    def _stop_workers(loaders: Any) -> None:
        for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
            if isinstance(loader, PrefetchLoader):
                loader.stop_workers()

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
        if hasattr(trainer.datamodule, "prefetch_device"):
            trainer.datamodule.prefetch_device = None
