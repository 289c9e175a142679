"""An exponential moving average of a network's weights, as torchvision's reference keeps it (``--model-ema``).

Not Lightning's ``EMAWeightAveraging``, which swaps the average in for validation and deep-copies the whole module:
``WeightEMA`` is a submodule holding a copy of the network alone, saved and validated beside the raw weights.
"""

from __future__ import annotations

import copy
import itertools

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn


def adjusted_decay(decay: float, global_batch: int, ema_steps: int, max_epochs: int) -> float:
    """torchvision's adjustment of the EMA decay to the images between updates and to the epochs."""
    return 1.0 - min(1.0, (1.0 - decay) * global_batch * ema_steps / max(1, max_epochs))


class WeightEMA(nn.Module):
    """A copy of ``network``'s parameters and buffers, without gradients, that ``update`` moves towards it.
    ``fresh`` (saved with the weights): the next update copies, as torchvision's does when its count is 0."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.module = copy.deepcopy(network).requires_grad_(False)
        self.fresh = True

    def get_extra_state(self) -> dict[str, bool]:
        return {"fresh": self.fresh}

    def set_extra_state(self, state: dict[str, bool]) -> None:
        self.fresh = bool(state["fresh"])

    @torch.no_grad()
    def update(self, network: nn.Module, decay: float | None) -> None:
        """``ema = decay * ema + (1 - decay) * weight`` for every parameter and buffer; ``None``: a copy."""
        mine = itertools.chain(self.module.parameters(), self.module.buffers())
        pairs = list(zip(mine, itertools.chain(network.parameters(), network.buffers()), strict=True))
        if decay is None:
            for average, weight in pairs:
                average.copy_(weight)
            return
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for average, weight in pairs:
            pair = groups.setdefault((average.device, average.dtype), ([], []))
            pair[0].append(average)
            pair[1].append(weight.detach())
        average_fn = get_ema_multi_avg_fn(decay)
        for averages, weights in groups.values():
            average_fn(averages, weights, None)
