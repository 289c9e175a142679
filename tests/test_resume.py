"""A run killed with SIGKILL mid-epoch and resumed ends with exactly the weights of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lit_imagenet.cli import main
from lit_imagenet.data.samplers import EpochSeededSampler
from tests.cli_args import fit_args
from tests.runs import differing, final_checkpoint, global_step

REPO = Path(__file__).resolve().parents[1]


def _args(root: Path, out: Path, *extra: str) -> list[str]:
    return fit_args(
        root, out, "--trainer.max_epochs", "2", "--trainer.deterministic", "true", "--seed_everything", "7",
        "--step_checkpoint.every_n_train_steps", "1", "--trainer.limit_val_batches", "2", *extra,
        batch_size=6, workers=2,
    )  # fmt: skip


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def kill_when(proc: subprocess.Popen, out: Path, at: Callable[[int], bool], timeout: float = 600) -> int:
    """Sends SIGKILL to ``proc`` once its ``last-step.ckpt`` under ``out`` holds a step for which ``at`` is true.

    Returns that step; fails the test if the run ends first.
    """
    killed_at = None
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        steps = list(out.rglob("last-step.ckpt"))
        if steps:
            try:
                step = global_step(steps[0])
            except Exception:  # being replaced this instant
                step = 0
            if at(step):
                proc.send_signal(signal.SIGKILL)
                killed_at = step
                break
        time.sleep(0.02)
    proc.communicate(timeout=60)
    assert killed_at is not None and proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    return killed_at


def test_sigkill_mid_epoch_then_resume_equals_an_uninterrupted_run(learnable_root: Path, tmp_path: Path) -> None:
    # 144 training images in batches of 6: 24 steps an epoch, 48 in all; the kill lands in epoch 0 or 1,
    # and the run resumes from the last of its step checkpoints, one every 3 steps.
    every_3 = ("--step_checkpoint.every_n_train_steps", "3")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    with ThreadPoolExecutor(1) as pool:  # the uninterrupted run beside the one that is killed
        whole_run = _start(_args(learnable_root, whole, *every_3), tmp_path)
        whole_output = pool.submit(whole_run.communicate, timeout=600)
        killed_at = kill_when(_start(_args(learnable_root, cut, *every_3), tmp_path), cut, lambda step: step >= 15)
        out, _ = whole_output.result()
    assert whole_run.returncode == 0, out[-3000:]
    assert 15 <= killed_at < 48

    proc = _start(_args(learnable_root, cut, *every_3, "--ckpt_path", "last"), tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "Resuming from" in out

    assert global_step(final_checkpoint(cut)) == 48
    different = differing(final_checkpoint(whole), final_checkpoint(cut))
    assert not different, different[:5]


def test_sampler_resumes_mid_epoch_with_the_same_samples_and_seeds() -> None:
    data = list(range(50))
    full = EpochSeededSampler(data, seed=3, num_replicas=2, rank=1)
    full.set_epoch(4)
    whole = list(full)
    resumed = EpochSeededSampler(data, seed=3, num_replicas=2, rank=1)
    resumed.resume_at(4, 2 * 10)  # each of the 2 processes trained 10 samples of epoch 4
    assert list(resumed) == whole[10:]
    assert list(resumed) == whole  # only the first pass skips
    other = EpochSeededSampler(data, seed=3, num_replicas=2, rank=1)
    other.set_epoch(5)
    assert [i for i, _ in other] != [i for i, _ in whole]
    assert len({s for _, s in whole}) == len(whole)


def test_a_run_resumed_from_an_epochs_last_step_resumes_exactly_again(shapes_root: Path, tmp_path: Path) -> None:
    """A resume from the last step of an epoch (saved before its validation), then a second one mid-epoch.

    After the first resume Lightning does not count the next epoch as started, so the number of
    started epochs lags behind; the second resume must still skip the batches done in that epoch.
    """
    # 24 training images in batches of 2: 12 steps an epoch, 24 in all
    common = ("--data.batch_size", "2", "--trainer.deterministic", "true", "--seed_everything", "5",
              "--trainer.max_epochs", "2", "--trainer.limit_val_batches", "1", "--curves.enabled", "false")  # fmt: skip
    main(fit_args(shapes_root, tmp_path / "whole", *common, "--step_checkpoint.every_n_train_steps", "12"))
    whole = final_checkpoint(tmp_path / "whole")
    assert global_step(whole) == 24
    cut = tmp_path / "cut"
    main(fit_args(shapes_root, cut, *common, "--trainer.max_steps", "12",
                  "--step_checkpoint.every_n_train_steps", "12"))  # fmt: skip
    last_of_epoch = cut / "lightning_logs" / "version_0" / "checkpoints" / "last-step.ckpt"
    assert global_step(last_of_epoch) == 12
    main(fit_args(shapes_root, cut, *common, "--trainer.max_steps", "19", "--step_checkpoint.every_n_train_steps", "1",
                  "--ckpt_path", str(last_of_epoch)))  # fmt: skip
    mid_epoch = cut / "lightning_logs" / "version_1" / "checkpoints" / "last-step.ckpt"
    assert global_step(mid_epoch) == 19
    main(fit_args(shapes_root, cut, *common, "--step_checkpoint.every_n_train_steps", "1", "--ckpt_path",
                  str(mid_epoch)))  # fmt: skip
    final = cut / "lightning_logs" / "version_2" / "checkpoints" / "last-step.ckpt"
    assert global_step(final) == 24
    different = differing(whole, final)
    assert not different, different[:5]
