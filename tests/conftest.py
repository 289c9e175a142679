from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_imagenet.synthetic import make_shapes


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
