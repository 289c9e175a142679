"""Accuracy metrics: top-1 and top-5 summed exactly across processes, and sync-free ones for training steps."""

from __future__ import annotations

from torch import Tensor
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy


def accuracy_metrics(num_classes: int, prefix: str, sync_free: bool = False) -> MetricCollection:
    """Top-1 and top-5 accuracy (top-k capped at the number of classes), summed exactly across ranks; ``sync_free``
    for training steps: the same figures from ``TopKAccuracy``."""
    ks = (1, min(5, num_classes))
    top = [TopKAccuracy(k) if sync_free else MulticlassAccuracy(num_classes, top_k=k, average="micro") for k in ks]
    # No compute groups: they merge metrics whose states happen to be equal after a batch.
    return MetricCollection({"top1": top[0], "top5": top[1]}, prefix=prefix, compute_groups=False)


class TopKAccuracy(MeanMetric):
    """The fraction of samples whose label is among the ``k`` highest logits: a sum and a count, exact across ranks,
    with no host-device synchronisation (``MulticlassAccuracy`` reads the GPU per update)."""

    def __init__(self, k: int) -> None:
        super().__init__(nan_strategy="disable")
        self.k = k

    def update(self, logits: Tensor, targets: Tensor) -> None:  # type: ignore[override]
        super().update(topk_hits(logits, targets, self.k).float())


def topk_hits(logits: Tensor, targets: Tensor, k: int) -> Tensor:
    """Per sample, whether its label is among the ``k`` highest logits."""
    return (logits.topk(k, dim=1).indices == targets.unsqueeze(1)).any(dim=1)
