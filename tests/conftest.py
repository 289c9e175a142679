from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lit_imagenet.synthetic import make_shapes
from tests.runs import REPO, BackgroundRun, job_script_flags, run_flags


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
