"""The real ``train.py`` on two GPUs with DDP: training, exact validation, the guard, SIGTERM, resume, predict.

Each test starts ``train.py`` as a user would (Lightning launches the second rank) on a small generated
folder, so that what runs is the whole path of a multi-GPU run: NCCL collectives, the side-stream
prefetcher, the precision plugins, the callbacks and checkpointing. Skipped with fewer than 2 GPUs.
"""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_imagenet.synthetic import make_shapes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
    pytest.mark.timeout(300),
]

REPO = Path(__file__).resolve().parents[1]
VAL_IMAGES = 3 * 17  # odd: a padded DistributedSampler would count one image twice
STEPS_PER_EPOCH = 41  # 3 x 430 training images, 16 per GPU on 2 GPUs


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_shapes(str(tmp_path_factory.mktemp("data") / "shapes"), train_per_class=430, val_per_class=17,
                       width=64, height=64, num_classes=3, processes=min(8, os.cpu_count() or 1))  # fmt: skip


def _args(root: Path, out: Path, *extra: str, devices: int = 2, subcommand: str = "fit") -> list[str]:
    ddp = ["--config", "configs/ddp.yaml"] if devices > 1 else []
    return [
        sys.executable, "train.py", subcommand, "--config", "configs/resnet50.yaml", *ddp,
        "--trainer.devices", str(devices), "--data.root", str(root), "--model.arch", "resnet18",
        "--data.batch_size", "16", "--data.crop_size", "56", "--data.val_resize", "64", "--data.workers", "2",
        "--data.decoder", "pil", "--trainer.log_every_n_steps", "5", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.benchmark", "false",
        "--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out), *extra,
    ]  # fmt: skip


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
    return done


def _rows(out: Path) -> list[dict[str, str]]:
    (metrics,) = out.rglob("metrics.csv")
    return list(csv.DictReader(open(metrics)))


def _last(rows: list[dict[str, str]], key: str) -> float:
    return float([r[key] for r in rows if r.get(key)][-1])


def _assert_exact_count(value: float) -> None:
    hits = value * VAL_IMAGES
    assert abs(hits - round(hits)) < 1e-4, f"{value} is no fraction of {VAL_IMAGES} images: some were counted twice"


@pytest.mark.parametrize(
    "strategy, precision, extra",
    [
        ("ddp_default_stream", "16-mixed", []),
        ("ddp", "bf16-mixed", []),
        # sync BN with native AMP, and the frozen backbone, which DDP sees as unused parameters
        ("ddp_find_unused_parameters_true", "16-mixed",
         ["--trainer.sync_batchnorm", "true", "--model.freeze_backbone_epochs", "1"]),
    ],
)  # fmt: skip
def test_two_gpu_fit_trains_and_validates_exactly(
    root: Path, tmp_path: Path, strategy: str, precision: str, extra: list[str]
) -> None:
    epochs = 2 if "--model.freeze_backbone_epochs" in extra else 1
    fit = _run(_args(root, tmp_path / "fit", "--trainer.strategy", strategy, "--trainer.precision", precision,
                     "--trainer.max_epochs", str(epochs), *extra))  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-2000:]
    rows = _rows(tmp_path / "fit")
    losses = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert len(losses) >= STEPS_PER_EPOCH * epochs // 5 and all(math.isfinite(v) for v in losses)
    assert int(max(int(r["step"]) for r in rows)) + 1 >= 40 * epochs
    ckpt = next((tmp_path / "fit").rglob("last.ckpt"))
    val = _run(_args(root, tmp_path / "val", "--ckpt_path", str(ckpt), "--trainer.precision", precision,
                     devices=1, subcommand="validate"))  # fmt: skip
    assert val.returncode == 0, val.stderr[-2000:]
    single = _rows(tmp_path / "val")
    for key in ("val/top1", "val/top5"):
        _assert_exact_count(_last(rows, key))
        _assert_exact_count(_last(single, key))
        # the same images, one process or two; at most one image may change class by rounding
        assert abs(_last(rows, key) - _last(single, key)) <= 1.01 / VAL_IMAGES, key
    assert _last(rows, "val/loss") == pytest.approx(_last(single, "val/loss"), rel=2e-3)


def test_nan_on_one_rank_stops_both_ranks_naming_the_step(root: Path, tmp_path: Path) -> None:
    poison = tmp_path / "poison.yaml"
    poison.write_text(
        "trainer:\n  callbacks:\n    - class_path: tests.gpu_callbacks.PoisonBatches\n"
        "      init_args: {rank: 1, from_step: 12}\n"
    )
    done = _run(_args(root, tmp_path, "--config", str(poison), "--trainer.max_epochs", "3",
                      "--non_finite.max_consecutive", "8"))  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "The training loss was NaN or infinite for 8 consecutive batches from global step 12;" in done.stderr


def _rank1_pid(parent: int) -> int:
    """The second rank: the child of rank 0 that Lightning started with LOCAL_RANK=1."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"LOCAL_RANK=1" in environ:
            return int(entry.name)
    raise AssertionError("no process of rank 1 found")


@pytest.mark.parametrize("targets", ["rank 0", "all ranks"])
def test_sigterm_saves_a_step_checkpoint_that_resumes(root: Path, tmp_path: Path, targets: str) -> None:
    args = _args(root, tmp_path, "--trainer.max_steps", "100000", "--trainer.max_epochs", "-1")
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err_file:
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=err_file, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # training is under way once a console line is out
            if " step " in line and "images/s" in line:
                break
        time.sleep(1.0)
        pids = [proc.pid] + ([_rank1_pid(proc.pid)] if targets == "all ranks" else [])
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = errors.read_text()
    print(err[-3000:])
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Stopped by SIGTERM; resume with --ckpt_path last." in err
    (saved,) = tmp_path.rglob("last-step.ckpt")
    step = torch.load(saved, map_location="cpu", weights_only=False)["global_step"]
    assert step > 0
    resumed = _run(_args(root, tmp_path, "--trainer.max_steps", str(step + 10), "--trainer.max_epochs", "-1",
                         "--ckpt_path", "last"))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"Resuming from {saved}" in resumed.stdout
    final = torch.load(next(tmp_path.rglob("version_1/**/last.ckpt")), map_location="cpu", weights_only=False)
    assert final["global_step"] == step + 10


@pytest.mark.parametrize("first, then", [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_number_of_gpus(root: Path, tmp_path: Path, first: int, then: int) -> None:
    done = _run(_args(root, tmp_path, "--trainer.max_epochs", "1", devices=first))
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = next(tmp_path.rglob("last.ckpt"))
    step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    resumed = _run(_args(root, tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt), devices=then))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = torch.load(next(tmp_path.rglob("version_1/**/last.ckpt")), map_location="cpu", weights_only=False)
    assert final["epoch"] == 1 and final["global_step"] > step


def test_two_gpu_predict_writes_every_image_once(root: Path, tmp_path: Path) -> None:
    done = _run(_args(root, tmp_path / "fit", "--trainer.max_epochs", "1", devices=1))
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = next((tmp_path / "fit").rglob("last.ckpt"))
    out = tmp_path / "predictions.csv"
    predicted = _run(_args(root, tmp_path / "predict", "--ckpt_path", str(ckpt), "--data.predict_root",
                           str(root / "val"), "--predict_writer.output", str(out), subcommand="predict"))  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    rows = list(csv.DictReader(open(out)))
    assert sorted(Path(r["path"]) for r in rows) == sorted((root / "val").rglob("*.jpg"))
    assert len(rows) == VAL_IMAGES
