import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

from lit_imagenet import ImageClassifier, ImageFolderDataModule
from lit_imagenet.callbacks.checkpoints import StepCheckpoint
from lit_imagenet.callbacks.guard import NonFiniteGuard, NonFiniteLossError
from lit_imagenet.callbacks.profiling import Profile
from lit_imagenet.cli import main
from tests.cli_args import SMALL_ARCH
from tests.test_checkpointing import _fit_args


class _NaNFrom(ImageClassifier):
    """Its loss turns NaN from global step ``bad_from`` on, as after a blow-up."""

    def __init__(self, bad_from: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bad_from = bad_from

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step >= self.bad_from else loss


def _data(root: Path) -> ImageFolderDataModule:
    return ImageFolderDataModule(str(root), batch_size=8, workers=0, crop_size=32, val_resize=36)


@pytest.mark.parametrize(
    ("check_every", "bad_from", "stop_step", "good_step"), [(1, 4, 6, 3), (4, 4, 6, 3), (1, 3, 6, 3)]
)
def test_consecutive_non_finite_losses_stop_the_run_naming_a_good_checkpoint(
    shapes_root: Path, tmp_path, check_every: int, bad_from: int, stop_step: int, good_step: int
) -> None:
    # 3 batches per epoch; step checkpoints at global steps 2, 4, 6, ... A check copies the count to the host and
    # reads the copy of the check before, and the epoch end reads the count itself.
    # NaN from step 4: the limit is reached in the batch of step 5, the last of epoch 1, and is read at its end
    # (global step 6), after last-step.ckpt was rewritten at step 6 with bad weights: the epoch-end checkpoint of
    # step 3 is named. NaN from step 3, checked at every batch: the count of the batch of step 4 is read at the
    # next batch's check (global step 6), before the step checkpoint of that batch is written.
    model = _NaNFrom(bad_from, arch="resnet18", num_classes=3, warmup_epochs=0)
    guard = NonFiniteGuard(max_consecutive=2, check_every_n_steps=check_every)
    ckpts = [StepCheckpoint(every_n_train_steps=2, dirpath=str(tmp_path)), ModelCheckpoint(dirpath=tmp_path)]
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=5, default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
        callbacks=[guard, *ckpts],
    )  # fmt: skip
    with pytest.raises(NonFiniteLossError) as exc:
        trainer.fit(model, _data(shapes_root))
    message = str(exc.value)
    assert f"2 consecutive batches from global step {bad_from}" in message
    named = Path(message.split("the last checkpoint before it is ")[1].split(" (step")[0])
    ckpt = torch.load(named, weights_only=True)
    assert ckpt["global_step"] == good_step and f"(step {good_step})" in message
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())
    assert trainer.global_step == stop_step  # the first check after the second bad batch (or the epoch end)


def test_isolated_non_finite_losses_do_not_stop_the_run(shapes_root: Path, tmp_path) -> None:
    class _OneBad(ImageClassifier):
        # A NaN loss whose gradient is finite, as when fp16 loss scaling overflows once and recovers
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss + float("nan") * loss.detach() if self.global_step in (1, 4) else loss

    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        callbacks=[NonFiniteGuard(max_consecutive=2, check_every_n_steps=3)], limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(_OneBad("resnet18", 3), _data(shapes_root))
    assert trainer.global_step == 6


def test_console_lines_loggers_and_curves(shapes_root: Path, tmp_path: Path, capsys) -> None:
    cli = main(_fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ") and " step " in line]
    assert len(lines) == 6 and lines[0].startswith("Epoch 0 [1/3] step 1 | ")
    assert all(" s/step | " in line and " images/s | loss " in line and "| top1 " in line for line in lines)
    log_dir = Path(cli.trainer.log_dir)
    assert (log_dir / "metrics.csv").is_file() and list(log_dir.glob("events.out.tfevents.*"))
    png = log_dir / "training_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_profile_window_ends_the_run_and_writes_a_trace(shapes_root: Path, tmp_path: Path) -> None:
    model = ImageClassifier("resnet18", num_classes=3)
    profile = Profile(start_step=2, steps=3, torch_trace=True)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=5, logger=CSVLogger(tmp_path), enable_progress_bar=False,
        enable_checkpointing=False, limit_val_batches=0, callbacks=[profile],
    )  # fmt: skip
    trainer.fit(model, _data(shapes_root))
    assert trainer.global_step == 5  # batches 0-1, then the 3 profiled ones
    assert profile.trace_path == Path(trainer.log_dir) / "trace.json"
    events = json.loads(profile.trace_path.read_text())["traceEvents"]
    assert any("conv" in str(e.get("name", "")).lower() for e in events)
    steps = sorted(e["name"] for e in events if str(e.get("name", "")).startswith("train step "))
    assert steps == ["train step 2", "train step 3", "train step 4"]


@pytest.fixture
def restore_determinism():
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_runs_give_identical_weights(shapes_root: Path, tmp_path: Path, restore_determinism) -> None:
    def fit(seed: int, out: str) -> dict[str, torch.Tensor]:
        args = _fit_args(shapes_root, tmp_path / out, "--trainer.max_epochs", "1", "--data.workers", "1",
                         "--trainer.deterministic", "true", "--seed_everything", str(seed),
                         arch=SMALL_ARCH)  # fmt: skip
        return main(args).model.state_dict()

    first, second, other = fit(1, "a"), fit(1, "b"), fit(2, "c")
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_training_figures_cover_every_batch_but_are_logged_on_log_steps(shapes_root: Path, tmp_path: Path) -> None:
    """Step figures are those of the batch that writes the log line; epoch figures cover every batch."""
    seen: list[tuple[int, float, float]] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append((trainer.global_step, float(outputs["loss"]), float(batch[0].shape[0])))

    logger = CSVLogger(tmp_path)
    model = ImageClassifier("resnet18", num_classes=3, warmup_epochs=0, lr=0.01)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, log_every_n_steps=2, logger=logger, enable_progress_bar=False,
                         enable_checkpointing=False, callbacks=[Record()], limit_val_batches=0)  # fmt: skip
    trainer.fit(model, _data(shapes_root))  # 24 images, batch 8: 3 steps per epoch
    rows = list(__import__("csv").DictReader(open(Path(logger.log_dir) / "metrics.csv")))
    step_losses = {int(r["step"]): float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")}
    assert sorted(step_losses) == [1, 3, 5]  # written after every 2nd optimizer step
    for step, value in step_losses.items():
        assert value == pytest.approx(next(loss for s, loss, _ in seen if s == step + 1), rel=1e-5)
    epoch_losses = [float(r["train/loss_epoch"]) for r in rows if r.get("train/loss_epoch")]
    for epoch, value in enumerate(epoch_losses):
        batches = seen[epoch * 3 : epoch * 3 + 3]
        assert value == pytest.approx(sum(loss * n for _, loss, n in batches) / sum(n for *_, n in batches), rel=1e-5)


def _guard_rank(rank: int, init_file: str, results: str) -> None:
    from types import SimpleNamespace

    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    guard = NonFiniteGuard(max_consecutive=3, check_every_n_steps=1)
    epoch_loop = SimpleNamespace(_should_accumulate=lambda: False)
    trainer = SimpleNamespace(world_size=2, checkpoint_callbacks=[], global_step=0,
                              fit_loop=SimpleNamespace(epoch_loop=epoch_loop))  # fmt: skip
    guard.on_train_start(trainer, SimpleNamespace(device=torch.device("cpu")))
    try:
        for step in range(1, 11):  # only rank 0 sees non-finite losses, at steps 7, 8 and 9 (the optimizer step's)
            trainer.global_step = step
            loss = torch.tensor(float("nan") if rank == 0 and 8 <= step <= 10 else 1.0)
            guard.on_train_batch_end(trainer, None, {"loss": loss}, None, step - 1)
        guard.on_train_epoch_end(trainer, None)
        outcome = "went on"
    except NonFiniteLossError as err:
        outcome = f"{trainer.global_step}: {err}"
    finally:
        torch.distributed.destroy_process_group()
    Path(results, f"rank{rank}.txt").write_text(outcome)


@pytest.mark.timeout(120)
def test_every_rank_stops_when_one_rank_trips_the_guard(tmp_path: Path) -> None:
    """A rank stopping alone would leave the others waiting in their next collective."""
    torch.multiprocessing.spawn(_guard_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    outcomes = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    for outcome in outcomes:
        assert "consecutive batches from global step 7" in outcome
    # at the same batch on both: the check after the one that saw the limit reached
    assert outcomes[0].split(":")[0] == outcomes[1].split(":")[0] == "10"


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_learning_rates_are_logged_from_the_host_under_lightnings_names(
    shapes_root: Path, tmp_path: Path, interval: str
) -> None:
    from lit_imagenet.callbacks.console import LearningRateLog

    logger = CSVLogger(tmp_path)
    model = ImageClassifier("resnet18", num_classes=3, warmup_epochs=1, lr=0.2, backbone_lr_scale=0.5)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, log_every_n_steps=2, logger=logger, enable_progress_bar=False,
                         enable_checkpointing=False, limit_val_batches=0,
                         callbacks=[LearningRateLog(logging_interval=interval, log_momentum=True)])  # fmt: skip
    trainer.fit(model, _data(shapes_root))  # batch 8 of 24 images: 3 steps per epoch, the first epoch warms up
    rows = [r for r in __import__("csv").DictReader(open(Path(logger.log_dir) / "metrics.csv")) if r.get("lr-SGD/pg1")]
    steps = [int(r["step"]) for r in rows]
    assert steps == ([1, 3, 5] if interval == "step" else [0, 3])
    lr = 0.2 * 8 / 256
    for row, step in zip(rows, steps):
        expected = lr * min(1.0, (step + 2) / 3)  # WarmupMultiStep: (1 + k) / 3 for the k-th step, from 1
        assert float(row["lr-SGD/pg1"]) == pytest.approx(expected)
        assert float(row["lr-SGD/pg2"]) == pytest.approx(expected * 0.5)
        assert float(row["lr-SGD/pg1-momentum"]) == pytest.approx(0.9)
    assert trainer.callback_metrics["lr-SGD/pg1"].device.type == "cpu"


def test_learning_rate_log_rejects_an_unknown_interval() -> None:
    from lit_imagenet.callbacks.console import LearningRateLog

    with pytest.raises(ValueError, match="logging_interval must be 'step' or 'epoch'. Got 'batch'"):
        LearningRateLog(logging_interval="batch")
