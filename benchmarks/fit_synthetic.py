"""``train.py fit`` on random uint8 batches made on the GPU: the training loop's own speed, with no data loading.

Takes the arguments of ``train.py`` (``--model.*``, ``--trainer.*``, the callbacks' options), with ``--data.*`` those
of ``SyntheticDataModule`` below (batch_size, crop_size, num_classes, train_steps, val_steps, channels_last):

    python benchmarks/fit_synthetic.py fit --trainer.precision 16-mixed --data.train_steps 100
"""

import sys
from collections.abc import Iterator
from pathlib import Path

import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a checkout, installed or not

from lit_imagenet.cli import main  # noqa: E402


class _Repeated:
    """``steps`` times ``batch``, with a length and a batch size (a list of batches would read as several loaders)."""

    def __init__(self, batch: list[torch.Tensor], steps: int) -> None:
        self.batch, self.steps, self.batch_size = batch, steps, len(batch[1])

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        return iter([self.batch] * self.steps)


class SyntheticDataModule(pl.LightningDataModule):
    """The same random uint8 batch of ``batch_size`` square ``crop_size`` images every step, made on the training
    device: ``fit`` with no loading or copying, to measure the training loop itself. ``channels_last=None``: on CUDA.
    """

    def __init__(
        self,
        batch_size: int = 256,
        crop_size: int = 224,
        channels_last: bool | None = None,
        num_classes: int = 1000,
        train_steps: int = 100,
        val_steps: int = 2,
    ) -> None:
        super().__init__()
        if min(batch_size, crop_size, num_classes, train_steps) < 1 or val_steps < 0:
            raise ValueError("batch_size, crop_size, num_classes and train_steps must be positive.")
        self.batch_size, self.crop_size = batch_size, crop_size
        self.num_classes, self.classes = num_classes, [f"class_{i}" for i in range(num_classes)]
        self.train_steps, self.val_steps = train_steps, val_steps
        self.channels_last = channels_last
        self.prefetch_device: torch.device | None = None

    def _batches(self, steps: int) -> _Repeated:
        device = self.prefetch_device or (self.trainer.strategy.root_device if self.trainer is not None else None)
        device = torch.device(device if device is not None else "cpu")
        g = torch.Generator(device=device).manual_seed(0)
        shape = (self.batch_size, 3, self.crop_size, self.crop_size)
        images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
        if self.channels_last or (self.channels_last is None and device.type == "cuda"):
            images = images.contiguous(memory_format=torch.channels_last)
        targets = torch.randint(0, self.num_classes, (self.batch_size,), device=device, generator=g)
        return _Repeated([images, targets], steps)

    def train_dataloader(self) -> _Repeated:
        return self._batches(self.train_steps)

    def val_dataloader(self) -> _Repeated:
        return self._batches(self.val_steps)


if __name__ == "__main__":
    main(datamodule_class=SyntheticDataModule)
