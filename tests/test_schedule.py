import math

import pytest
import torch

from lit_imagenet.schedule import WarmupMultiStep, scaled_lr


def reference_lr(base: float, epoch: int, step: int, len_epoch: int) -> float:
    """The example's adjust_learning_rate, restated: step is the 1-based iteration in the epoch."""
    factor = epoch // 30
    if epoch >= 80:
        factor += 1
    lr = base * (0.1**factor)
    if epoch < 5:
        lr = lr * float(1 + step + epoch * len_epoch) / (5.0 * len_epoch)
    return lr


@pytest.mark.parametrize("len_epoch", [1, 7, 50])
def test_schedule_matches_reference_at_every_step_of_90_epochs(len_epoch: int) -> None:
    base = scaled_lr(0.1, 256 * 8)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupMultiStep(len_epoch))
    for epoch in range(90):
        for i in range(1, len_epoch + 1):
            expected = reference_lr(base, epoch, i, len_epoch)
            assert math.isclose(optimizer.param_groups[0]["lr"], expected, rel_tol=1e-12), (epoch, i)
            optimizer.step()
            scheduler.step()


def test_schedule_state_round_trips_through_state_dict() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupMultiStep(10, warmup_epochs=2, milestones=[3]))
    for _ in range(17):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.SGD([param], lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, WarmupMultiStep(1))
    sched2.load_state_dict(state)
    assert sched2.lr_lambdas[0].steps_per_epoch == 10
    assert sched2.lr_lambdas[0](17) == sched.lr_lambdas[0](17)


def test_scaled_lr_is_per_256_images() -> None:
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 2048) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="at least 1"):
        scaled_lr(0.1, 0)


@pytest.mark.parametrize("kwargs", [{"steps_per_epoch": 0}, {"steps_per_epoch": 5, "milestones": [60, 30]}])
def test_schedule_refuses_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        WarmupMultiStep(**kwargs)
