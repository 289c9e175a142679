"""The DDP strategies the command line adds: ``ddp_default_stream`` and ``ddp_apex``.

``ddp_default_stream`` is Lightning's DDP strategy with the model wrapped on the current CUDA stream.
Lightning 2.6 constructs ``DistributedDataParallel`` under a new side stream (done for whole-network
CUDA graph capture). DDP keeps references to the parameters' gradient accumulators made there, and
with torch 2.11 every backward then warns that "the AccumulateGrad node's stream does not match the
stream of the node that produced the incoming gradient", which "may incur unnecessary
synchronization". This strategy builds DDP on the stream the forward and backward passes run on.

``ddp_apex`` is Lightning's DDP strategy with one change of order: apex needs ``amp.initialize`` to
see the bare model and its optimizer before DDP wraps the model, while Lightning's DDP strategy
wraps first and connects the precision plugin afterwards.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_imagenet.compat import ddp_kwargs, layer_sync, overrides_private
from lit_imagenet.training.precision import ApexAMP


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


class ApexDDPStrategy(DDPStrategy):
    """Lightning's DDP strategy, but ``amp.initialize`` runs on the bare model before DDP wraps it.

    Registered as ``ddp_apex``. With any precision plugin other than ``ApexAMP`` it behaves exactly
    like ``ddp``.
    """

    strategy_name = "ddp_apex"

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if not isinstance(self.precision_plugin, ApexAMP) or trainer.state.fn != TrainerFn.FITTING:
            super().setup(trainer)
            return
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        sync = layer_sync(self)
        if sync:
            self.model = sync.apply(self.model)
        self.model_to_device()
        self.setup_optimizers(trainer)
        model, optimizers = self.precision_plugin.initialize(self.model, self.optimizers)
        self.model, self.optimizers = model, optimizers
        self.configure_ddp()
        self.setup_precision_plugin()  # the plugin is initialised already: this only attaches it

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DDP with apex AMP initialised before wrapping", start_method="popen"
        )


if ApexDDPStrategy.strategy_name not in StrategyRegistry:
    ApexDDPStrategy.register_strategies(StrategyRegistry)
