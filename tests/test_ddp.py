"""``ddp_default_stream``: Lightning's DDP with the model wrapped on the current stream."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytorch_lightning.strategies import DDPStrategy

from lit_imagenet.training.strategies import DefaultStreamDDPStrategy
from tests.cli_args import SMALL_ARCH, fit_args
from tests.runs import run_train

REPO = Path(__file__).resolve().parents[1]


def test_the_model_is_wrapped_without_a_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    def no_side_stream(*args, **kwargs):
        raise AssertionError("a side stream was made")

    monkeypatch.setattr(torch.cuda, "Stream", no_side_stream)
    monkeypatch.setattr("lit_imagenet.training.strategies.DistributedDataParallel",
                        lambda module, device_ids, **kw: made.append((module, device_ids)) or "wrapped")  # fmt: skip
    strategy = DefaultStreamDDPStrategy()
    monkeypatch.setattr(strategy, "determine_ddp_device_ids", lambda: [0])
    model = torch.nn.Linear(2, 2)
    assert strategy._setup_model(model) == "wrapped" and made == [(model, [0])]
    # Lightning's own strategy is what makes the side stream:
    base = DDPStrategy()
    monkeypatch.setattr(base, "determine_ddp_device_ids", lambda: [0])
    with pytest.raises(AssertionError, match="side stream"):
        base._setup_model(model)


@pytest.mark.timeout(300)
def test_two_processes_train_with_it(shapes_root: Path, tmp_path: Path) -> None:
    # A console line at the end of each epoch (no validation takes it first): reading the epoch's metrics for it
    # is a collective, which every rank must make, or the ranks' next collectives (the non-finite guard's) meet
    # the wrong partners.
    record = tmp_path / "record.yaml"
    record.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.RecordCollectives\n"
                      f"      init_args: {{folder: {tmp_path / 'collectives'}}}\n")  # fmt: skip
    args = fit_args(shapes_root, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "ddp_default_stream",
                    "--trainer.max_epochs", "2", "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "0",
                    "--config", str(record), arch=SMALL_ARCH)  # fmt: skip
    proc = run_train(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stderr + proc.stdout
    ckpt = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 4  # 24 images, batch 8, 2 ranks: 2 steps per epoch
    ranks = [(tmp_path / "collectives" / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert ranks[0] == ranks[1] and "all_reduce" in ranks[0], ranks


@pytest.mark.timeout(300)
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_and_resumes(shapes_root: Path, tmp_path: Path) -> None:
    """A scheduler may signal one rank only, or each rank at its own moment: every rank must stop at the
    same batch, or the one that stopped saves its checkpoint while the others wait in another collective."""
    import os
    import signal

    from tests.runs import rank_pid

    args = fit_args(shapes_root, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                    "--trainer.max_steps", "100000", "--trainer.max_epochs", "-1", "--trainer.log_every_n_steps", "1",
                    "--trainer.limit_val_batches", "0", arch=SMALL_ARCH)  # fmt: skip
    errors = tmp_path / "stderr.txt"
    with open(errors, "w") as err_file:
        proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], stdout=subprocess.PIPE,
                                stderr=err_file, text=True, cwd=tmp_path)  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if " step 3 " in line:  # training is under way
                break
        os.kill(rank_pid(proc.pid, 1), signal.SIGTERM)  # rank 1 only: Lightning's own handling hangs here
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = errors.read_text()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "[rank 1] Received SIGTERM; every rank stops at the next check." in err
    assert err.count("Stopped by SIGTERM; resume with --ckpt_path last.") == 2  # both ranks, not one
    (saved,) = tmp_path.rglob("last-step.ckpt")
    step = torch.load(saved, map_location="cpu", weights_only=False)["global_step"]
    resumed = run_train(fit_args(shapes_root, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                                 "--trainer.max_steps", str(step + 2), "--trainer.max_epochs", "-1",
                                 "--trainer.limit_val_batches", "0", "--ckpt_path", "last", arch=SMALL_ARCH),
                       cwd=tmp_path)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resuming from {saved}" in resumed.stdout


@pytest.mark.timeout(300)
def test_two_processes_predict_into_the_run_of_the_checkpoint(shapes_root: Path, tmp_path: Path) -> None:
    """The default CSV path is the run folder of the checkpoint: every rank writes its share there, once."""
    import csv

    fit = run_train(fit_args(shapes_root, tmp_path / "fit", "--trainer.max_epochs", "1", arch=SMALL_ARCH))
    assert fit.returncode == 0, fit.stderr[-3000:]
    ckpt = next((tmp_path / "fit").rglob("last.ckpt"))
    args = fit_args(shapes_root, tmp_path / "predict", "--trainer.devices", "2", "--trainer.strategy", "ddp",
                    "--ckpt_path", str(ckpt), "--data.predict_root", str(shapes_root / "val"),
                    arch=SMALL_ARCH)[1:]  # fmt: skip
    done = run_train(["predict", *[a for a in args if a not in ("--data.root", str(shapes_root))]])
    assert done.returncode == 0, done.stderr[-3000:]
    (written,) = tmp_path.rglob("predictions.csv")
    assert written == tmp_path / "fit" / "predictions.csv"
    rows = list(csv.DictReader(open(written)))
    assert sorted(Path(r["path"]) for r in rows) == sorted((shapes_root / "val").rglob("*.jpg"))


@pytest.mark.timeout(300)
def test_an_error_of_rank_0_before_the_ranks_meet_ends_the_rank_it_launched(shapes_root: Path, tmp_path: Path) -> None:
    """Lightning ends the ranks it launched on Ctrl-C only: after another error of rank 0, rank 1 would wait in the
    rendezvous for 30 minutes, holding the run's standard output."""
    import socket
    import time

    from lit_imagenet.cli import LAUNCHED_RANKS_GRACE
    from tests.runs import run_env

    with socket.socket() as taken:  # rank 0 cannot serve the rendezvous there; rank 1 connects and waits
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = fit_args(shapes_root, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                        "--trainer.max_epochs", "1", arch=SMALL_ARCH)  # fmt: skip
        env = run_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        started = time.monotonic()
        proc = run_train(args, timeout=240, cwd=tmp_path, env=env)
        seconds = time.monotonic() - started
    assert proc.returncode != 0
    assert "Ended 1 launched rank still running" in proc.stderr, proc.stderr[-3000:]
    assert seconds < LAUNCHED_RANKS_GRACE + 60, seconds
