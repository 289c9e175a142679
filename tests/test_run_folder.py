"""One run, one folder: ``runs/<config>`` holds its logs and ``checkpoints/``; ``--ckpt_path last`` is its own."""

import csv
import os
import shutil
import warnings
from pathlib import Path

import pytest
import pytorch_lightning as pl

from lit_imagenet import ImageClassifier, ImageFolderDataModule, RunLogger, default_callbacks
from lit_imagenet.callbacks.checkpoints import find_last_checkpoint
from lit_imagenet.cli import main, run_folder
from tests.cli_args import SMALL_ARCH, error_lines, small_args

REPO = Path(__file__).resolve().parents[1]
DEMO = ["--config", str(REPO / "configs" / "demo.yaml")]


def _files(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*")}


def _refused(args: list[str], capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    (line,) = error_lines(capsys.readouterr().err)
    return line


def test_the_run_folder_is_named_after_the_first_config() -> None:
    assert run_folder([Path("configs/demo.yaml"), Path("configs/ddp.yaml")]) == "runs/demo"
    assert run_folder([Path("configs/resnet50.yaml")]) == "runs/resnet50"
    assert run_folder(None) == "runs/default"


@pytest.fixture
def cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_last_is_this_runs_checkpoint_never_the_notebooks(
    shapes_root: Path, cwd: Path, capsys: pytest.CaptureFixture
) -> None:
    # The README's notebook run, under runs/ with its versions.
    dm = ImageFolderDataModule(str(shapes_root), batch_size=8, workers=0, crop_size=32, val_resize=36)
    model = ImageClassifier(SMALL_ARCH, num_classes=dm.num_classes, class_names=dm.classes, warmup_epochs=1)
    trainer = pl.Trainer(max_epochs=2, callbacks=default_callbacks(), logger=RunLogger("runs"), accelerator="cpu",
                         enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, dm)
    assert (cwd / "runs/lightning_logs/version_0/checkpoints/last.ckpt").is_file()

    args = ["fit", *DEMO, *small_args(shapes_root, arch=SMALL_ARCH)]
    capsys.readouterr()
    cli = main([*args, "--trainer.max_epochs", "1", "--ckpt_path", "last"])
    out = capsys.readouterr().out
    assert "No checkpoint in runs/demo/checkpoints: training from the start." in out
    assert "Resuming" not in out and cli.trainer.global_step == 3  # 24 images in batches of 8, one epoch
    run = cwd / "runs" / "demo"
    assert {"metrics.csv", "config.yaml", "hparams.yaml", "checkpoints"} <= {p.name for p in run.iterdir()}
    assert (run / "checkpoints" / "last.ckpt").is_file() and not list(run.rglob("version_*"))

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli = main([*args, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    out = capsys.readouterr().out
    said = [str(w.message) for w in seen]
    assert not [m for m in said if "dirpath has changed" in m or "exists and is not empty" in m], said
    assert out.splitlines()[0] == "Resuming from runs/demo/checkpoints/last.ckpt (epoch 0, step 3)."
    assert cli.trainer.global_step == 6
    epochs = {row["epoch"] for row in csv.DictReader(open(run / "metrics.csv")) if row.get("epoch")}
    assert epochs == {"0", "1"}  # the continued run appends to the run's metrics
    assert not list((cwd / "runs").glob("lightning_logs/version_1"))  # the notebook's run is untouched


@pytest.fixture
def demo_run(shapes_root: Path, cwd: Path) -> Path:
    # A step checkpoint at each step: the newest "last" is the run's final step whichever file holds it.
    main(["fit", *DEMO, *small_args(shapes_root, arch=SMALL_ARCH), "--trainer.max_epochs", "2",
          "--step_checkpoint.every_n_train_steps", "1"])  # fmt: skip
    return cwd / "runs" / "demo"


def _newest(run: Path) -> str:
    return os.path.relpath(find_last_checkpoint(run / "checkpoints"))


def test_a_second_fit_in_a_run_folder_is_refused(shapes_root: Path, demo_run: Path, capsys) -> None:
    line = _refused(["fit", *DEMO, *small_args(shapes_root, arch=SMALL_ARCH)], capsys)
    assert line == (
        "error: runs/demo/checkpoints already holds a run's checkpoint (epoch 1, step 6): continue it with "
        "--ckpt_path last, or start a new run with another --trainer.default_root_dir."
    )


def _other_classes(shapes_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "other"
    shutil.copytree(shapes_root, root)
    for split in ("train", "val"):
        (root / split / "triangle").rename(root / split / "star")
    return root


@pytest.mark.parametrize(
    "change, says",
    [
        (["--trainer.max_epochs", "1"], "--trainer.max_epochs 1 ends before its epoch 1 (from 0); give more."),
        (["--trainer.max_steps", "6"], "--trainer.max_steps 6 ends at or before its step 6; give more."),
        (["--model.arch", "resnet18"], f"it is a {SMALL_ARCH}, not --model.arch resnet18."),
        (["--data.root", "OTHER"], "its classes differ from the data's (class 'triangle' where the data has 'star')."),
    ],
    ids=["max_epochs", "max_steps", "arch", "classes"],
)
def test_a_checkpoint_that_cannot_continue_is_refused_in_one_line(
    shapes_root: Path, demo_run: Path, change: list[str], says: str, capsys
) -> None:
    if change[-1] == "OTHER":
        change = [change[0], str(_other_classes(shapes_root, demo_run.parent.parent))]
    before = _files(demo_run)
    line = _refused(["fit", *DEMO, *small_args(shapes_root, arch=SMALL_ARCH), *change, "--ckpt_path", "last"], capsys)
    assert line == f"error: {_newest(demo_run)} (epoch 1, step 6) cannot continue here: {says}"
    assert _files(demo_run) == before


@pytest.mark.parametrize("subcommand", ["validate", "predict"])
def test_evaluating_a_checkpoint_makes_no_folder(subcommand: str, shapes_root: Path, demo_run: Path, capsys) -> None:
    runs = demo_run.parent
    before = _files(runs)
    args = [subcommand, *small_args(shapes_root, arch=SMALL_ARCH), "--ckpt_path", _newest(demo_run)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        main([*args, "--data.predict_root", str(shapes_root / "val")] if subcommand == "predict" else args)
    # Neither runs/default nor a version folder; predictions go into the checkpoint's run.
    made = {Path("demo/predictions.csv")} if subcommand == "predict" else set()
    assert _files(runs) == before | made
    assert not [w for w in seen if "dirpath has changed" in str(w.message)]
