import functools

import pytest
import torch

from lit_imagenet.training.metrics import accuracy_metrics

train_accuracy_metrics = functools.partial(accuracy_metrics, sync_free=True)


def reference_accuracy(output: torch.Tensor, target: torch.Tensor, topk=(1,)) -> list[float]:
    """The example's precision@k, restated: percentage of rows whose target is in the top k."""
    _, pred = output.topk(max(topk), 1, True, True)
    correct = pred.t().eq(target.view(1, -1).expand_as(pred.t()))
    return [correct[:k].reshape(-1).float().sum().item() * 100.0 / target.size(0) for k in topk]


@pytest.mark.parametrize("make", [accuracy_metrics, train_accuracy_metrics])
def test_top1_top5_equal_reference_accuracy_over_batches(make) -> None:
    torch.manual_seed(0)
    metrics = make(20, "val/")
    all_logits, all_targets = [], []
    for n in (17, 64, 3):
        logits = torch.randn(n, 20)
        targets = torch.randint(0, 20, (n,))
        logits[: n // 3, 0] += 10  # make some rows confidently right or wrong
        metrics.update(logits, targets)
        all_logits.append(logits)
        all_targets.append(targets)
    top1, top5 = reference_accuracy(torch.cat(all_logits), torch.cat(all_targets), topk=(1, 5))
    got = metrics.compute()
    assert 0 < top1 < 100 and 0 < top5 < 100
    assert abs(got["val/top1"].item() * 100 - top1) < 1e-4
    assert abs(got["val/top5"].item() * 100 - top5) < 1e-4


@pytest.mark.parametrize("make", [accuracy_metrics, train_accuracy_metrics])
def test_top5_is_capped_at_number_of_classes(make) -> None:
    metrics = make(3, "val/")
    metrics.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    assert metrics.compute()["val/top5"].item() == 1.0


def test_train_metrics_give_the_batch_value_when_called() -> None:
    metrics = accuracy_metrics(4, "train/", sync_free=True)
    logits = torch.eye(4)[[0, 1, 2, 3]] * 5
    step = metrics(logits, torch.tensor([0, 1, 3, 2]))
    assert step["train/top1"].item() == 0.5 and step["train/top5"].item() == 1.0
    metrics(logits, torch.tensor([0, 1, 2, 3]))
    assert metrics.compute()["train/top1"].item() == 0.75


@pytest.mark.parametrize("make", [accuracy_metrics, train_accuracy_metrics])
def test_top1_and_top5_stay_apart_when_their_first_batches_agree(make) -> None:
    """No label in the first batch's top 5: top-1 and top-5 counts are equal after it, and must not be merged."""
    metrics = make(10, "train/")
    targets = torch.tensor([0, 1, 2, 3])
    first = torch.zeros(4, 10)
    first[:, 5:] = torch.arange(5, 0, -1).float()  # the top 5 are classes 5 to 9
    metrics.update(first, targets)
    second = torch.zeros(4, 10)
    second[:, 9] = 2.0
    second[torch.arange(4), targets] = 1.0  # every label second: a top-1 miss and a top-5 hit
    metrics.update(second, targets)
    got = metrics.compute()
    assert got["train/top1"].item() == 0.0 and got["train/top5"].item() == 0.5
