"""Reading GPU values on the host without waiting for the GPU's whole queue of work."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import Tensor


def sync_device(pl_module: pl.LightningModule) -> None:
    """Waits for the module's GPU, so that a host clock measures the work queued so far."""
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)


def copy_to_host(tensor: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """Starts copying ``tensor`` to the host; returns the copy and, on CUDA, the event ``read_host_copy`` waits for."""
    if tensor.device.type != "cuda":
        return tensor.clone(), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return host, event


def read_host_copy(copy: tuple[Tensor, torch.cuda.Event | None]) -> Tensor:
    """The value of a ``copy_to_host`` copy, once the GPU has written it."""
    host, ready = copy
    if ready is not None:
        ready.synchronize()
    return host


class DelayedMax:
    """A maximum over all ranks of ``size`` int64 figures on ``device``, started at one check and read at the next
    (every rank starts checks at the same batches). Its two slots live as long as it does, so no queued copy or
    collective writes into memory handed elsewhere."""

    def __init__(self, size: int, device: torch.device) -> None:
        self._device = torch.zeros((2, size), dtype=torch.int64, device=device)
        self._host = torch.zeros((2, size), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._pending: int | None = None

    def start(self, figures: Tensor) -> int:
        """Starts the maximum of ``figures`` (on this object's device) over all ranks; returns its slot."""
        slot, self._next = self._next, 1 - self._next
        value = self._device[slot]
        value.copy_(figures)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        self._host[slot].copy_(value, non_blocking=value.is_cuda)
        if value.is_cuda:
            event = self._events[slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(value.device))
        return slot

    def read(self, slot: int) -> list[int]:
        """The maximum started in ``slot``, waiting for the GPU only if it has not written it yet."""
        event, self._events[slot] = self._events[slot], None
        return [int(v) for v in read_host_copy((self._host[slot], event)).tolist()]

    def step(self, figures: Tensor) -> list[int] | None:
        """Starts the maximum of ``figures``; returns the one the previous ``step`` started (``None`` at the first)."""
        previous, self._pending = self._pending, self.start(figures)
        return None if previous is None else self.read(previous)

    def now(self, figures: Tensor) -> list[int]:
        """The maximum of ``figures`` over all ranks, waiting for it; the check in flight is dropped."""
        self._pending = None
        return self.read(self.start(figures))
