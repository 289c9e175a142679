"""The DDP strategies the command line adds: ``ddp_default_stream`` and ``ddp_apex``."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from pytorch_lightning.trainer.states import TrainerFn
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_imagenet.compat import ddp_kwargs, layer_sync, overrides_private
from lit_imagenet.training.precision import ApexAMP


class DefaultStreamDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that wraps the model on the current CUDA stream: Lightning's side stream makes every backward
    warn that the gradient accumulators' stream does not match."""

    strategy_name = "ddp_default_stream"

    @override
    @overrides_private(DDPStrategy)
    def _setup_model(self, model: Module) -> DistributedDataParallel:
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **ddp_kwargs(self))


class ApexDDPStrategy(DDPStrategy):
    """``ddp``, but with ``ApexAMP`` apex's ``amp.initialize`` runs on the bare model before DDP wraps it."""

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
        self.model, self.optimizers = self.precision_plugin.initialize(self.model, self.optimizers)
        self.configure_ddp()
        self.setup_precision_plugin()  # the plugin is initialised already: this only attaches it


for _strategy in (DefaultStreamDDPStrategy, ApexDDPStrategy):
    if _strategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(_strategy.strategy_name, _strategy, _strategy.__doc__, start_method="popen")
