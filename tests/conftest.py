from __future__ import annotations

import atexit
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lit_imagenet.data.synthetic import make_shapes
from tests.runs import REPO, BackgroundRun, job_script_flags, run_flags

# The data modules' index files go to a folder of this session's, not to the user's cache; the runs that tests
# start in subprocesses inherit it.
if "LIT_IMAGENET_CACHE" not in os.environ:
    os.environ["LIT_IMAGENET_CACHE"] = tempfile.mkdtemp(prefix="lit_imagenet_test_cache_")
    atexit.register(shutil.rmtree, os.environ["LIT_IMAGENET_CACHE"], ignore_errors=True)


def checkout_entries(repo: Path = REPO) -> set[str] | None:
    """``git status --porcelain --ignored`` of the checkout, less Python's byte-code caches; ``None`` outside git."""
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--ignored"], cwd=repo, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {line for line in out.stdout.splitlines() if "__pycache__" not in line and ".pytest_cache" not in line}


_BEFORE_KEY = pytest.StashKey[set[str] | None]()
_LEFT_KEY = pytest.StashKey[list[str]]()


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # pytest-xdist's workers have it: the check runs once, in the controller


def pytest_sessionstart(session: pytest.Session) -> None:
    if _controller(session.config):
        session.config.stash[_BEFORE_KEY] = checkout_entries()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the run when the tests left something in the checkout: they write under their temporary folders only."""
    before = session.config.stash.get(_BEFORE_KEY, None)
    if not _controller(session.config) or before is None:
        return
    after = checkout_entries() or set()
    left = sorted(after - before)
    session.config.stash[_LEFT_KEY] = left
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    left = config.stash.get(_LEFT_KEY, [])
    if left:
        names = ", ".join(line[3:] for line in left)  # after git's two status letters and a space
        line = f"The tests left {names} in the checkout {REPO}; tests write under tmp_path."
        terminalreporter.write_line(line, red=True)


def _dali_missing() -> str | None:
    """Why NVIDIA DALI cannot be used here, or ``None``; under CI on Linux x86_64, where ``make test`` installs it,
    it is never missing: its tests then run, and fail if the install went wrong."""
    if os.environ.get("CI") and platform.system() == "Linux" and platform.machine() == "x86_64":
        return None
    try:
        import nvidia.dali  # noqa: F401
    except Exception as err:
        return f"needs NVIDIA DALI ({type(err).__name__}: {err}); pip install -e '.[test]' installs it"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_dali = _dali_missing() if any(item.get_closest_marker("dali") for item in items) else None
    for item in items:
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if no_dali is not None and item.get_closest_marker("dali"):
            item.add_marker(pytest.mark.skip(reason=no_dali))


@pytest.fixture(scope="session")
def shapes_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny shapes ImageFolder: 3 classes, 8 train and 5 val images each (15 val: odd on purpose)."""
    root = tmp_path_factory.mktemp("data") / "shapes"
    return make_shapes(str(root), train_per_class=8, val_per_class=5, width=40, height=40, num_classes=3)


@pytest.fixture(scope="session")
def learnable_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small shapes ImageFolder that a short run learns from."""
    root = tmp_path_factory.mktemp("data") / "learnable"
    return make_shapes(str(root), train_per_class=48, val_per_class=8, width=40, height=40, num_classes=3)


@pytest.fixture(scope="session")
def uninterrupted_ddp_run(learnable_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundRun]:
    """The cluster tests' run (``tests.runs``) made in one go, its 2 processes started by Lightning: what a run
    interrupted on a cluster must end with. Not started yet."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run = BackgroundRun([str(REPO / "train.py"), *job_script_flags(), *run_flags(learnable_root, out)], out)
    yield run
    run.stop()


@pytest.fixture(scope="session")
def uninterrupted_ddp(uninterrupted_ddp_run: BackgroundRun) -> Path:
    """The final checkpoint of ``uninterrupted_ddp_run``."""
    return uninterrupted_ddp_run.final()
