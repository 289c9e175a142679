"""``train.py`` runs in subprocesses, and their checkpoints read back.

The cluster tests interrupt one run (SLURM's requeue and ``scancel``, torchrun's restarts): the job
script's own ``train.py`` command (``scripts/slurm_cpu.sbatch``) with the flags of ``run_flags``
after it: two processes, DDP over gloo on CPU, deterministic, a step checkpoint every 4 steps.
``uninterrupted_ddp`` (conftest) makes it once without interruption.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tests.cli_args import SMALL_ARCH, fit_args

REPO = Path(__file__).resolve().parents[1]
JOB_SCRIPT = REPO / "scripts" / "slurm_cpu.sbatch"
#: 144 training images in batches of 6 on each of 2 processes: 12 steps an epoch, 8 epochs.
STEPS = 96


def job_script_flags() -> list[str]:
    """The flags of the job script's ``srun python train.py`` line, from ``fit`` on, without its ``"$@"``."""
    text = JOB_SCRIPT.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("srun "))
    words = shlex.split(line)
    flags = words[words.index("train.py") + 1 :]
    assert flags[-1] == "$@", f"the srun line of {JOB_SCRIPT} should pass on the script's arguments last"
    return flags[:-1]


def run_flags(root: Path, out: Path) -> list[str]:
    """What the tests add after the job script's flags: the tiny data and model, the seeds, the steps."""
    return fit_args(
        root, out, "--trainer.max_epochs", str(STEPS // 12),
        "--trainer.deterministic", "true", "--seed_everything", "7", "--step_checkpoint.every_n_train_steps", "4",
        "--trainer.limit_val_batches", "2", "--trainer.log_every_n_steps", "4", "--curves.enabled", "false",
        batch_size=6, arch=SMALL_ARCH,
    )[1:]  # fmt: skip


def run_env(**extra: str) -> dict[str, str]:
    """This environment with ``python`` the test's interpreter, the repository importable, no job's variables,
    and one thread per process.

    A test run inside a SLURM job or under torchrun would otherwise hand that job's ranks to its runs.
    Lightning gives each process the cores divided by the processes of its node, and the sums of a
    convolution's gradient come out differently rounded with another number of threads: two nodes of
    one process (torchrun) would not end with the weights of one node of two.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(name, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def network(ckpt: Path) -> dict[str, torch.Tensor]:
    """The network's parameters and buffers in a checkpoint."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("model.")}


def global_step(ckpt: Path) -> int:
    """The checkpoint's optimizer step; -1 while it is being replaced."""
    try:
        return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
    except Exception:  # noqa: BLE001  (renamed over this instant, or not there yet)
        return -1


def final_checkpoint(root: Path) -> Path:
    """The checkpoint with the most steps under ``root`` (a resumed run may write ``last-v1.ckpt``)."""
    return max(root.rglob("*.ckpt"), key=global_step)


def newest_step(root: Path) -> int:
    """The step of the newest ``last-step.ckpt`` under ``root`` (-1 when there is none)."""
    found = list(root.rglob("last-step.ckpt"))
    if not found:
        return -1
    return global_step(max(found, key=lambda p: p.stat().st_mtime_ns))


def wait_for_step(root: Path, step: int, what: str, timeout: float = 240.0, alive=None) -> int:
    """Waits until a ``last-step.ckpt`` under ``root`` holds at least ``step`` steps; its step."""
    deadline = time.monotonic() + timeout
    while (seen := newest_step(root)) < step:
        assert alive is None or alive(), f"{what} ended before step {step} (last step checkpoint: {seen})"
        assert time.monotonic() < deadline, f"{what}: no step checkpoint of step {step} after {timeout:.0f} s"
        time.sleep(0.05)
    return seen


def differing(a: Path, b: Path) -> list[str]:
    """Names of the network tensors that differ between two checkpoints (all of them if the names differ)."""
    first, second = network(a), network(b)
    if first.keys() != second.keys():
        return sorted(first.keys() ^ second.keys())
    return [k for k in first if not torch.equal(first[k], second[k])]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is ``parent``, from ``/proc``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            found.append(int(stat.parent.name))
    return found


def resumed_at(log: str) -> list[tuple[str, int]]:
    """``(checkpoint, step)`` of each resume in a log (the CLI's ``Resuming from PATH (epoch E, step S).``): the file
    itself is rewritten by the run that resumed from it."""
    found = re.findall(r"^Resuming from (\S+) \(epoch \d+, step (\d+)\)\.$", log, re.MULTILINE)
    return [(path, int(step)) for path, step in found]


def resumed_from(log: str) -> list[str]:
    """The checkpoints that the runs of a log resumed from."""
    return [path for path, _ in resumed_at(log)]


class BackgroundRun:
    """A ``train.py`` run in a subprocess, started when first asked for, so that it can use idle cores."""

    def __init__(self, args: list[str], out: Path) -> None:
        self.args, self.out, self.proc = args, out, None

    def start(self) -> None:
        if self.proc is None:
            with (self.out / "run.log").open("w") as log:
                self.proc = subprocess.Popen([sys.executable, *self.args], cwd=REPO, env=run_env(), stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def final(self) -> Path:
        """Its final checkpoint, once it has ended (starting it if need be)."""
        self.start()
        assert self.proc.wait(timeout=600) == 0, (self.out / "run.log").read_text()[-3000:]
        final = final_checkpoint(self.out)
        assert global_step(final) == STEPS
        return final

    def stop(self) -> None:
        """Ends it, the process that Lightning started for rank 1 included."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def rank_pid(parent: int, rank: int) -> int:
    """The process of ``rank``: the child of rank 0 (``parent``) that Lightning started with ``LOCAL_RANK=rank``."""
    for pid in child_pids(parent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"LOCAL_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no process of rank {rank} found among the children of {parent}")


def wait_for_file(proc: subprocess.Popen, path: Path, timeout: float) -> None:
    """Returns once ``path`` is a file; fails the test, with the run's last error output, if ``proc`` ends or
    ``timeout`` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not path.is_file():
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else f"the run ended: {proc.returncode}"
        assert time.monotonic() < deadline, f"no {path.name} after {timeout:g} s"
        time.sleep(0.05)


def sigterm_once_written(args: list[str], path: Path, timeout: float, settle: float = 0.0, **kwargs: Any) -> str:
    """Starts ``python train.py *args``, sends it SIGTERM once ``path`` is a file (``settle`` seconds later), and
    returns its standard output once it has stopped as SIGTERM asks: exit status 143 and its line saying so."""
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)  # fmt: skip
    try:
        wait_for_file(proc, path, timeout)
        time.sleep(settle)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "Stopped by SIGTERM" in err
    return out


def run_train(args: list[str], timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python train.py *args`` to its end, through ``run_session``."""
    return run_session([sys.executable, str(REPO / "train.py"), *args], timeout, **kwargs)


def run_session(command: list[str], timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``command`` to its end, its output captured as text, like ``subprocess.run``; ``kwargs`` go to ``Popen``
    (``cwd``, ``env``).

    The command has a session of its own, and every process in it is stopped on a timeout or an interruption of the
    test (pytest-timeout's, say). ``subprocess.run``'s own timeout kills the first process only: a rank that it
    launched would outlive the test, waiting for its peers until the process group's timeout (30 minutes by default).
    Stopped, each Python process of the session prints the stack of each of its threads (``PYTHONFAULTHANDLER``), and
    the end of the session's output goes to this process's stderr, which pytest shows with the failure.
    """
    env = {**kwargs.pop("env", os.environ), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, env=env, **kwargs) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as error:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGABRT)  # each Python process prints its stacks, then ends
            try:
                out, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # any process that outlived its pipes
            print(f"{shlex.join(command)} was stopped ({type(error).__name__}); the end of its output:\n"
                  f"{out[-3000:]}\n{err[-15000:]}", file=sys.stderr)  # fmt: skip
            if isinstance(error, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
