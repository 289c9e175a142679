import errno
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.io import TorchCheckpointIO

from lit_imagenet.callbacks import checkpoints, preemption
from lit_imagenet.callbacks.checkpoints import (
    AtomicCheckpointIO,
    CheckpointWriteError,
    StepCheckpoint,
    use_atomic_checkpoint_io,
)
from lit_imagenet.cli import main
from tests.cli_args import SMALL_ARCH, error_lines
from tests.cli_args import fit_args as _fit_args
from tests.runs import run_train, sigterm_once_written

REPO = Path(__file__).resolve().parents[1]


def _half_then(error: BaseException):
    real_save = torch.save

    def save(obj, f, *args, **kwargs) -> None:
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        raise error

    return save


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(1000)}, path)
    monkeypatch.setattr(torch, "save", _half_then(RuntimeError("killed mid-write")))
    with pytest.raises(RuntimeError, match="killed mid-write"):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(1000)}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]  # no temporary file left behind


def test_disk_full_names_the_path_and_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, path)
    monkeypatch.setattr(torch, "save", _half_then(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(CheckpointWriteError) as exc:
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(1000)}, path)
    assert str(path) in exc.value.strerror and "previous checkpoint" in exc.value.strerror
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]


_KILLED_WRITER = """
import sys, time, torch
from lit_imagenet.callbacks.checkpoints import AtomicCheckpointIO
io, path = AtomicCheckpointIO(), sys.argv[1]
io.save_checkpoint({"global_step": 1}, path)
def stuck(obj, f, *a, **k):
    f.write(b"x" * 100_000); f.flush()
    print("writing", flush=True)
    time.sleep(600)
torch.save = stuck
io.save_checkpoint({"global_step": 2}, path)
"""


def test_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert torch.load(path, weights_only=True)["global_step"] == 1
    (left,) = [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert left.name.startswith(".last.ckpt.") and left.stat().st_size == 100_000
    # The next process to save into the folder (a restart) removes it, saying so.
    again = "import sys\nfrom lit_imagenet.callbacks.checkpoints import AtomicCheckpointIO\n" \
            "AtomicCheckpointIO().save_checkpoint({'global_step': 3}, sys.argv[1])"  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", again, str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"Removed {left} (100,000 bytes): the unfinished write of a checkpoint" in proc.stderr
    assert os.listdir(tmp_path) == ["last.ckpt"] and torch.load(path, weights_only=True)["global_step"] == 3


def test_only_unfinished_writes_from_before_the_process_began_are_removed(tmp_path: Path, monkeypatch) -> None:
    """A temporary file written since the process began may belong to a write under way elsewhere; files of
    other names are not checkpoint writes."""
    monkeypatch.setattr(checkpoints, "_STARTED", time.time())
    old, recent = tmp_path / ".last.ckpt.a1b2c3d4.tmp", tmp_path / ".epoch002.ckpt.zz_9y8x7.tmp"
    others = [tmp_path / ".notes.tmp", tmp_path / "last.ckpt.a1b2c3d4.tmp", tmp_path / ".last.ckpt.a1b2.tmp"]
    for f in (old, recent, *others):
        f.write_bytes(b"x" * 10)
    os.utime(old, (checkpoints._STARTED - 60, checkpoints._STARTED - 60))
    os.utime(recent, (checkpoints._STARTED + 1, checkpoints._STARTED + 1))
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "epoch003.ckpt")
    assert sorted(os.listdir(tmp_path)) == sorted(f.name for f in (recent, *others, tmp_path / "epoch003.ckpt"))


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_a_checkpoint_has_the_mode_that_the_umask_gives_a_new_file(tmp_path: Path, umask: int) -> None:
    """As Lightning's writer and ``torch.save`` give: a group's shared folder can read its runs' checkpoints."""
    before = os.umask(umask)
    try:
        AtomicCheckpointIO().save_checkpoint({"global_step": 1}, tmp_path / "last.ckpt")
        torch.save({"global_step": 1}, tmp_path / "plain.ckpt")
    finally:
        os.umask(before)
    assert (tmp_path / "last.ckpt").stat().st_mode & 0o777 == 0o666 & ~umask
    assert (tmp_path / "plain.ckpt").stat().st_mode & 0o777 == 0o666 & ~umask


def test_default_writer_is_replaced_but_a_users_is_kept(tmp_path: Path) -> None:
    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    use_atomic_checkpoint_io(trainer)
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO

    class Mine(TorchCheckpointIO):
        pass

    trainer = pl.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, plugins=[Mine()])
    use_atomic_checkpoint_io(trainer)
    assert type(trainer.strategy.checkpoint_io) is Mine


def test_step_checkpoints_and_resume_from_last(shapes_root: Path, tmp_path: Path, capsys, recwarn) -> None:
    # 24 training images in batches of 8: 3 steps per epoch; a step checkpoint every 2 steps
    cli = main(
        _fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "1", "--step_checkpoint.every_n_train_steps", "2")
    )
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    step_ckpt = Path(cli.trainer.log_dir) / "checkpoints" / "last-step.ckpt"
    assert torch.load(step_ckpt, weights_only=True)["global_step"] == 2
    assert (Path(cli.trainer.log_dir) / "checkpoints" / "last.ckpt").is_file()
    capsys.readouterr()
    # mid-epoch: resume from the step checkpoint (make it the newest) and finish a second epoch
    os.utime(step_ckpt)
    cli = main(_fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "2", "--ckpt_path", "last"))
    assert f"Resuming from {step_ckpt}" in capsys.readouterr().out
    assert cli.trainer.global_step == 6 and cli.trainer.current_epoch == 2
    # Saved every 2 steps, resumed saving every 15 minutes: the step checkpoint's state is found all the same.
    assert not [w for w in recwarn if "callbacks used to create the checkpoint" in str(w.message)]


def test_disk_full_in_a_fit_is_one_line_and_exit_1(shapes_root: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch, "save", _half_then(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(SystemExit) as exc:
        main(_fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "0"))
    assert exc.value.code == 1
    (err,) = error_lines(capsys.readouterr().err)
    assert err.startswith("error: No space left to write checkpoint") and ".ckpt" in err


def _step(ckpt: Path) -> int:
    return torch.load(ckpt, weights_only=True)["global_step"]


def test_sigterm_saves_a_checkpoint_and_the_run_resumes_from_it(shapes_root: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # batches of 2: 12 steps per epoch; many epochs, so that the run is still going when the signal comes
    args = _fit_args(shapes_root, tmp_path, "--data.batch_size", "2", "--trainer.max_epochs", "1000", arch=SMALL_ARCH)
    first = tmp_path / "checkpoints"
    # the end of epoch 0: the run is past its start-up
    sigterm_once_written(args, first / "last.ckpt", 120, env=env, cwd=tmp_path)
    saved = _step(first / "last-step.ckpt")  # every_n_train_steps is 0: only the SIGTERM save writes it
    assert saved >= 12

    args = _fit_args(shapes_root, tmp_path, "--data.batch_size", "2", "--trainer.max_steps", str(saved + 2),
                     "--step_checkpoint.every_n_train_steps", "1", "--ckpt_path", "last", arch=SMALL_ARCH)  # fmt: skip
    proc = run_train(args, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resuming from {first / 'last-step.ckpt'}" in proc.stdout
    assert _step(tmp_path / "checkpoints" / "last-step.ckpt") == saved + 2


def test_step_checkpoint_writes_nothing_at_the_end_of_a_run(shapes_root: Path, tmp_path: Path) -> None:
    """A run shorter than the step checkpoint's interval writes none: the run's end is last.ckpt already."""
    cli = main(_fit_args(shapes_root, tmp_path, "--trainer.max_epochs", "1"))
    folder = Path(cli.trainer.log_dir) / "checkpoints"
    assert (folder / "last.ckpt").is_file() and not (folder / "last-step.ckpt").exists()


class SignalInStep(pl.Callback):
    """Sends this process SLURM's requeue signal between the forward and the backward pass of step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_requeue_signal_mid_step_saves_after_that_step_and_requeues_the_job(
    shapes_root: Path, tmp_path: Path, monkeypatch, capsys, caplog
) -> None:
    """One SLURM task (its variables set by hand), and a fake ``scontrol`` that records its arguments."""
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}  # fmt: skip
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(preemption, "_requeue_signalled", False)
    common = ("--data.batch_size", "2", "--trainer.deterministic", "true", "--seed_everything", "3",
              "--trainer.limit_val_batches", "0", "--curves.enabled", "false")  # fmt: skip
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        main(_fit_args(shapes_root, tmp_path / "whole", *common, "--trainer.max_steps", "4",
                       "--step_checkpoint.every_n_train_steps", "4"))  # fmt: skip
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            main(_fit_args(shapes_root, tmp_path / "cut", *common, "--trainer.max_steps", "12",
                           "--trainer.callbacks+=tests.test_checkpointing.SignalInStep",
                           "--trainer.callbacks.at", "3"))  # fmt: skip
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert exc.value.code == 128 + signal.SIGUSR1
    assert calls.read_text() == "requeue 4242\n"
    saved = next((tmp_path / "cut").rglob("last-step.ckpt"))
    assert f"Requeue signal: saved {saved} at step 4." in caplog.text
    assert "Requeued SLURM job 4242" in capsys.readouterr().out
    # The weights, batch-norm statistics, momentum and schedule of an uninterrupted run after 4 steps: the
    # signal came in the middle of step 4 (its forward pass had updated the batch-norm statistics), and the
    # checkpoint waited for the step's end.
    cut = torch.load(saved, weights_only=True)
    whole = torch.load(next((tmp_path / "whole").rglob("last-step.ckpt")), weights_only=True)
    assert cut["global_step"] == whole["global_step"] == 4
    different = [k for k in whole["state_dict"] if not torch.equal(whole["state_dict"][k], cut["state_dict"][k])]
    assert not different, different[:5]
    assert cut["lr_schedulers"] == whole["lr_schedulers"]
    momentum = [(a["momentum_buffer"], b["momentum_buffer"]) for a, b in zip(
        whole["optimizer_states"][0]["state"].values(), cut["optimizer_states"][0]["state"].values())]  # fmt: skip
    assert momentum and all(torch.equal(a, b) for a, b in momentum)


def _requeue_rank(rank: int, init_file: str, folder: str) -> None:
    os.environ["SLURM_PROCID"] = str(rank)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        returned = []
        for attempt in ("works", "fails"):
            if rank == 0 and attempt == "fails":
                Path(folder, "fail").touch()  # the next scontrol fails
            returned += [str(preemption.requeue_slurm_job()), str(time.time())]
        Path(folder, f"rank{rank}.txt").write_text(" ".join(returned))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_every_process_waits_for_the_requeue_and_exits_with_its_status(tmp_path: Path, monkeypatch) -> None:
    """Under ``srun --kill-on-bad-exit=1`` a process that exited before the first one's ``scontrol requeue``
    returned would have ``srun`` kill it: none does, and all give the requeue's exit status, once with an
    ``scontrol`` that requeues the job and once with one that fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        f"#!/bin/sh\nsleep 1\nif [ -e {tmp_path}/fail ]; then date +%s.%N > {tmp_path}/failed\n"
        f"echo 'Job is pending' >&2; exit 1; fi\ndate +%s.%N > {tmp_path}/requeued\n"
    )
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    torch.multiprocessing.spawn(_requeue_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    requeued, failed = (float((tmp_path / name).read_text()) for name in ("requeued", "failed"))
    for rank in (0, 1):
        status, second, status_then, second_then = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert (int(status), int(status_then)) == (128 + signal.SIGUSR1, 1), rank
        assert float(second) >= requeued and float(second_then) >= failed, rank


def test_torchrun_restarts_that_cannot_work_are_named(monkeypatch) -> None:
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "2",
                        "TORCHELASTIC_MAX_RESTARTS": "3"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    problem = preemption.torchrun_restart_problem()
    assert problem and "--max-restarts 3" in problem and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in problem
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert preemption.torchrun_restart_problem() is None
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one agent restarts its own group with no trouble
    assert preemption.torchrun_restart_problem() is None


def test_step_checkpoints_are_saved_every_15_minutes_unless_told_otherwise(shapes_root: Path, tmp_path: Path) -> None:
    def interval(*args: str) -> timedelta | None:
        cli = main([*args, "--data.root", str(shapes_root), "--trainer.default_root_dir", str(tmp_path)], run=False)
        return cli.config["step_checkpoint"]["train_time_interval"]

    assert interval() == timedelta(minutes=15)
    assert interval("--step_checkpoint.train_time_interval", "0:00:02") == timedelta(seconds=2)
    assert interval("--step_checkpoint.train_time_interval", "null") is None
    recipe = ("--config", str(REPO / "configs" / "resnet50.yaml"), "--trainer.accelerator", "cpu",
              "--trainer.devices", "1", "--trainer.precision", "32-true")  # fmt: skip
    assert interval(*recipe) == timedelta(minutes=15)
    assert interval(*recipe, "--step_checkpoint.train_time_interval", "1:00:00") == timedelta(hours=1)
    with pytest.raises(ValueError, match="train_time_interval must be positive"):
        StepCheckpoint(train_time_interval=timedelta(0))


def test_last_follows_every_epoch_when_the_best_does_not_improve(shapes_root: Path, tmp_path: Path) -> None:
    # lr 0: the weights and so val/top1 never change, and only epoch 0 makes a best checkpoint
    main(_fit_args(shapes_root, tmp_path, "--model.lr", "0", "--trainer.max_epochs", "3", "--curves.enabled", "false",
                   arch=SMALL_ARCH))  # fmt: skip
    best = [p for p in (tmp_path / "checkpoints").glob("epoch*.ckpt")]
    assert [p.name.startswith("epoch000") for p in best] == [True]
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["epoch"] == 2 and last["global_step"] == 3 * _step(best[0])
