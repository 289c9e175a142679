"""torchvision's recipe's augmentations on the CPU decoders: the policies, random erasing and the training crop size,
drawn from the samples' seeds."""

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image

from lit_imagenet.data.augment import Augment, apply_policy, erase_boxes, policy_transform
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.datasets import collate_uint8
from lit_imagenet.errors import ConfigError
from lit_imagenet.training.module import ImageClassifier

DECODERS = ["pil", "torchvision"]


def _module(root: Path, decoder: str, seed: int = 5, **options) -> ImageFolderDataModule:
    return ImageFolderDataModule(str(root), batch_size=8, workers=0, crop_size=32, val_resize=36, decoder=decoder,
                                 seed=seed, **options)  # fmt: skip


def _first_batch(root: Path, decoder: str, seed: int = 5, **options) -> torch.Tensor:
    return next(iter(_module(root, decoder, seed, **options).train_dataloader()))[0]


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize(
    "options",
    [{"auto_augment": "ta_wide"}, {"auto_augment": "ra"}, {"auto_augment": "augmix"}, {"random_erase": 1.0}],
    ids=["ta_wide", "ra", "augmix", "random_erase"],
)
def test_an_augmented_batch_differs_from_a_plain_one_and_is_the_same_for_the_same_seed(
    shapes_root: Path, decoder: str, options: dict
) -> None:
    plain = _first_batch(shapes_root, decoder)
    augmented = _first_batch(shapes_root, decoder, **options)
    assert augmented.shape == plain.shape and augmented.dtype == torch.uint8
    assert not torch.equal(augmented, plain)
    torch.manual_seed(123)  # the augmentations do not come from the process's generator
    assert torch.equal(_first_batch(shapes_root, decoder, **options), augmented)
    assert not torch.equal(_first_batch(shapes_root, decoder, seed=6, **options), augmented)


@pytest.mark.parametrize("decoder", DECODERS)
def test_erasing_fills_the_box_of_the_seed_with_the_mean_colour(shapes_root: Path, decoder: str) -> None:
    module = _module(shapes_root, decoder, random_erase=1.0)
    plain = _first_batch(shapes_root, decoder)
    erased = next(iter(module.train_dataloader()))[0]
    seeds = [seed for _, seed in list(module.train_dataloader().sampler)[:8]]
    boxes = erase_boxes(seeds, 32, 32, 1.0)
    assert (boxes[:, 2] > 0).all()
    fill = torch.tensor(Augment.fill_of(module.mean), dtype=torch.uint8)
    assert module.augment.fill == tuple(fill.tolist()) == (124, 116, 104)
    for k, (top, left, height, width) in enumerate(boxes.tolist()):
        inside = torch.zeros(32, 32, dtype=torch.bool)
        inside[top : top + height, left : left + width] = True
        assert (erased[k][:, inside] == fill[:, None]).all()
        assert torch.equal(erased[k][:, ~inside], plain[k][:, ~inside])


@pytest.mark.parametrize("decoder", DECODERS)
def test_the_training_crop_size_is_apart_from_the_evaluation_crop(shapes_root: Path, decoder: str) -> None:
    module = _module(shapes_root, decoder, train_crop_size=24)
    assert next(iter(module.train_dataloader()))[0].shape == (8, 3, 24, 24)
    assert next(iter(module.val_dataloader()))[0].shape == (8, 3, 32, 32)
    larger = _module(shapes_root, decoder, train_crop_size=40)  # above val_resize: only the evaluation is bound to it
    assert next(iter(larger.train_dataloader()))[0].shape == (8, 3, 40, 40)
    assert _module(shapes_root, decoder).train_crop_size == 32


@pytest.mark.parametrize(
    "option, message",
    [
        ({"train_crop_size": 0}, "train_crop_size must be at least 1"),
        ({"auto_augment": "autoaugment"}, "auto_augment must be one of ta_wide, ra, augmix or null"),
        ({"ra_magnitude": 31}, "ra_magnitude must be in"),
        ({"augmix_severity": 0}, "augmix_severity must be in"),
        ({"random_erase": 1.5}, "random_erase must be a probability"),
        ({"ra_reps": 0}, "ra_reps must be at least 1"),
    ],
)
def test_bad_augmentation_options_are_refused_in_one_line(shapes_root: Path, option: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:  # the command line prints it as one line
        _module(shapes_root, "pil", **option)
    assert "\n" not in str(error.value)


def test_a_batch_of_pil_crops_and_erased_tensor_crops_is_collated_alike() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (6, 5, 3), dtype=np.uint8) for _ in range(3)]
    tensors = [torch.from_numpy(a).permute(2, 0, 1) for a in arrays]
    mixed = [(Image.fromarray(arrays[0]), 0), (tensors[1], 1), (Image.fromarray(arrays[2]), 2)]
    images, targets = collate_uint8(mixed)
    assert torch.equal(images, torch.stack(tensors)) and targets.tolist() == [0, 1, 2]


def test_a_fit_with_every_augmentation_option_runs(shapes_root: Path, tmp_path: Path) -> None:
    module = ImageFolderDataModule(
        str(shapes_root), batch_size=4, workers=1, crop_size=32, val_resize=36, train_crop_size=24, seed=3,
        auto_augment="ta_wide", random_erase=0.5, ra_reps=2,
    )  # fmt: skip
    model = ImageClassifier("resnet18", num_classes=3, lr=0.1, warmup_epochs=0)
    shapes: list[tuple[int, ...]] = []

    class Shapes(pl.Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
            shapes.append(tuple(batch[0].shape))

    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=2, limit_val_batches=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[Shapes()])  # fmt: skip
    trainer.fit(model, module)
    assert trainer.global_step == 2 and shapes == [(4, 3, 24, 24)] * 2
    assert torch.isfinite(trainer.callback_metrics["train/loss_step"])


def test_the_policy_leaves_the_process_generators_as_they_were() -> None:
    """A policy drawn from a sample's seed must not move the draws of the training (dropout, MixUp, ...)."""
    augment = Augment(policy="ta_wide")
    transform = policy_transform(augment)
    img = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    first = apply_policy(transform, img, seed=3)
    assert torch.equal(torch.rand(4), expected)
    assert torch.equal(apply_policy(transform, img, seed=3), first)
