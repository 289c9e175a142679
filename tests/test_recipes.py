"""``configs/resnet50_tv2.yaml``: torchvision's ResNet-50 V2 recipe resolves to torchvision's values and trains."""

import csv
import re
from pathlib import Path

import pytest
import torch

from lit_imagenet.cli import main
from tests.cli_args import error_lines

REPO = Path(__file__).resolve().parents[1]
TV2 = str(REPO / "configs" / "resnet50_tv2.yaml")
CPU = ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"]


def test_the_tv2_recipe_has_torchvisions_values(shapes_root: Path, tmp_path: Path) -> None:
    cli = main(["--config", TV2, "--data.root", str(shapes_root), "--trainer.default_root_dir", str(tmp_path), *CPU],
               run=False)  # fmt: skip
    hp, data = cli.model.hparams, cli.datamodule
    assert hp.lr * (8 * data.batch_size) / 256 == 0.5  # torchvision's --lr 0.5 at its global batch of 8 x 128
    assert (hp.lr_schedule, hp.warmup_epochs, hp.warmup_method, hp.warmup_decay) == ("cosine", 5, "linear", 0.01)
    assert (hp.weight_decay, hp.norm_weight_decay, hp.label_smoothing) == (2e-5, 0.0, 0.1)
    assert (hp.mixup_alpha, hp.cutmix_alpha, hp.ema_decay, hp.ema_steps) == (0.2, 1.0, 0.99998, 32)
    assert (data.augment.policy, data.augment.random_erase, data.ra_reps) == ("ta_wide", 0.1, 4)
    assert (data.train_crop_size, data.val_resize, data.crop_size) == (176, 232, 224)
    assert cli.trainer.max_epochs == 600 and data.batch_size == 128


def test_the_tv2_recipe_trains_two_steps_and_validates_both_weights(
    shapes_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    main(["fit", "--config", TV2, "--data.root", str(shapes_root), "--trainer.default_root_dir", str(tmp_path), *CPU,
          "--data.batch_size", "4", "--data.workers", "0", "--data.train_crop_size", "32", "--data.val_resize", "40",
          "--data.crop_size", "36", "--trainer.max_steps", "2", "--trainer.limit_train_batches", "2",
          "--trainer.limit_val_batches", "1", "--model.compile", "false", "--model.arch", "resnet18"])  # fmt: skip
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["global_step"] == 2
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert any(r.get("val/top1") for r in rows) and any(r.get("val_ema/top1") for r in rows)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Epoch 0 validation: "))
    assert re.search(r"top-1 \d\.\d{4}, .*, EMA top-1 \d\.\d{4}, EMA top-5 \d\.\d{4} \(", line), line


def test_a_warmup_as_long_as_the_run_is_refused_in_one_line(shapes_root: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", TV2, "--data.root", str(shapes_root), "--trainer.default_root_dir", str(tmp_path),
              *CPU, "--data.workers", "0", "--trainer.max_epochs", "5", "--model.compile", "false"])  # fmt: skip
    assert exc.value.code == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert err == (
        "error: The cosine schedule decays after the warmup: --model.warmup_epochs (5) must be below "
        "--trainer.max_epochs (5); lower it or train longer."
    )
