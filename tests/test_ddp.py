"""``ddp_default_stream``: Lightning's DDP with the model wrapped on the current stream."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytorch_lightning.strategies import DDPStrategy

from lit_imagenet.ddp import DefaultStreamDDPStrategy
from tests.cli_args import fit_args

REPO = Path(__file__).resolve().parents[1]


def test_the_model_is_wrapped_without_a_side_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    made = []

    def no_side_stream(*args, **kwargs):
        raise AssertionError("a side stream was made")

    monkeypatch.setattr(torch.cuda, "Stream", no_side_stream)
    monkeypatch.setattr("lit_imagenet.ddp.DistributedDataParallel", lambda module, device_ids, **kw: made.append(
        (module, device_ids)) or "wrapped")  # fmt: skip
    strategy = DefaultStreamDDPStrategy()
    monkeypatch.setattr(strategy, "determine_ddp_device_ids", lambda: [0])
    model = torch.nn.Linear(2, 2)
    assert strategy._setup_model(model) == "wrapped" and made == [(model, [0])]
    # Lightning's own strategy is what makes the side stream:
    base = DDPStrategy()
    monkeypatch.setattr(base, "determine_ddp_device_ids", lambda: [0])
    with pytest.raises(AssertionError, match="side stream"):
        base._setup_model(model)


def test_two_processes_train_with_it(shapes_root: Path, tmp_path: Path) -> None:
    args = fit_args(shapes_root, tmp_path, "--trainer.devices", "2", "--trainer.strategy", "ddp_default_stream",
                    "--trainer.max_epochs", "1")  # fmt: skip
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Starting with 2 processes" in proc.stderr + proc.stdout
    ckpt = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == 2  # 24 images, batch 8, 2 ranks: 2 steps
