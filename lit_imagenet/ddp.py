"""DDP helpers: the ``ddp_default_stream`` strategy, and a cross-rank maximum read without waiting for the GPU.

``ddp_default_stream`` is Lightning's DDP strategy with the model wrapped on the current CUDA stream.

Lightning 2.6 constructs ``DistributedDataParallel`` under a new side stream (done for whole-network
CUDA graph capture). DDP keeps references to the parameters' gradient accumulators made there, and
with torch 2.11 every backward then warns that "the AccumulateGrad node's stream does not match the
stream of the node that produced the incoming gradient", which "may incur unnecessary
synchronization". This strategy builds DDP on the stream the forward and backward passes run on.
Everything else is Lightning's ``DDPStrategy``: ``--trainer.strategy ddp_default_stream``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_imagenet.compat import ddp_kwargs, overrides_private


class DefaultStreamDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that wraps the model in ``DistributedDataParallel`` on the current stream."""

    strategy_name = "ddp_default_stream"

    @override
    @overrides_private(DDPStrategy)
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        device_ids = self.determine_ddp_device_ids()
        return DistributedDataParallel(module=model, device_ids=device_ids, **ddp_kwargs(self))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="DDP with the model wrapped on the current CUDA stream",
            start_method="popen",
        )


if DefaultStreamDDPStrategy.strategy_name not in StrategyRegistry:
    DefaultStreamDDPStrategy.register_strategies(StrategyRegistry)


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
