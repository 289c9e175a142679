"""The weights' EMA: torchvision's rule, validated beside the raw weights, exact across a SIGKILL, predicted with."""

import csv
import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lit_imagenet.cli import main
from lit_imagenet.export import export, load_network
from lit_imagenet.training.module import ImageClassifier
from tests.cli_args import SMALL_ARCH, fit_args
from tests.runs import final_checkpoint
from tests.test_resume import _start, kill_when

EMA = ["--model.ema_decay", "0.9", "--model.ema_steps", "2", "--model.ema_warmup_epochs", "1"]


def _tensors(network: torch.nn.Module) -> list[torch.Tensor]:
    return [t.detach().clone() for t in itertools.chain(network.parameters(), network.buffers())]


def test_twenty_steps_follow_torchvisions_ema_rule_with_its_decay_adjustment(shapes_root: Path, tmp_path: Path) -> None:
    steps: list[tuple[int, list[torch.Tensor]]] = []  # (epoch, raw weights) after each optimizer step

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            steps.append((trainer.current_epoch, _tensors(pl_module.model)))

    # 24 training images in batches of 4: 6 steps an epoch; max_steps 20 ends in epoch 3 of max_epochs 10.
    args = ["--trainer.max_steps", "20", "--trainer.max_epochs", "10", "--trainer.limit_val_batches", "0", *EMA]
    cli = main(fit_args(shapes_root, tmp_path, *args, batch_size=4, arch=SMALL_ARCH)[1:], run=False)
    cli.trainer.callbacks.append(Record())
    first = _tensors(cli.model.model)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(steps) == 20

    # torchvision's train.py: alpha = 1 - decay, times world size x batch x ema steps / epochs, at most 1.
    decay = 1.0 - min(1.0, (1.0 - 0.9) * 1 * 4 * 2 / 10)
    assert cli.model._ema_decay == pytest.approx(decay, rel=1e-12)
    average, n_averaged = first, 0
    for n, (epoch, weights) in enumerate(steps, start=1):
        if n % 2:
            continue
        if n_averaged == 0:
            average = [w.clone() for w in weights]
        else:  # ExponentialMovingAverage's avg_fn, on parameters and buffers (use_buffers)
            average = [(decay * a + (1 - decay) * w).to(a.dtype) for a, w in zip(average, weights)]
        n_averaged += 1
        if epoch < 1:  # the warmup epochs: torchvision resets n_averaged, so the next update copies again
            n_averaged = 0
    ema = _tensors(cli.model.ema.module)
    for got, want in zip(ema, average, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert not all(torch.equal(a, b) for a, b in zip(ema, steps[-1][1]))  # an average, not the last weights


def _ema_args(root: Path, out: Path, *extra: str) -> list[str]:
    return fit_args(
        root, out, "--trainer.max_epochs", "3", "--trainer.deterministic", "true", "--seed_everything", "7",
        "--step_checkpoint.every_n_train_steps", "1", "--trainer.limit_val_batches", "1", *EMA,
        "--model.mixup_alpha", "0.2", "--model.cutmix_alpha", "1.0", *extra, batch_size=4, arch=SMALL_ARCH,
    )  # fmt: skip


def test_a_run_killed_mid_epoch_and_resumed_has_the_uninterrupted_runs_ema_bit_for_bit(
    shapes_root: Path, tmp_path: Path
) -> None:
    # 6 steps an epoch, 18 in all; the kill lands inside epoch 1 or 2 at a step checkpoint of an EMA update.
    slow = tmp_path / "slow.yaml"
    slow.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.SlowSteps\n"
                    "      init_args: {seconds: 0.3}\n")  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    with ThreadPoolExecutor(1) as pool:
        whole_run = _start(_ema_args(shapes_root, whole), tmp_path)
        whole_output = pool.submit(whole_run.communicate, timeout=600)
        killed = _start(_ema_args(shapes_root, cut, "--config", str(slow)), tmp_path)
        killed_at = kill_when(killed, cut, lambda step: step >= 7 and step % 6 and step % 2 == 0)
        out, _ = whole_output.result()
    assert whole_run.returncode == 0, out[-3000:]
    assert 7 <= killed_at < 18 and killed_at % 6

    # Another --seed_everything: a resumed run keeps its checkpoint's seed, MixUp and CutMix included.
    proc = _start(_ema_args(shapes_root, cut, "--ckpt_path", "last", "--seed_everything", "8"), tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "Resuming from" in out, out[-3000:]
    a, b = (torch.load(final_checkpoint(d), map_location="cpu", weights_only=True) for d in (whole, cut))
    assert a["global_step"] == b["global_step"] == 18
    ema = [k for k in a["state_dict"] if k.startswith("ema.module.")]
    assert ema and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in ema)
    raw = [k for k in a["state_dict"] if k.startswith("model.")]
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in raw)


@pytest.fixture(scope="module")
def ema_run(shapes_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, float]]:
    """Two epochs with an EMA updated every step after the first epoch: the last checkpoint and the metrics."""
    out = tmp_path_factory.mktemp("ema")
    ema = ["--model.ema_decay", "0.9", "--model.ema_steps", "1", "--model.ema_warmup_epochs", "1"]
    cli = main(fit_args(shapes_root, out, "--trainer.max_epochs", "2", *ema, batch_size=4, arch=SMALL_ARCH))
    return next(out.rglob("last.ckpt")), {k: float(v) for k, v in cli.trainer.callback_metrics.items()}


def test_validation_reports_the_raw_and_the_ema_weights(ema_run: tuple[Path, dict[str, float]]) -> None:
    _, metrics = ema_run
    for name in ("top1", "top5", "loss"):
        assert f"val/{name}" in metrics and f"val_ema/{name}" in metrics
    assert metrics["val/loss"] != metrics["val_ema/loss"]  # two networks evaluated


def test_predict_and_export_with_ema_weights_use_them(
    ema_run: tuple[Path, dict[str, float]], shapes_root: Path, tmp_path: Path
) -> None:
    ckpt, _ = ema_run
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    # The same checkpoint with the EMA's weights as its raw ones: its raw predictions are what the EMA predicts.
    swapped = {**state, **{f"model.{k.removeprefix('ema.module.')}": v for k, v in state.items()
                           if k.startswith("ema.module.")}}  # fmt: skip
    assert any(not torch.equal(state[k], swapped[k]) for k in state if k.startswith("model."))
    swapped_ckpt = tmp_path / "swapped.ckpt"
    torch.save({**checkpoint, "state_dict": swapped}, swapped_ckpt)

    def predict(path: Path, weights: str) -> list[dict[str, str]]:
        out = tmp_path / f"{path.stem}-{weights}.csv"
        main(["predict", "--ckpt_path", str(path), "--data.predict_root", str(shapes_root / "val"),
              "--data.batch_size", "4", "--data.workers", "0", "--data.crop_size", "32", "--data.val_resize", "36",
              "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false", "--model.eval_weights", weights,
              "--predict_writer.output", str(out), "--trainer.default_root_dir", str(tmp_path)])  # fmt: skip
        return list(csv.DictReader(open(out)))

    ema = predict(ckpt, "ema")
    assert ema == predict(swapped_ckpt, "raw")
    assert ema != predict(ckpt, "raw")

    network, _ = load_network(ckpt, "ema")
    images = torch.randn(2, 3, 32, 32)
    paths = export(str(ckpt), str(tmp_path / "export"), image_size=32, weights="ema")
    exported = torch.load(paths["state_dict"], weights_only=True)
    assert all(torch.equal(v, state[f"ema.module.{k}"]) for k, v in exported.items())
    raw, _ = load_network(ckpt)
    with torch.no_grad():
        assert not torch.allclose(network(images), raw(images))


def test_a_checkpoint_without_an_ema_loads_into_a_model_with_one_as_its_copy() -> None:
    plain = ImageClassifier(SMALL_ARCH, num_classes=3)
    with torch.no_grad():
        next(plain.model.parameters()).add_(1.0)
    checkpoint = {"state_dict": plain.state_dict()}
    model = ImageClassifier(SMALL_ARCH, num_classes=3, ema_decay=0.9)
    model.on_load_checkpoint(checkpoint)
    model.load_state_dict(checkpoint["state_dict"])
    assert all(torch.equal(a, b) for a, b in zip(_tensors(model.ema.module), _tensors(plain.model)))
    assert model.ema.fresh
    back = ImageClassifier(SMALL_ARCH, num_classes=3)
    ema_checkpoint = {"state_dict": model.state_dict()}
    back.on_load_checkpoint(ema_checkpoint)  # and the other way: the EMA is left out
    back.load_state_dict(ema_checkpoint["state_dict"])
