"""The tests' own way of running ``train.py``: a run that outlives its timeout leaves no process behind."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import run_session


def test_every_process_of_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    """As a rank left waiting by rank 0 would: the command ends, its child goes on, holding the output pipes."""
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
    )
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_session([sys.executable, "-c", code], timeout=5)
    assert time.monotonic() - started < 30
    assert "started" in caught.value.output
    pid = int(pid_file.read_text())
    state = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 10
    while state.exists() and state.read_text().rsplit(")", 1)[1].split()[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not state.exists() or state.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the child still runs"


def test_a_command_that_ends_gives_its_code_and_output() -> None:
    done = run_session([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
