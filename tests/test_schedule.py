import math

import pytest
import torch

from lit_imagenet.training.schedule import WarmupCosine, WarmupMultiStep, scaled_lr


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


def test_schedule_refuses_milestones_out_of_order() -> None:
    with pytest.raises(ValueError, match="increasing order"):
        WarmupMultiStep(5, milestones=[60, 30])


def test_cosine_warms_up_then_decays_to_zero_at_max_epochs() -> None:
    steps, epochs, warmup = 4, 5, 1
    schedule = WarmupCosine(steps, max_epochs=epochs, warmup_epochs=warmup)
    factors = [schedule(s) for s in range(steps * epochs + 1)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]  # the reference's per-step ramp
    decay = factors[4:]
    assert decay[0] == 1.0 and decay[-1] == 0.0
    assert all(a > b for a, b in zip(decay, decay[1:]))
    total = steps * (epochs - warmup)
    assert math.isclose(decay[total // 2], 0.5, abs_tol=1e-12)  # half-way down at half-way through
    assert schedule(10_000) == 0.0


def test_cosine_without_warmup_starts_at_full_rate_and_state_round_trips() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [param], "lr": 1.0}, {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(10, max_epochs=3))
    assert opt.param_groups[0]["lr"] == 1.0
    for _ in range(7):
        opt.step()
        sched.step()
    head, backbone = (g["lr"] for g in opt.param_groups)
    assert math.isclose(backbone, 0.1 * head, rel_tol=1e-12)
    restored = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(1, max_epochs=1))
    restored.load_state_dict(sched.state_dict())
    assert restored.lr_lambdas[0].steps_per_epoch == 10 and restored.lr_lambdas[0].max_epochs == 3


def test_cosine_refuses_a_warmup_as_long_as_the_run() -> None:
    with pytest.raises(ValueError, match="must be below --trainer.max_epochs"):
        WarmupCosine(2, max_epochs=2, warmup_epochs=2)


def _torch_rates(warmup: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, n: int) -> list[float]:
    rates = []
    for _ in range(n):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        warmup.step()
    return rates


@pytest.mark.parametrize("method", ["linear", "constant"])
def test_torchvision_warmup_gives_torchs_linear_and_constant_rates_in_both_schedules(method: str) -> None:
    steps, warmup_epochs, decay = 3, 2, 0.01
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    total = warmup_epochs * steps
    if method == "linear":  # torchvision's --lr-warmup-method linear: LinearLR from the decay to 1
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=decay, total_iters=total)
    else:
        warmup = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=decay, total_iters=total)
    expected = _torch_rates(warmup, optimizer, total)
    step = WarmupMultiStep(steps, warmup_epochs, milestones=[5], warmup_method=method, warmup_decay=decay)
    cosine = WarmupCosine(steps, max_epochs=4, warmup_epochs=warmup_epochs, warmup_method=method, warmup_decay=decay)
    for schedule in (step, cosine):
        got = [schedule(s) for s in range(total)]
        assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
        assert schedule(total) == 1.0  # warmed up: the schedule's own factor
    assert expected[0] == decay and (expected[-1] == decay) == (method == "constant")


def test_warmup_decay_none_keeps_the_references_warmup_and_constant_needs_a_decay() -> None:
    default, explicit = WarmupMultiStep(4, 2), WarmupMultiStep(4, 2, warmup_method="linear", warmup_decay=None)
    reference = [(2 + s) / 8 if s < 8 else 1.0 for s in range(12)]  # the reference's ramp ends just above 1
    assert [explicit(s) for s in range(12)] == [default(s) for s in range(12)] == reference
    with pytest.raises(ValueError, match="warmup_decay"):
        WarmupCosine(4, 3, 1, warmup_method="constant")
    with pytest.raises(ValueError, match="warmup_method"):
        WarmupMultiStep(4, 2, warmup_method="exponential")
