"""The SLURM job of docs/long_runs.md, run on a one-machine cluster: requeued by its signal, cancelled, resumed.

``tests/local_slurm.sh`` installs and starts the cluster (root and apt-get; where it cannot, the tests
are skipped with its one-line reason). The job is ``scripts/slurm_cpu.sbatch`` itself, with the
``tests.runs`` flags, so each start is 2 processes under ``srun``. One job goes through what a long
run meets on a cluster, and each test checks one part of it:

1. SLURM's ``--signal`` comes some seconds before the time limit: the run saves and requeues itself;
2. the requeued job resumes from that checkpoint; ``scancel`` then stops it, and it saves again;
3. the job script, submitted again, resumes from there and finishes: with the weights of an
   uninterrupted run.

SLURM's controller looks at time limits every 30 seconds and sends the signal at the first look that
finds the limit less than ``--signal`` seconds (plus those 30) away. So that a short run is still
training at that look, the job is suspended (``scontrol suspend``) once its training is under way,
resumed just before the controller's next look, and given a time limit that this look finds close.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from tests.runs import (
    JOB_SCRIPT,
    REPO,
    STEPS,
    BackgroundRun,
    differing,
    final_checkpoint,
    global_step,
    newest_step,
    resumed_at,
    resumed_from,
    run_env,
    run_flags,
    wait_for_step,
)

#: Seconds before the time limit at which SLURM sends SIGUSR1, as in ``--signal=SIGUSR1@60``.
SIGNAL_SECONDS = 60
#: SLURM's time limit before it is shortened, in minutes: no signal comes before the test asks for it.
LONG_LIMIT = 10
#: The states of a job that has ended (and will not start again).
ENDED = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment of commands that use the local cluster; skips the tests where it cannot start."""
    proc = subprocess.run(["bash", str(REPO / "tests" / "local_slurm.sh")], capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    if proc.returncode == 77:
        pytest.skip(f"no local SLURM cluster: {proc.stderr.strip()}")
    assert proc.returncode == 0, f"tests/local_slurm.sh failed:\n{proc.stdout}{proc.stderr}"
    return run_env(SLURM_CONF=proc.stdout.strip().splitlines()[-1])


def _slurm(env: dict[str, str], *command: str) -> str:
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr.strip()}"
    return proc.stdout.strip()


def _job(env: dict[str, str], job: str) -> dict[str, str]:
    """``scontrol show job``'s fields of a job (``JobState``, ``Restarts``, ``SecsPreSuspend`` ...)."""
    return dict(re.findall(r"(\w+)=(\S*)", _slurm(env, "scontrol", "show", "job", "-o", job)))


def _controller_log(env: dict[str, str]) -> Path:
    conf = Path(env["SLURM_CONF"]).read_text()
    return Path(re.search(r"^SlurmctldLogFile=(\S+)", conf, re.MULTILINE).group(1))


def _controller_tail(env: dict[str, str]) -> str:
    with _controller_log(env).open("rb") as f:
        f.seek(max(0, f.seek(0, 2) - 200_000))
        return f.read().decode(errors="replace")


def _last_time_limit_check(env: dict[str, str]) -> float:
    """When the controller last looked at the jobs' time limits (its debug2 line), in seconds since the epoch.

    Only a look of the last 33 s counts: the controller looks every 30 s, so an older line is from a
    controller that has stopped since, and one started less than 30 s ago has not looked yet. This
    waits for such a look.
    """
    deadline = time.monotonic() + 45
    while True:
        stamps = re.findall(r"^\[(\S+)\] debug2: Testing job time limits", _controller_tail(env), re.M)
        if stamps and time.time() - datetime.fromisoformat(stamps[-1]).timestamp() < 33:
            return datetime.fromisoformat(stamps[-1]).timestamp()
        assert time.monotonic() < deadline, "the controller logs no time-limit check; its SlurmctldDebug must be debug2"
        time.sleep(0.2)


def _wait_state(env: dict[str, str], job: str, done: tuple[str, ...], timeout: float, out: Path) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while (fields := _job(env, job))["JobState"] not in done:
        assert time.monotonic() < deadline, f"job {job} is {fields['JobState']} after {timeout:.0f} s:\n{_tails(out)}"
        time.sleep(0.2)
    return fields


def _tails(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(out.glob("slurm-*.out")))


def _signal_while_it_trains(env: dict[str, str], job: str, out: Path) -> None:
    """Has the controller's next time-limit check send the job its ``--signal`` while the job trains.

    The job is suspended until 2.5 s before that check, with a time limit that the check finds less
    than SIGNAL_SECONDS (+30) away but still at least 20 s off: time enough to save and requeue. When
    no signal has come 4 s after the check was due (a ``scontrol resume`` that came back late, or a
    check later than its period), the job is suspended again and the next check is tried.
    """
    sent = f"warning signal {int(signal.SIGUSR1)} to JobId={job}\n"
    for _ in range(4):
        _slurm(env, "scontrol", "suspend", job)
        ran = int(_wait_state(env, job, ("SUSPENDED",), 30, out)["SecsPreSuspend"])
        if sent in _controller_tail(env):  # the check came while the job was being suspended
            _slurm(env, "scontrol", "resume", job)
            return
        check = _last_time_limit_check(env) + 30  # the next check comes 30 to 31 s after the last one
        while check - time.time() < 3:
            check += 30
        _slurm(env, "scontrol", "update", f"JobId={job}", f"TimeLimit={(ran + SIGNAL_SECONDS + 30) // 60}")
        time.sleep(max(0.0, check - 2.5 - time.time()))
        _slurm(env, "scontrol", "resume", job)
        deadline = check + 5
        while time.time() < deadline:
            if sent in _controller_tail(env):
                return
            time.sleep(0.1)
    raise AssertionError(f"SLURM sent no SIGUSR1 to job {job} at 4 of its time-limit checks:\n{_tails(out)}")


@dataclass
class Job:
    """What one job went through, as the tests read it afterwards."""

    id: str
    out: Path  # its runs' folder: the checkpoints and the job's output files
    log: str  # the output of both its starts (--open-mode=append)
    controller_log: str  # the controller's lines about it
    restarts_after_signal: int
    signal_step: int  # the step of the checkpoint saved on the signal
    cancelled_state: str
    cancel_step: int  # the step of the checkpoint saved on scancel
    resubmitted_log: str
    resubmitted_state: str


@pytest.fixture(scope="module")
def job(
    slurm_env: dict[str, str],
    learnable_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
    uninterrupted_ddp_run: BackgroundRun,
) -> Job:
    env, out = slurm_env, tmp_path_factory.mktemp("slurm")
    submitted: list[str] = []

    def submit() -> str:
        job = _slurm(env, "sbatch", "--parsable", f"--time={LONG_LIMIT}", f"--signal=SIGUSR1@{SIGNAL_SECONDS}",
                     "--cpus-per-task=1", f"--output={out}/slurm-%j.out", f"--chdir={REPO}", str(JOB_SCRIPT),
                     *run_flags(learnable_root, out))  # fmt: skip
        submitted.append(job)
        return job

    def running(job: str) -> bool:  # or about to run again
        return _job(env, job)["JobState"] not in ENDED

    try:
        job = submit()
        uninterrupted_ddp_run.start()  # on the cores that the job leaves idle while it waits
        wait_for_step(out, 4, f"SLURM job {job}", alive=lambda: running(job))
        _signal_while_it_trains(env, job, out)
        # Sent: back to the long limit, so that the job is not signalled again while it starts once requeued.
        _slurm(env, "scontrol", "update", f"JobId={job}", f"TimeLimit={LONG_LIMIT}")

        deadline = time.monotonic() + 120
        while int((fields := _job(env, job)).get("Restarts", 0)) < 1:
            assert fields["JobState"] not in ENDED, f"job {job} {fields['JobState']} before a requeue:\n{_tails(out)}"
            assert time.monotonic() < deadline, f"job {job} was not requeued within 120 s:\n{_tails(out)}"
            time.sleep(0.1)
        restarts = int(fields["Restarts"])
        signal_step = newest_step(out)

        wait_for_step(out, signal_step + 4, f"requeued SLURM job {job}", alive=lambda: running(job))
        _slurm(env, "scancel", job)
        cancelled = _wait_state(env, job, ENDED, 90, out)
        cancel_step = newest_step(out)

        again = submit()
        resubmitted = _wait_state(env, again, ENDED, 300, out)
    finally:
        for each in submitted:
            subprocess.run(["scancel", each], env=env, capture_output=True, timeout=60)
    controller = _controller_log(env).read_text(errors="replace")
    return Job(
        id=job,
        out=out,
        log=(out / f"slurm-{job}.out").read_text(),
        controller_log="\n".join(line for line in controller.splitlines() if f"JobId={job} " in line + " "),
        restarts_after_signal=restarts,
        signal_step=signal_step,
        cancelled_state=cancelled["JobState"],
        cancel_step=cancel_step,
        resubmitted_log=(out / f"slurm-{again}.out").read_text(),
        resubmitted_state=resubmitted["JobState"],
    )


@pytest.mark.slurm
def test_the_job_runs_in_slurms_environment(job: Job) -> None:
    # srun started both processes, and Lightning took their ranks from SLURM
    assert job.log.count("SLURM auto-requeueing enabled") >= 2, job.log[-3000:]
    assert "GLOBAL_RANK: 0, MEMBER: 1/2" in job.log and "GLOBAL_RANK: 1, MEMBER: 2/2" in job.log
    assert "command is available on your system but is not used" not in job.log


@pytest.mark.slurm
def test_the_signal_before_the_time_limit_saves_and_requeues_the_job(job: Job) -> None:
    assert f"warning signal {int(signal.SIGUSR1)} to JobId={job.id}" in job.controller_log  # from --signal
    saved = job.out / "checkpoints" / "last-step.ckpt"
    assert f"Requeue signal: saved {saved} at step {job.signal_step}." in job.log, job.log[-3000:]
    assert f"Requeued SLURM job {job.id};" in job.log
    assert job.restarts_after_signal == 1
    assert 4 <= job.signal_step < STEPS


@pytest.mark.slurm
def test_the_requeued_job_resumes_where_the_signal_stopped_it(job: Job) -> None:
    saved = job.out / "checkpoints" / "last-step.ckpt"
    assert resumed_from(job.log) == [str(saved)], job.log[-3000:]
    # its own step checkpoints carry on from there
    assert job.signal_step < job.cancel_step < STEPS


@pytest.mark.slurm
def test_scancel_saves_a_checkpoint_that_the_job_script_resumes_from(job: Job) -> None:
    assert job.cancelled_state == "CANCELLED"
    saved = job.out / "checkpoints" / "last-step.ckpt"
    assert f"SIGTERM: saved {saved} at step {job.cancel_step}." in job.log, job.log[-3000:]
    assert "Stopped by SIGTERM" in job.log
    # Every rank stops at the check after the signal; when that is the end of an epoch, the epoch's last.ckpt,
    # written after validation at the same step, is the newest, and --ckpt_path last takes it.
    ((resumed, step),) = resumed_at(job.resubmitted_log)
    assert resumed in (str(saved), str(saved.with_name("last.ckpt"))), job.resubmitted_log[-3000:]
    assert step == job.cancel_step


@pytest.mark.slurm
def test_the_final_weights_equal_an_uninterrupted_runs(job: Job, uninterrupted_ddp: Path) -> None:
    assert job.resubmitted_state == "COMPLETED", job.resubmitted_log[-3000:]
    final = final_checkpoint(job.out)
    assert global_step(final) == STEPS
    different = differing(final, uninterrupted_ddp)
    assert not different, different[:5]


def test_the_docs_show_the_job_script_the_tests_submit() -> None:
    docs = (REPO / "docs" / "long_runs.md").read_text()
    assert f"```bash\n{JOB_SCRIPT.read_text()}```" in docs
