"""A run killed with SIGKILL mid-epoch and resumed ends with exactly the weights of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lit_imagenet.cli import main
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.samplers import EpochSeededSampler
from tests.cli_args import SMALL_ARCH, fit_args
from tests.runs import differing, final_checkpoint, global_step, run_train

REPO = Path(__file__).resolve().parents[1]


def _args(root: Path, out: Path, *extra: str) -> list[str]:
    return fit_args(
        root, out, "--trainer.max_epochs", "2", "--trainer.deterministic", "true", "--seed_everything", "7",
        "--step_checkpoint.every_n_train_steps", "1", "--trainer.limit_val_batches", "2", *extra,
        batch_size=6, workers=2, arch=SMALL_ARCH,
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


def test_a_run_killed_before_its_first_epoch_ends_resumes_from_its_time_checkpoint(
    learnable_root: Path, tmp_path: Path
) -> None:
    """Step checkpoints by time (every 15 minutes by default; 1 s here, with slow steps): a SIGKILL inside epoch 0
    leaves one to resume from, and the resumed run goes on from its step to exactly an uninterrupted run's weights."""
    one_epoch = ("--trainer.max_epochs", "1", "--step_checkpoint.every_n_train_steps", "0")  # 24 steps
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    slow, record = tmp_path / "slow.yaml", tmp_path / "record.yaml"
    slow.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.SlowSteps\n"
                    "      init_args: {seconds: 0.15}\n")  # fmt: skip
    record.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.RecordBatches\n"
                      f"      init_args: {{folder: {tmp_path / 'batches'}}}\n")  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        whole_run = _start(_args(learnable_root, whole, *one_epoch), tmp_path)
        whole_output = pool.submit(whole_run.communicate, timeout=600)
        killed = _start(_args(learnable_root, cut, *one_epoch, "--step_checkpoint.train_time_interval", "0:00:01",
                              "--config", str(slow)), tmp_path)  # fmt: skip
        killed_at = kill_when(killed, cut, lambda step: step > 0)
        out, _ = whole_output.result()
    assert whole_run.returncode == 0, out[-3000:]
    assert 0 < killed_at < 24 and not list(cut.rglob("last.ckpt"))  # killed inside epoch 0, before its end

    proc = _start(_args(learnable_root, cut, *one_epoch, "--config", str(record), "--ckpt_path", "last"), tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert "Resuming from" in out and "last-step.ckpt" in out
    first = json.loads((tmp_path / "batches" / "batches-rank0.jsonl").read_text().splitlines()[0])
    assert (first["epoch"], first["step"]) == (0, killed_at)
    assert global_step(final_checkpoint(cut)) == 24
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
    last_of_epoch = cut / "checkpoints" / "last-step.ckpt"
    assert global_step(last_of_epoch) == 12
    main(fit_args(shapes_root, cut, *common, "--trainer.max_steps", "19", "--step_checkpoint.every_n_train_steps", "1",
                  "--ckpt_path", str(last_of_epoch)))  # fmt: skip
    mid_epoch = cut / "checkpoints" / "last-step.ckpt"
    assert global_step(mid_epoch) == 19
    main(fit_args(shapes_root, cut, *common, "--step_checkpoint.every_n_train_steps", "1", "--ckpt_path",
                  str(mid_epoch)))  # fmt: skip
    final = cut / "checkpoints" / "last-step.ckpt"
    assert global_step(final) == 24
    different = differing(whole, final)
    assert not different, different[:5]


def _one_image_per_class(root: Path, classes: int) -> Path:
    """``classes`` classes of one training image each: a batch's labels say which samples it holds."""
    from PIL import Image

    for split, count in (("train", classes), ("val", 4)):
        for c in range(count if split == "val" else classes):
            (root / split / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (20, 18), (c * 6 % 256, c * 13 % 256, 90)).save(root / split / f"c{c:03d}" / "x.jpg")
    for c in range(4, classes):  # the same classes in val (an image each for the first 4, a copy for the others)
        (root / "val" / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
        (root / "val" / f"c{c:03d}" / "x.jpg").write_bytes((root / "train" / f"c{c:03d}" / "x.jpg").read_bytes())
    return root


def _elastic_run(root: Path, out: Path, processes: int, *extra: str) -> subprocess.CompletedProcess:
    record = out / "record.yaml"
    out.mkdir(parents=True, exist_ok=True)
    record.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.RecordBatches\n"
                      f"      init_args: {{folder: {out / 'batches'}}}\n")  # fmt: skip
    args = fit_args(root, out, "--trainer.devices", str(processes), "--seed_everything", "5",
                    "--step_checkpoint.every_n_train_steps", "1", "--trainer.limit_val_batches", "1",
                    "--curves.enabled", "false", "--config", str(record), *extra, batch_size=3,
                    arch=SMALL_ARCH)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = run_train(args, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _batches(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for f in sorted((out / "batches").glob("*.jsonl")) for line in f.read_text().splitlines()]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("before", "after", "stop_at"), [(2, 1, 8), (1, 2, 16)])
def test_a_run_resumed_on_another_number_of_processes_trains_each_rest_of_its_epoch_once(
    tmp_path: Path, before: int, after: int, stop_at: int
) -> None:
    """35 samples in batches of 3 (no batch of one, which batch norm refuses), stopped part-way through epoch 1 and
    resumed with another number of processes: the two parts of epoch 1 train every sample, none twice but for the
    padding of the resumed part's shards (at most ``after - 1``); epoch 2 is the seed's order for ``after``
    processes; every learning rate after the resume is the reference's rule for the new global batch at its place
    in the epoch."""
    from lit_imagenet.data.samplers import epoch_order
    from lit_imagenet.training.schedule import WarmupMultiStep, scaled_lr

    root = _one_image_per_class(tmp_path / "data", 35)
    first = _elastic_run(root, tmp_path / "first", before, "--trainer.max_steps", str(stop_at))
    assert "Resumed" not in first.stdout + first.stderr
    (ckpt,) = (tmp_path / "first").rglob("last-step.ckpt")
    assert global_step(ckpt) == stop_at
    resumed = _elastic_run(root, tmp_path / "resumed", after, "--trainer.max_epochs", "3", "--ckpt_path", str(ckpt))
    per_rank = {n: -(-35 // n) for n in (1, 2)}
    steps = {n: -(-per_rank[n] // 3) for n in (1, 2)}  # optimizer steps an epoch
    line = next(ln for ln in (resumed.stdout + resumed.stderr).splitlines() if ln.startswith("Resumed"))
    assert line.startswith(f"Resumed a {before}-process run on {after} process{'es' if after > 1 else ''}: "
                           f"global batch {3 * before} -> {3 * after}, learning rate ")  # fmt: skip

    trained = [b for b in _batches(tmp_path / "first") if b["step"] < stop_at]
    again = _batches(tmp_path / "resumed")
    epoch1 = [label for b in trained + again if b["epoch"] == 1 for label in b["labels"]]
    assert set(epoch1) == set(range(35)) and len(epoch1) - 35 <= after - 1, sorted(epoch1)
    overlap = {label for b in again if b["epoch"] == 1 for label in b["labels"]} & {
        label for b in trained if b["epoch"] == 1 for label in b["labels"]
    }
    assert len(overlap) <= after - 1  # the padding of the resumed shards repeats the epoch's first samples
    # Epoch 2 is the order of a run started with `after` processes.
    labels = ImageFolderDataModule(str(root), index=False).samples("train").labels
    for rank in range(after):
        wanted = labels[epoch_order(35, 5, 2, after, rank)].tolist()
        got = [label for b in _batches_of_rank(tmp_path / "resumed", rank) if b["epoch"] == 2 for label in b["labels"]]
        assert got == wanted
    # The learning rate of every batch after the resume: the rule for the new global batch, at the batch's place.
    rule = WarmupMultiStep(steps[after], 5, (30, 60, 80), 0.1)
    base = scaled_lr(0.1, 3 * after)
    for b in again:
        assert b["lr"] == pytest.approx(base * rule(b["epoch"] * steps[after] + b["batch"]), rel=1e-9), b
    assert [b["batch"] for b in _batches_of_rank(tmp_path / "resumed", 0) if b["epoch"] == 1][-1] == steps[after] - 1


def _batches_of_rank(out: Path, rank: int) -> list[dict]:
    import json

    path = out / "batches" / f"batches-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
