"""torchrun's ``--max-restarts`` with ``--ckpt_path last``, as docs/long_runs.md runs it: two agents on 127.0.0.1.

Two torchrun agents (``--nnodes 2``, one CPU process each) meet at a c10d rendezvous on a free port
and run the job script's ``train.py`` command (``tests.runs``). One worker is killed with SIGKILL
mid-epoch; the agents restart the group, the new workers resume from the newest step checkpoint,
and the run ends with the weights of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import (
    REPO,
    STEPS,
    child_pids,
    differing,
    final_checkpoint,
    free_port,
    global_step,
    job_script_flags,
    resumed_at,
    run_env,
    run_flags,
    wait_for_step,
)


@pytest.mark.torchrun
def test_a_killed_worker_is_restarted_and_the_run_resumes_from_its_last_checkpoint(
    learnable_root: Path, tmp_path: Path, uninterrupted_ddp: Path
) -> None:
    out, port = tmp_path / "runs", free_port()
    train = [str(REPO / "train.py"), *job_script_flags(), *run_flags(learnable_root, out),
             "--trainer.num_nodes", "2", "--trainer.devices", "1"]  # fmt: skip
    env = run_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # as docs/long_runs.md says: else no restart can connect
    agents, logs = [], [tmp_path / "agent0.log", tmp_path / "agent1.log"]
    for node, log in enumerate(logs):
        # The first agent hosts the rendezvous store; the second connects to it.
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lit-imagenet",
                    "--rdzv-conf", f"is_host={int(node == 0)}", "--max-restarts", "3", "--monitor-interval", "0.5",
                    *train]  # fmt: skip
        with log.open("w") as f:
            agents.append(subprocess.Popen(torchrun, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
    try:
        wait_for_step(out, 4, "the torchrun run", alive=lambda: all(a.poll() is None for a in agents))
        (worker,) = child_pids(agents[1].pid)
        os.kill(worker, signal.SIGKILL)
        for agent in agents:
            agent.wait(timeout=500)
    finally:
        for agent in agents:  # the workers too, which torchrun starts in sessions of their own
            for pid in child_pids(agent.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            agent.kill()
    text = [log.read_text() for log in logs]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(t[-3000:] for t in text)
    assert f"failed (exitcode: -{int(signal.SIGKILL)}) local_rank: 0 (pid: {worker})" in text[1], text[1][-3000:]
    # both agents started a second group: two processes, twice
    assert sum(t.count("Initializing distributed: GLOBAL_RANK") for t in text) == 4
    resumed = out / "checkpoints" / "last-step.ckpt"
    ((path, step),) = resumed_at(text[0] + text[1])
    assert path == str(resumed) and step % 12 != 0  # mid-epoch
    final = final_checkpoint(out)
    assert global_step(final) == STEPS
    different = differing(final, uninterrupted_ddp)
    assert not different, different[:5]
