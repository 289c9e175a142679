"""Reading GPU values on the host without waiting for the GPU's whole queue of work.

``copy_to_host`` starts a copy to pinned memory and records an event behind it; ``read_host_copy``
waits for that event only, so a value read a little later costs the GPU no idle time.
``DelayedMax`` does the same for a maximum over all ranks, started at one check and read at the
next. ``sync_device`` is the full wait, for clocks that must measure the work queued so far.
"""

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
    """Starts copying ``tensor`` to host memory, without waiting for the GPU.

    Returns the copy and, for a CUDA tensor, an event recorded right after it on the tensor's
    current stream: call ``event.synchronize()`` before reading the copy. That wait lasts until the
    GPU has done the work queued before the copy, not the work queued since, so a value read a
    little later (after the step's backward pass and optimizer step were queued) costs the GPU no
    idle time, where ``.item()`` or ``.cpu()`` would wait for the whole queue.
    """
    tensor = tensor.detach()
    if tensor.device.type != "cuda":
        return tensor.clone(), None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(tensor.device)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return host, event


def read_host_copy(copy: tuple[Tensor, torch.cuda.Event | None]) -> Tensor:
    """The value of a ``copy_to_host`` copy, once the GPU has written it."""
    host, ready = copy
    if ready is not None:
        ready.synchronize()
    return host


class DelayedMax:
    """A maximum over all ranks of a few int64 figures, started at one check and read at the next.

    ``start`` copies the figures into a device slot, all-reduces them there under DDP and starts
    copying the result into pinned host memory; ``read`` returns that result once the GPU has
    written it, which at the next check it did long ago, so neither waits for the GPU's queued work.
    Two slots are used in turn, and they live as long as this object: a copy or a collective still
    queued on the GPU never writes into memory that the caching allocator has handed to another
    tensor. Every rank must call ``start`` at the same batches, as for any collective.

    Args:
        size: How many figures.
        device: Where the figures are computed.
    """

    def __init__(self, size: int, device: torch.device) -> None:
        self._device = torch.zeros((2, size), dtype=torch.int64, device=device)
        self._host = torch.zeros((2, size), dtype=torch.int64, pin_memory=device.type == "cuda")
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def start(self, figures: Tensor) -> int:
        """Starts the maximum of ``figures`` (on this object's device) over all ranks; returns its slot."""
        slot, self._next = self._next, 1 - self._next
        value = self._device[slot]
        value.copy_(figures)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        if value.is_cuda:
            self._host[slot].copy_(value, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(value.device))
            self._events[slot] = event
        else:
            self._host[slot].copy_(value)
        return slot

    def read(self, slot: int) -> list[int]:
        """The maximum started in ``slot``, waiting for the GPU only if it has not written it yet."""
        event, self._events[slot] = self._events[slot], None
        if event is not None:
            event.synchronize()
        return [int(v) for v in self._host[slot].tolist()]
