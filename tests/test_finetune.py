import math
import pickle
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from lit_imagenet import ImageClassifier, ImageFolderDataModule
from lit_imagenet.training.models import backbone_parameters, build_model


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _backbone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if not k.startswith("fc.")}


@pytest.mark.parametrize("form", ["plain", "lightning", "reference"])
def test_weights_file_of_every_form_loads_and_the_head_is_replaced(form: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = build_model("resnet18", 10)
    state = source.state_dict()
    if form == "plain":
        obj: object = state
    elif form == "lightning":
        obj = {"state_dict": ImageClassifier("resnet18", num_classes=10).state_dict(), "epoch": 3}
        state = {k.removeprefix("model."): v for k, v in obj["state_dict"].items() if k.startswith("model.")}
    else:  # what the reference's save_checkpoint wrote for a DistributedDataParallel model
        obj = {
            "epoch": 90,
            "arch": "resnet18",
            "state_dict": {f"module.{k}": v for k, v in state.items()},
            "best_prec1": 69.8,
            "optimizer": torch.optim.SGD(source.parameters(), lr=0.1, momentum=0.9).state_dict(),
        }
    path = tmp_path / f"{form}.pth"
    torch.save(obj, path)
    model = ImageClassifier("resnet18", num_classes=3, weights=str(path))
    loaded = model.model.state_dict()
    assert _same(_backbone(loaded), _backbone(state))
    assert loaded["fc.weight"].shape == (3, 512)


def test_weights_of_another_architecture_are_refused_with_the_key(tmp_path: Path) -> None:
    path = tmp_path / "r34.pt"
    torch.save(build_model("resnet34", 3).state_dict(), path)
    with pytest.raises(ValueError, match=r"r34.pt does not fit ResNet .*unexpected layer1.2"):
        build_model("resnet18", 3, str(path))


class _Payload:
    """Unpickling this would create a file: proof that code from the weights file ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_weights_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"fc.weight": torch.zeros(3, 512)}, "payload": _Payload(marker)}, path)
    with open(path, "rb") as f:
        assert b"touch" in f.read()  # the file really carries the call
    with pytest.raises(ValueError, match="Cannot load weights file .*evil.pt safely"):
        ImageClassifier("resnet18", num_classes=3, weights=str(path))
    assert not marker.exists()
    plain = tmp_path / "evil.pkl"
    plain.write_bytes(pickle.dumps(_Payload(marker), protocol=2))
    with pytest.raises(ValueError, match="safely"):
        build_model("resnet18", 3, str(plain))
    assert not marker.exists()


class _Watch(pl.Callback):
    """Per training batch: the two groups' rates, whether backbone batchnorms train, and the backbone's grad flags."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, float, float, bool, bool]] = []
        self.after_epoch: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        head, backbone = trainer.optimizers[0].param_groups
        bn = pl_module.model.bn1
        grad = all(p.requires_grad for p in backbone_parameters(pl_module.model, pl_module.head_name))
        self.rows.append((trainer.current_epoch, head["lr"], backbone["lr"], bn.training, grad))

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.after_epoch.append({k: v.clone() for k, v in pl_module.model.state_dict().items()})


def test_frozen_backbone_then_smaller_backbone_rate_on_a_cosine_schedule(shapes_root: Path, tmp_path: Path) -> None:
    pl.seed_everything(0)
    dm = ImageFolderDataModule(str(shapes_root), batch_size=8, workers=0, crop_size=32, val_resize=36)
    model = ImageClassifier(
        "resnet18", num_classes=3, lr=0.4, warmup_epochs=1, lr_schedule="cosine",
        freeze_backbone_epochs=1, backbone_lr_scale=0.1,
    )  # fmt: skip
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    watch = _Watch()
    trainer = pl.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", max_epochs=3, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[watch],
    )  # fmt: skip
    trainer.fit(model, dm)

    steps = 3  # 24 images in batches of 8
    assert len(watch.rows) == 3 * steps
    base = 0.4 * 8 / 256
    for i, (epoch, head_lr, backbone_lr, bn_training, grad) in enumerate(watch.rows):
        factor = (i + 1) / steps if i < steps else 0.5 * (1 + math.cos(math.pi * (i - steps) / (2 * steps)))
        assert math.isclose(head_lr, base * factor, rel_tol=1e-9), i
        assert math.isclose(backbone_lr, 0.1 * head_lr, rel_tol=1e-9), i
        assert bn_training == grad == (epoch >= 1), i

    frozen, thawed = watch.after_epoch[0], watch.after_epoch[1]
    assert _same(_backbone(frozen), _backbone(before))  # weights and batchnorm running statistics alike
    assert not torch.equal(frozen["fc.weight"], before["fc.weight"])
    assert not torch.equal(thawed["layer1.0.conv1.weight"], before["layer1.0.conv1.weight"])
    assert not torch.equal(thawed["bn1.running_mean"], before["bn1.running_mean"])
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs", [dict(lr_schedule="linear"), dict(freeze_backbone_epochs=-1), dict(backbone_lr_scale=-0.1)]
)
def test_bad_finetuning_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ImageClassifier("resnet18", num_classes=3, **kwargs)


def test_ckpt_path_last_with_nothing_to_resume_starts_from_the_weights(shapes_root: Path, tmp_path: Path) -> None:
    """The first launch of a self-resuming fine-tuning job: ``--ckpt_path last`` finds nothing yet."""
    from lit_imagenet.cli import main
    from lit_imagenet.training.models import build_model
    from tests.cli_args import fit_args

    source = build_model("resnet18", 1000)
    path = tmp_path / "pretrained.pth"
    torch.save(source.state_dict(), path)
    cli = main(fit_args(shapes_root, tmp_path / "out", "--model.weights", str(path), "--ckpt_path", "last",
                        "--trainer.max_steps", "0"))  # fmt: skip
    assert cli.trainer.global_step == 0
    assert torch.equal(cli.model.model.conv1.weight, source.conv1.weight)


def test_resume_follows_this_runs_schedule_and_starts_the_epoch_sums_empty(shapes_root: Path, tmp_path: Path) -> None:
    """A cosine run resumed with more epochs decays over the new length; epoch-end sums do not carry over."""
    dm = ImageFolderDataModule(str(shapes_root), batch_size=8, workers=0, crop_size=32, val_resize=36)

    def trainer(max_epochs: int, callbacks: list) -> pl.Trainer:
        return pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_epochs=max_epochs,
                          logger=CSVLogger(tmp_path),  # with a logger the metrics are reset after the checkpoint
                          enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1,
                          callbacks=callbacks)  # fmt: skip

    def model() -> ImageClassifier:
        return ImageClassifier("resnet18", num_classes=3, lr=0.4, warmup_epochs=0, lr_schedule="cosine")

    # The checkpoint callback saves after validation, before Lightning resets the training metrics.
    trainer(1, [ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/top1", mode="max", save_last=True)]).fit(
        model(), dm
    )
    path = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert saved["train_loss.weight"] == 0 and saved["train_metrics.top1.weight"] == 0

    class Watch(pl.Callback):
        rates: list[float] = []
        sums: list[float] = []

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            self.sums.append(float(pl_module.train_loss.weight))

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])

    watch = Watch()
    trainer(2, [watch]).fit(model(), dm, ckpt_path=str(path))
    steps, base = 3, 0.4 * 8 / 256  # 24 images in batches of 8
    expected = [base * 0.5 * (1 + math.cos(math.pi * (steps + i) / (2 * steps))) for i in range(steps)]
    assert watch.rates == pytest.approx(expected, rel=1e-9)
    assert watch.sums == [0.0]
