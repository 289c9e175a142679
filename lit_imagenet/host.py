"""Reading GPU values on the host without waiting for the GPU's whole queue of work.

``copy_to_host`` starts a copy to pinned memory and records an event behind it; ``read_host_copy``
waits for that event only, so a value read a little later costs the GPU no idle time.
``sync_device`` is the full wait, for clocks that must measure the work queued so far.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
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
