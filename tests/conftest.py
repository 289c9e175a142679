from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from lit_imagenet.synthetic import make_shapes


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
        if "gpu" in item.keywords and not torch.cuda.is_available():
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
