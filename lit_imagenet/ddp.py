"""Lightning's DDP strategy with the model wrapped on the current CUDA stream, as ``ddp_default_stream``.

Lightning 2.6 constructs ``DistributedDataParallel`` under a new side stream (done for whole-network
CUDA graph capture). DDP keeps references to the parameters' gradient accumulators made there, and
with torch 2.11 every backward then warns that "the AccumulateGrad node's stream does not match the
stream of the node that produced the incoming gradient", which "may incur unnecessary
synchronization". This strategy builds DDP on the stream the forward and backward passes run on.
Everything else is Lightning's ``DDPStrategy``: ``--trainer.strategy ddp_default_stream``.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
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
