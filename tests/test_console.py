"""What a user sees in the console: the validation line, one-line errors about files, and no third-party noise."""

import contextlib
import csv
import inspect
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lit_imagenet.cli import main
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.datasets import ImageFolderDataset
from lit_imagenet.data.folders import scan_predict
from lit_imagenet.data.images import load_rgb, load_rgb_tensor
from lit_imagenet.data.synthetic import make_shapes
from lit_imagenet.errors import DataError
from tests.cli_args import error_lines, fit_args
from tests.conftest import checkout_entries
from tests.runs import REPO, run_env, run_train

VALIDATION_LINE = re.compile(
    r"^Epoch (\d+) validation: top-1 (\d\.\d{4}), top-5 (\d\.\d{4}), loss (\d+\.\d{4}) \(\d+\.\d s\)$"
)
# A warning from another package: Lightning's ``path.py:LINE: message``, Python's ``...Warning: ...`` and its
# ``warnings.warn(`` source line, or a tip.
THIRD_PARTY = re.compile(r"Warning|warn\(|^\S+\.py:\d+: |Tip:")


@pytest.fixture(scope="module")
def two_epochs(shapes_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """A 2-epoch fit: its last checkpoint, its log folder and what it printed."""
    out = tmp_path_factory.mktemp("fit")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli = main(fit_args(shapes_root, out, "--trainer.max_epochs", "2"))
    return Path(cli.trainer.checkpoint_callback.last_model_path), Path(cli.trainer.log_dir), printed.getvalue()


def test_each_validation_prints_its_epoch_top1_top5_and_loss(two_epochs: tuple[Path, Path, str]) -> None:
    _, log_dir, printed = two_epochs
    lines = [m for m in map(VALIDATION_LINE.match, printed.splitlines()) if m]
    logged = [row for row in csv.DictReader(open(log_dir / "metrics.csv")) if row.get("val/top1")]
    assert [int(m.group(1)) for m in lines] == [0, 1], printed
    for match, row in zip(lines, logged):
        assert int(row["epoch"]) == int(match.group(1))
        for group, key in ((2, "val/top1"), (3, "val/top5"), (4, "val/loss")):
            assert match.group(group) == f"{float(row[key]):.4f}", (match.group(0), row)


def test_validate_prints_the_line_of_its_checkpoint(
    shapes_root: Path, two_epochs: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ckpt = two_epochs[0]
    args = fit_args(shapes_root, tmp_path)
    cli = main(["validate", *args[1:], "--ckpt_path", str(ckpt)])
    metrics = cli.trainer.callback_metrics
    expected = (
        f"Validation of {ckpt}: top-1 {float(metrics['val/top1']):.4f}, top-5 {float(metrics['val/top5']):.4f}, "
        f"loss {float(metrics['val/loss']):.4f} ("
    )
    assert any(line.startswith(expected) for line in capsys.readouterr().out.splitlines()), expected


def test_a_relative_predict_root_names_each_image_once(
    shapes_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(shapes_root / "val", tmp_path / "data" / "val")
    monkeypatch.chdir(tmp_path)
    data = ImageFolderDataModule(predict_root="data/val", workers=0, crop_size=32, val_resize=36)
    samples = data.samples("predict")
    assert samples[0][0] == os.path.join("data", "val", "circle", "circle_000000.jpg")
    dataset = ImageFolderDataset(samples)
    assert len(dataset) == 15 and all(dataset[i][0].size == (40, 40) for i in range(len(dataset)))


@pytest.mark.parametrize("loader", [load_rgb, load_rgb_tensor])
def test_a_file_gone_since_the_scan_is_said_missing_and_a_bad_one_to_be_replaced(
    shapes_root: Path, tmp_path: Path, loader
) -> None:
    shutil.copytree(shapes_root / "val", tmp_path / "val")
    samples = scan_predict(tmp_path / "val")
    gone, bad = samples[0][0], samples[1][0]
    os.remove(gone)
    Path(bad).write_bytes(b"not an image at all")
    with pytest.raises(DataError) as missing:
        loader(gone)
    assert str(missing.value) == (
        f"Image {gone} is missing: its folder changed after it was scanned; run again, which scans it anew."
    )
    with pytest.raises(DataError, match=r"^Cannot decode image .*; replace or remove the file\.$") as broken:
        loader(bad)
    assert bad in str(broken.value)


def test_an_error_during_a_loop_starts_on_a_line_of_its_own(
    shapes_root: Path, two_epochs: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    images = tmp_path / "images"
    shutil.copytree(shapes_root / "val", images)
    bad = sorted(images.rglob("*.jpg"))[-1]
    bad.write_bytes(b"not an image at all")
    args = fit_args(shapes_root, tmp_path)[1:]
    args[args.index("--trainer.enable_progress_bar") + 1] = "true"
    args = args[args.index("--data.batch_size") :]  # no --data.root: the classes come from the checkpoint
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--ckpt_path", str(two_epochs[0]), "--data.predict_root", str(images), *args])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert "Predicting" in out and out.endswith("\n")  # the bar's line is ended before the error is printed
    (line,) = error_lines(err)
    assert line.startswith(f"error: Cannot decode image {bad} (") and line.endswith("; replace or remove the file.")


def test_the_default_loader_workers_are_at_most_the_cores() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    default = inspect.signature(ImageFolderDataModule).parameters["workers"].default
    assert 1 <= default <= min(4, cores)


def test_the_demo_commands_print_no_third_party_warning(tmp_path: Path) -> None:
    """fit, fit again from ``last``, validate and predict, from the folder the data is in, with relative paths."""
    make_shapes(str(tmp_path / "data" / "shapes"), train_per_class=8, val_per_class=4, width=40, height=40,
                num_classes=3)  # fmt: skip
    demo = ["--config", str(REPO / "configs" / "demo.yaml"), "--data.batch_size", "8", "--data.crop_size", "32",
            "--data.val_resize", "36", "--trainer.log_every_n_steps", "1"]  # fmt: skip
    printed = {}

    def run(name: str, args: list[str]) -> None:
        done = run_train(args, cwd=tmp_path, env=run_env())
        assert done.returncode == 0, done.stderr[-3000:]
        noise = [line for line in done.stderr.splitlines() if THIRD_PARTY.search(line)]
        assert noise == [], f"{name}: {noise}"
        printed[name] = done.stdout

    run("fit", ["fit", *demo, "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false"])
    run("resume", ["fit", *demo, "--trainer.max_epochs", "2", "--ckpt_path", "last"])
    ckpt = str(next((tmp_path / "runs").rglob("last.ckpt")).relative_to(tmp_path))
    run("validate", ["validate", *demo, "--ckpt_path", ckpt])
    run("predict", ["predict", "--ckpt_path", ckpt, "--data.predict_root", "data/shapes/val", "--data.crop_size", "32",
                    "--data.val_resize", "36", "--predict_writer.output", "p.csv"])  # fmt: skip
    assert any(VALIDATION_LINE.match(line) for line in printed["fit"].splitlines()), printed["fit"]
    assert "Validation of " in printed["validate"]
    rows = list(csv.DictReader(open(tmp_path / "p.csv")))
    assert sorted(row["path"] for row in rows) == sorted(
        str(p.relative_to(tmp_path)) for p in (tmp_path / "data" / "shapes" / "val").rglob("*.jpg")
    )


def test_the_checkout_check_fails_a_run_that_writes_into_the_checkout(tmp_path: Path) -> None:
    left = REPO / f"left_by_a_test_{os.getpid()}"
    test = tmp_path / "test_leaves.py"
    test.write_text(f"def test_leaves():\n    open({str(left)!r}, 'w').close()\n")
    before = checkout_entries()
    if before is None:
        pytest.skip("the checkout is not a git repository")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "--rootdir",
             str(tmp_path), str(test)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=run_env(),
        )  # fmt: skip
    finally:
        left.unlink(missing_ok=True)
    assert done.returncode == 1, done.stdout[-3000:]
    assert f"The tests left {left.name} in the checkout {REPO}; tests write under tmp_path." in done.stdout
