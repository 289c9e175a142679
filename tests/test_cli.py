import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_imagenet.cli import main
from lit_imagenet.training.models import build_model
from tests.cli_args import error_lines, fit_args

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert {p.name for p in CONFIGS} >= {"resnet50.yaml", "resnet50_tv2.yaml", "ddp.yaml", "demo.yaml", "finetune.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses_and_instantiates(config: Path, shapes_root: Path, tmp_path: Path) -> None:
    args = ["--config", str(config), "--data.root", str(shapes_root), "--trainer.default_root_dir", str(tmp_path)]
    if config.name in ("resnet50.yaml", "resnet50_tv2.yaml", "ddp.yaml"):
        args += [
            "--trainer.accelerator",
            "cpu",
            "--trainer.devices",
            "1",
            "--trainer.strategy",
            "auto",
            "--trainer.precision",
            "32-true",
        ]
    if config.name == "finetune.yaml":  # its weights path is a placeholder
        weights = tmp_path / "pretrained.pth"
        torch.save(build_model("resnet18", 1000).state_dict(), weights)
        args += ["--model.weights", str(weights)]
    cli = main(args, run=False)
    assert cli.model.hparams.num_classes == 3
    assert cli.model.hparams.class_names == ["circle", "square", "triangle"]
    if config.name == "resnet50.yaml":
        assert cli.model.hparams.arch == "resnet50" and cli.datamodule.batch_size == 256
        assert cli.datamodule.decoder == "auto"
        assert cli.model.hparams.milestones == [30, 60, 80] and cli.model.hparams.compile == "auto"
    if config.name == "finetune.yaml":
        assert cli.model.hparams.lr_schedule == "cosine" and cli.model.hparams.freeze_backbone_epochs == 1


def test_cli_built_from_python_runs_like_the_command_line(shapes_root: Path, tmp_path: Path) -> None:
    """As in a notebook: the same config as on the command line, then the objects used directly."""
    weights = tmp_path / "pretrained.pth"
    torch.save(build_model("resnet18", 1000).state_dict(), weights)
    cli = main(
        ["--config", str(REPO / "configs/finetune.yaml"), "--data.root", str(shapes_root), "--model.weights",
         str(weights), "--data.batch_size", "8", "--data.workers", "0", "--data.crop_size", "32",
         "--data.val_resize", "36", "--trainer.max_epochs", "2", "--trainer.enable_progress_bar", "false",
         "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path)],
        run=False,
    )  # fmt: skip
    assert cli.subcommand is None and cli.trainer.max_epochs == 2
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.current_epoch == 2 and 0 <= float(cli.trainer.callback_metrics["val/top1"]) <= 1
    rows = list(csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")))
    assert any(r.get("val/top1") for r in rows)


def test_help_shows_docstrings(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--model.lr" in out and "per 256 images" in out
    assert "--data.crop_scale" in out and "RandomResizedCrop" in out


def test_prefetch_flag_sets_the_callback_that_the_model_attaches(shapes_root: Path, tmp_path: Path) -> None:
    """``--prefetch.enabled`` configures the model's ``CUDAPrefetch``; the trainer is not given one of its own."""
    from lit_imagenet.data.prefetch import CUDAPrefetch

    cli = main(fit_args(shapes_root, tmp_path, "--prefetch.enabled", "false")[1:], run=False)
    assert not any(isinstance(cb, CUDAPrefetch) for cb in cli.trainer.callbacks)
    cli.model.trainer = cli.trainer
    assert cli.model.configure_callbacks() == [cli.model.prefetch] and cli.model.prefetch.enabled is False
    assert main(fit_args(shapes_root, tmp_path)[1:], run=False).model.prefetch.enabled is True


def test_print_config(shapes_root: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(REPO / "configs/demo.yaml"), "--data.root", str(shapes_root), "--print_config"])
    out = capsys.readouterr().out
    assert "arch: resnet18" in out and "batch_size: 64" in out


def test_fit_prints_where_logs_and_checkpoints_went(shapes_root: Path, tmp_path: Path, capsys) -> None:
    main(fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "1", workers=1))
    out = capsys.readouterr().out
    assert f"Logs: {tmp_path}" in out
    best = next(line for line in out.splitlines() if line.startswith("Best checkpoint: "))
    path = Path(best.split(": ", 1)[1].split(" (")[0])
    assert path.is_file()
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["class_names"] == ["circle", "square", "triangle"]


def test_default_root_dir_holds_the_logs_and_checkpoints(
    shapes_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    cwd, root = tmp_path / "cwd", tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = ["--config", str(REPO / "configs/demo.yaml"), "--data.root", str(shapes_root), "--data.workers", "0",
            "--data.batch_size", "8", "--data.crop_size", "32", "--data.val_resize", "36",
            "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false"]  # fmt: skip
    assert main(args, run=False).trainer.logger.save_dir == "runs/demo"  # the default: runs/ and the config's name
    main(["fit", *args, "--trainer.default_root_dir", str(root), "--trainer.max_epochs", "1"])
    assert (root / "metrics.csv").is_file() and (root / "config.yaml").is_file()  # straight in the run's folder
    assert (root / "checkpoints" / "last.ckpt").is_file() and not (root / "lightning_logs").exists()
    assert list(cwd.iterdir()) == []  # no runs/ in the working directory
    capsys.readouterr()
    cli = main(
        ["fit", *args, "--trainer.default_root_dir", str(root), "--trainer.max_epochs", "2", "--ckpt_path", "last"]
    )
    assert f"Resuming from {root / 'checkpoints' / 'last.ckpt'} (epoch 0, step 3)." in capsys.readouterr().out
    assert cli.trainer.global_step == 6  # 24 images in batches of 8: the second epoch's 3 steps after the first's
    assert list(cwd.iterdir()) == []


def test_missing_root_is_one_line_and_exit_2(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(fit_args(tmp_path / "nowhere", tmp_path, "--trainer.max_epochs", "1", workers=1))
    assert exc.value.code == 2
    (err,) = error_lines(capsys.readouterr().err)
    assert err.startswith("error: Data root") and "nowhere" in err


def test_corrupt_image_found_in_a_worker_stops_the_run_with_its_name(shapes_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    for split in ("train", "val"):
        for folder in (shapes_root / split).iterdir():
            (root / split / folder.name).mkdir(parents=True)
            for f in folder.iterdir():
                (root / split / folder.name / f.name).write_bytes(f.read_bytes())
    bad = root / "train" / "square" / "square_000003.jpg"
    bad.write_bytes(bad.read_bytes()[:200])
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *fit_args(root, tmp_path, "--trainer.max_epochs", "1", workers=1)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Cannot decode image") and str(bad) in last
    assert "Traceback" not in proc.stderr


def _printed_metrics(out: str) -> dict[str, float]:
    """The validation results in the table that Lightning prints (a plain or a box-drawn one)."""
    return {k: float(v) for k, v in re.findall(r"(val/\w+)[\s│|]+([-+0-9.eE]+)", out)}


@pytest.mark.parametrize("decoder", ["pil", pytest.param("dali", marks=pytest.mark.dali)])
def test_validation_under_ddp_equals_one_process(shapes_root: Path, tmp_path: Path, decoder: str) -> None:
    torch.manual_seed(3)
    from lit_imagenet.training.models import build_model

    weights = tmp_path / "weights.pt"
    torch.save(build_model("resnet18", 3).state_dict(), weights)
    results = {}
    for devices in (1, 2):
        out = tmp_path / f"d{devices}"
        args = [
            "validate", "--data.root", str(shapes_root), "--data.batch_size", "4", "--data.workers", "0",
            "--data.decoder", decoder,
            "--data.crop_size", "32", "--data.val_resize", "36", "--model.arch", "resnet18",
            "--model.weights", str(weights), "--trainer.accelerator", "cpu", "--trainer.devices", str(devices),
            "--trainer.strategy", "ddp" if devices > 1 else "auto", "--trainer.enable_progress_bar", "false",
            "--trainer.logger.init_args.save_dir", str(out), "--trainer.default_root_dir", str(out),
        ]  # fmt: skip
        proc = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not out.exists()  # validate makes no run folder: its results are printed
        results[devices] = _printed_metrics(proc.stdout)
    single, ddp = results[1], results[2]
    # 15 images on 2 ranks: a padded sampler would count one image twice, and no k/15 equals a j/16 in (0, 1)
    assert 0 < single["val/top1"] < 1, single
    assert ddp["val/top1"] == single["val/top1"]
    assert ddp["val/top5"] == single["val/top5"]
    assert abs(ddp["val/loss"] - single["val/loss"]) < 1e-5


def test_the_ddp_recipe_wraps_on_the_training_stream(shapes_root: Path, tmp_path: Path) -> None:
    from lit_imagenet.training.strategies import DefaultStreamDDPStrategy

    config = next(p for p in CONFIGS if p.name == "ddp.yaml")
    cli = main(["--config", str(config), "--data.root", str(shapes_root), "--trainer.default_root_dir", str(tmp_path),
                "--trainer.accelerator", "cpu", "--trainer.devices", "2"], run=False)  # fmt: skip
    assert type(cli.trainer.strategy) is DefaultStreamDDPStrategy


def test_the_cli_keeps_the_model_config_per_instance() -> None:
    from lit_imagenet.cli import ImageNetCLI

    assert "_model_config" not in vars(ImageNetCLI)  # no class attribute that two command lines would share


@pytest.mark.parametrize(
    "given, said",
    [
        (["--model.channels_last", "false"], "--model.channels_last is set from data.channels_last"),
        (["--model.num_classes=5"], "--model.num_classes is set from the data's classes"),
        (["--config", "FILE"], "model.channels_last in FILE is set from data.channels_last"),
        (["-cFILE"], "model.channels_last in FILE is set from data.channels_last"),
        (["--model", "FILE"], "model.channels_last in FILE is set from data.channels_last"),
        (["--config", "{model: {class_names: [a, b]}}"], "model.class_names in the config given is set from the data"),
    ],
)
def test_a_model_argument_that_the_data_sets_is_refused_in_one_line(
    given: list[str], said: str, shapes_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Without the check jsonargparse drops such a value from a config file without a word."""
    config = tmp_path / "model.yaml"
    config.write_text("model:\n  channels_last: false\n" if given[0] != "--model" else "channels_last: false\n")
    given = [a.replace("FILE", str(config)) for a in given]
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(REPO / "configs/demo.yaml"), "--data.root", str(shapes_root), *given])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: " + said.replace("FILE", str(config))), err


def test_the_data_generator_runs_as_a_module(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lit_imagenet.data.synthetic", str(tmp_path / "shapes"), "--train_per_class", "2",
         "--val_per_class", "1"], capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr
    assert (tmp_path / "shapes" / "train").is_dir() and (tmp_path / "shapes" / "val").is_dir()
