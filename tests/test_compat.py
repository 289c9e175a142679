"""Each private Lightning attribute the package reads, read from a real Trainer of the installed version.

A failure here after an upgrade names the attribute that went away (``LightningCompatError``).
"""

import configparser
import csv
import multiprocessing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.plugins import TorchSyncBatchNorm
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric

import lit_imagenet.cli  # noqa: F401  (imports every module that overrides a private hook)
from lit_imagenet import compat

REPO = Path(__file__).resolve().parents[1]


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("probe", float(batch_idx), on_step=True, on_epoch=False)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=1)


class Record(pl.Callback):
    """What the accessors say at the end of every training batch."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.step_at_start = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step_at_start = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.rows.append(
            {
                "writes": compat.writes_log_line(trainer),
                "logged_at": compat.batches_that_stepped(trainer),
                "accumulates": compat.accumulates_gradients(trainer),
                "stepped": trainer.global_step != self.step_at_start,
                "trainer": compat.attached_trainer(pl_module),
            }
        )


class SaveAtBatch(ModelCheckpoint):
    """Writes its ``last`` checkpoint through ``compat.save_last_checkpoint`` at one batch, and never else."""

    def __init__(self, dirpath: Path, batch: int) -> None:
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=True, every_n_epochs=0)
        self.batch = batch
        self.before: tuple[str, int] | None = ("not read", -1)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if args[-1] == self.batch:
            self.before = compat.last_checkpoint_saved(self)
            compat.save_last_checkpoint(self, trainer)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """8 batches, gradients accumulated over 2, a log line every 2 optimizer steps, a save at batch 4."""
    out = tmp_path_factory.mktemp("compat")
    record, saver = Record(), SaveAtBatch(out / "ckpt", batch=4)
    model = Tiny()
    unattached = compat.attached_trainer(model)
    trainer = pl.Trainer(
        default_root_dir=out, max_epochs=1, accumulate_grad_batches=2, log_every_n_steps=2, accelerator="cpu",
        logger=CSVLogger(out, name="logs"), callbacks=[record, saver], enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(model)
    return SimpleNamespace(trainer=trainer, model=model, rows=record.rows, saver=saver, unattached=unattached)


def test_accumulates_gradients_is_true_exactly_on_the_batches_without_an_optimizer_step(fitted) -> None:
    assert [r["accumulates"] for r in fitted.rows] == [True, False] * 4
    assert [not r["stepped"] for r in fitted.rows] == [r["accumulates"] for r in fitted.rows]


def test_writes_log_line_and_batches_that_stepped_match_the_rows_lightning_writes(fitted) -> None:
    assert [r["logged_at"] for r in fitted.rows] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r["writes"] for r in fitted.rows] == [False, False, True, True, False, False, True, True]
    rows = list(csv.DictReader(open(Path(fitted.trainer.log_dir) / "metrics.csv")))
    written = {int(row["step"]) for row in rows if row.get("probe")}
    assert written == {r["logged_at"] for r in fitted.rows if r["writes"]} == {1, 3}


def test_last_checkpoint_saved_and_save_last_checkpoint(fitted) -> None:
    assert fitted.saver.before is None  # nothing saved before batch 4
    path, step = compat.last_checkpoint_saved(fitted.saver)
    assert Path(path) == Path(fitted.saver.dirpath) / "last.ckpt"
    assert step == 2 and torch.load(path, weights_only=True)["global_step"] == 2  # batch 4: 2 optimizer steps


def test_attached_trainer(fitted) -> None:
    assert fitted.unattached is None
    assert all(r["trainer"] is fitted.trainer for r in fitted.rows)
    assert compat.attached_trainer(torch.nn.Linear(1, 1)) is None  # a plain module has no trainer


def test_ddp_kwargs_and_layer_sync() -> None:
    assert compat.ddp_kwargs(DDPStrategy(find_unused_parameters=True)) == {"find_unused_parameters": True}
    plain = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False)
    assert compat.layer_sync(plain.strategy) is None
    synced = pl.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), sync_batchnorm=True, logger=False)
    assert isinstance(compat.layer_sync(synced.strategy), TorchSyncBatchNorm)


def test_metric_defaults_are_the_states_after_reset() -> None:
    metric = MeanMetric()
    metric.update(torch.tensor([3.0, 5.0]))
    defaults = compat.metric_defaults(metric)
    assert set(defaults) == set(metric.metric_state) == {"mean_value", "weight"}
    metric.reset()
    assert all(torch.equal(metric.metric_state[name], value) for name, value in defaults.items())


def test_every_overridden_private_hook_exists_in_lightning() -> None:
    overrides = compat.PRIVATE_OVERRIDES
    assert (DDPStrategy, "_setup_model") in overrides
    for cls, name in overrides:
        assert hasattr(cls, name), (
            f"pytorch-lightning {pl.__version__} has no {cls.__name__}.{name}, which lit_imagenet overrides"
        )


def test_a_missing_attribute_names_itself_and_the_versions() -> None:
    named = r"pytorch-lightning .+ has no Trainer\._logger_connector, .*tested with pytorch-lightning 2\.6"
    with pytest.raises(compat.LightningCompatError, match=named):
        compat.writes_log_line(SimpleNamespace())


def test_untested_versions_warn() -> None:
    assert compat.untested_version_warning("2.6.0") is None
    assert compat.untested_version_warning("2.7.1") == "warning: pytorch-lightning 2.7.1 is untested; tested: 2.6"


def test_setup_cfg_allows_the_tested_versions_only() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    pins = [line.strip() for line in cfg["options"]["install_requires"].splitlines() if "pytorch-lightning" in line]
    major, minor = compat.TESTED_VERSIONS[-1].split(".")
    assert pins == [f"pytorch-lightning>={compat.TESTED_VERSIONS[0]},<{major}.{int(minor) + 1}"]


def test_the_command_line_warns_once_on_an_untested_version(
    shapes_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from lit_imagenet.cli import main
    from tests.cli_args import fit_args

    args = fit_args(shapes_root, tmp_path)[1:]  # no subcommand: only build the objects
    main(args, run=False)
    assert "untested" not in capsys.readouterr().err
    monkeypatch.setattr(pl, "__version__", "2.99.0")
    main(args, run=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "untested" in line]
    assert lines == ["warning: pytorch-lightning 2.99.0 is untested; tested: 2.6"]


def test_mark_sigterm_stops_training_at_the_end_of_the_batch(tmp_path: Path) -> None:
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    class MarkAt(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if args[-1] == 2:
                compat.mark_sigterm(trainer)

    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=1, accelerator="cpu", logger=False,
                         callbacks=[MarkAt()], enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    with pytest.raises(SIGTERMException):
        trainer.fit(Tiny())
    assert trainer.received_sigterm and trainer.global_step == 3


def test_skip_sigterm_broadcast_replaces_the_loops_broadcast_for_this_run_only() -> None:
    from pytorch_lightning.loops import _TrainingEpochLoop

    trainer, other = (pl.Trainer(accelerator="cpu", logger=False) for _ in range(2))
    compat.skip_sigterm_broadcast(trainer)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
    assert "_broadcast_sigterm_tensor" not in vars(other.fit_loop.epoch_loop)
    assert callable(getattr(_TrainingEpochLoop, "_broadcast_sigterm_tensor", None))


def test_count_epoch_as_started_counts_the_current_epoch_once() -> None:
    trainer = pl.Trainer(accelerator="cpu", logger=False)
    progress = trainer.fit_loop.epoch_progress
    assert (progress.current.started, progress.current.processed) == (0, 0)
    compat.count_epoch_as_started(trainer)
    compat.count_epoch_as_started(trainer)  # inside the epoch already: nothing more
    assert (progress.current.ready, progress.current.started, progress.current.processed) == (1, 1, 0)


def test_epoch_batches_done_and_shift_epoch_batches(tmp_path: Path) -> None:
    class Shift(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            if args[-1] == 1:
                self.before = compat.epoch_batches_done(trainer)
                compat.shift_epoch_batches(trainer, 3)  # as if 3 more batches of the epoch had been trained
                self.after = compat.epoch_batches_done(trainer)

    shift = Shift()
    trainer = pl.Trainer(default_root_dir=tmp_path, max_epochs=1, accelerator="cpu", logger=False, callbacks=[shift],
                         enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(Tiny())
    assert (shift.before, shift.after) == (2, 5)  # batches 0 and 1 processed, then 3 more
    assert trainer.global_step == 8 - 3  # the epoch of 8 batches ended 3 batches early


def test_stop_workers_ends_the_worker_processes_of_an_unfinished_iterator() -> None:
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=2)
    batches = iter(loader)
    next(batches)
    assert len(multiprocessing.active_children()) == 2
    compat.stop_workers(batches)
    assert not multiprocessing.active_children()
    with pytest.raises(
        compat.LightningCompatError, match=r"torch .* no _MultiProcessingDataLoaderIter\._shutdown_workers"
    ):
        compat.stop_workers(object())


def test_user_inductor_cache_dir_tells_a_choice_from_inductors_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    assert compat.user_inductor_cache_dir() == "/somewhere/else"  # reads inductor's default: a missing one is named
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert compat.user_inductor_cache_dir() is None
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compat.user_inductor_cache_dir() is None


def test_run_after_closure_calls_the_hooks_and_clips_as_lightnings_own_step(tmp_path: Path) -> None:
    class ClosureFirst(pl.plugins.Precision):
        def optimizer_step(self, optimizer, model, closure, **kwargs):  # type: ignore[override]
            closure()
            compat.run_after_closure(self, model, optimizer)
            return optimizer.step(**kwargs)

    class Hooks(pl.Callback):
        def __init__(self) -> None:
            self.norms: list[float] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.norms.append(-1.0)  # clipping comes after this hook

        def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
            self.norms[-1] = float(pl_module.layer.weight.grad.norm())

    hooks = Hooks()
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, plugins=[ClosureFirst()], gradient_clip_val=1e-3,
                         callbacks=[hooks])  # fmt: skip
    trainer.fit(Tiny())
    assert len(hooks.norms) == 2 and all(0 < n <= 1e-3 + 1e-9 for n in hooks.norms)
    with pytest.raises(compat.LightningCompatError, match=r"no Precision\._after_closure"):
        compat.run_after_closure(SimpleNamespace(), Tiny(), None)


def test_record_cut_epoch_as_unfinished_makes_a_stopped_epoch_go_on_from_its_next_batch(tmp_path: Path) -> None:
    class Marks(Tiny):
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            self.changed = compat.record_cut_epoch_as_unfinished(self.trainer, checkpoint)

    class Batches(pl.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[int, int]] = []

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
            self.seen.append((trainer.current_epoch, args[-1]))

    def fit(model: Marks, ckpt: Path | None = None, **limits: Any) -> Batches:
        batches = Batches()
        trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", logger=False, callbacks=[batches],
                             enable_progress_bar=False, enable_checkpointing=False, **limits)  # fmt: skip
        trainer.fit(model, ckpt_path=ckpt)
        trainer.save_checkpoint(tmp_path / "end.ckpt")
        return batches

    cut = Marks()
    fit(cut, max_steps=3)  # 3 of the epoch's 8 batches: Lightning counts the epoch as done
    assert cut.changed
    saved = torch.load(tmp_path / "end.ckpt", weights_only=True)
    assert saved["epoch"] == 0 and saved["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 0
    resumed = Marks()
    seen = fit(resumed, tmp_path / "end.ckpt", max_steps=16).seen
    assert seen == [(0, b) for b in range(3, 8)] + [(1, b) for b in range(8)]  # the rest of epoch 0 first
    assert not resumed.changed  # epoch 1 ended at its last batch
    whole = Marks()
    fit(whole, max_epochs=1)
    assert not whole.changed
    with pytest.raises(compat.LightningCompatError, match="epoch progress in another form"):
        compat.record_cut_epoch_as_unfinished(cut.trainer, {"loops": {"fit_loop": {"progress": {}}}})
