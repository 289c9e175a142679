"""``apex.amp`` as the plugin uses it: initialize, scale_loss, master_params, state_dict, load_state_dict."""

import contextlib
import os

import torch

calls = []
_state = {"loss_scale": float(os.environ.get("FAKE_AMP_SCALE", "1024.0")), "unskipped": 0}


def initialize(model, optimizers=None, **kwargs):
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    calls.append(("initialize", type(model).__name__, wrapped, kwargs))
    if wrapped:
        raise AssertionError("amp.initialize received a DDP-wrapped model")
    return (model, optimizers) if optimizers is not None else model


@contextlib.contextmanager
def scale_loss(loss, optimizer):
    scale = _state["loss_scale"]
    yield loss * scale
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.div_(scale)
    _state["unskipped"] += 1
    calls.append(("scale_loss", scale))


def master_params(optimizer):
    for group in optimizer.param_groups:
        yield from group["params"]


def state_dict():
    return {"loss_scaler0": dict(_state)}


def load_state_dict(state):
    calls.append(("load_state_dict", state))
    _state.update(state["loss_scaler0"])
