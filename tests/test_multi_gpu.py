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

from lit_imagenet.data.synthetic import make_shapes
from tests.runs import rank_pid, run_session

# LIT_IMAGENET_DDP_ON_CPU=1 runs the same tests with two CPU processes (gloo, 32-true), to debug them off a GPU.
ON_CPU = os.environ.get("LIT_IMAGENET_DDP_ON_CPU") == "1"
pytestmark = [
    pytest.mark.timeout(300),
    *([] if ON_CPU else [pytest.mark.gpu]),
    pytest.mark.skipif(not ON_CPU and torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
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
    args = [
        sys.executable, "train.py", subcommand, "--config", "configs/resnet50.yaml", *ddp,
        "--trainer.devices", str(devices), "--data.root", str(root), "--model.arch", "resnet18",
        "--data.batch_size", "16", "--data.crop_size", "56", "--data.val_resize", "64", "--data.workers", "2",
        "--data.decoder", "pil", "--trainer.log_every_n_steps", "5", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.benchmark", "false",
        "--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out), *extra,
    ]  # fmt: skip
    if ON_CPU:  # what only a GPU has goes: sync BN, mixed precision
        for flag in ("--trainer.sync_batchnorm", "--trainer.precision"):
            while flag in args:
                del args[args.index(flag) : args.index(flag) + 2]
        args += ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]
    return args


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    done = run_session(args, timeout, cwd=REPO)
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


RUNS = {
    # native AMP with sync BN, on the recipe's strategy
    "ddp_default_stream-16-mixed": ["--trainer.strategy", "ddp_default_stream", "--trainer.precision", "16-mixed",
                                    "--trainer.sync_batchnorm", "true", "--trainer.max_epochs", "1"],
    # plain DDP (finding the frozen backbone's unused parameters) in bfloat16, two epochs: the first frozen
    "ddp-bf16-mixed": ["--trainer.strategy", "ddp_find_unused_parameters_true", "--trainer.precision", "bf16-mixed",
                       "--model.freeze_backbone_epochs", "1", "--trainer.max_epochs", "2"],
}  # fmt: skip


@pytest.fixture(scope="module")
def fitted(root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The log folders of the ``RUNS``, each a two-GPU ``fit``, made once for the tests that read them."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            done = _run(_args(root, out, *RUNS[name]))
            assert done.returncode == 0, done.stderr[-2000:]
            made[name] = out
        return made[name]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(RUNS))
def test_two_gpu_fit_trains_and_validates_exactly(root: Path, tmp_path: Path, fitted, name: str) -> None:
    out = fitted(name)
    epochs = int(RUNS[name][RUNS[name].index("--trainer.max_epochs") + 1])
    rows = _rows(out)
    losses = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert len(losses) >= STEPS_PER_EPOCH * epochs // 5 and all(math.isfinite(v) for v in losses)
    assert int(max(int(r["step"]) for r in rows)) + 1 >= 40 * epochs
    ckpt = next(out.rglob("last.ckpt"))
    precision = RUNS[name][RUNS[name].index("--trainer.precision") + 1]
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
        "trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.PoisonBatches\n"
        "      init_args: {rank: 1, from_step: 12}\n"
    )
    done = _run(_args(root, tmp_path, "--config", str(poison), "--trainer.max_epochs", "3",
                      "--non_finite.max_consecutive", "8"))  # fmt: skip
    assert done.returncode == 1, done.stderr[-2000:]
    assert "The training loss was NaN or infinite for 8 consecutive batches from global step 12;" in done.stderr


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
        pids = [proc.pid] + ([rank_pid(proc.pid, 1)] if targets == "all ranks" else [])
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
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == step + 10


def test_a_two_gpu_run_resumes_on_one_gpu(root: Path, tmp_path: Path, fitted) -> None:
    ckpt = next(fitted("ddp_default_stream-16-mixed").rglob("last.ckpt"))
    step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    resumed = _run(_args(root, tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt), devices=1))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=False)
    assert final["epoch"] == 1 and final["global_step"] == step + 2 * STEPS_PER_EPOCH - 1  # 81 batches of 16


def test_a_one_gpu_run_resumes_on_two_gpus(root: Path, tmp_path: Path) -> None:
    done = _run(_args(root, tmp_path, "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1", devices=1))
    assert done.returncode == 0, done.stderr[-2000:]
    ckpt = next(tmp_path.rglob("last.ckpt"))
    step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    resumed = _run(_args(root, tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt)))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    final = torch.load(tmp_path / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["epoch"] == 1 and final["global_step"] == step + STEPS_PER_EPOCH


def test_two_gpu_predict_writes_every_image_once(root: Path, tmp_path: Path, fitted) -> None:
    ckpt = next(fitted("ddp_default_stream-16-mixed").rglob("last.ckpt"))
    predicted = _run(_args(root, tmp_path, "--ckpt_path", str(ckpt), "--data.predict_root", str(root / "val"),
                           subcommand="predict"))  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    (out,) = tmp_path.rglob("predictions.csv")  # the default: in the run's log folder
    rows = list(csv.DictReader(open(out)))
    assert sorted(Path(r["path"]) for r in rows) == sorted((root / "val").rglob("*.jpg"))
    assert len(rows) == VAL_IMAGES
