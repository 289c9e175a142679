import pytest
import torch

from lit_imagenet.module import accuracy_metrics, train_accuracy_metrics


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
    metrics = train_accuracy_metrics(4, "train/")
    logits = torch.eye(4)[[0, 1, 2, 3]] * 5
    step = metrics(logits, torch.tensor([0, 1, 3, 2]))
    assert step["train/top1"].item() == 0.5 and step["train/top5"].item() == 1.0
    metrics(logits, torch.tensor([0, 1, 2, 3]))
    assert metrics.compute()["train/top1"].item() == 0.75
