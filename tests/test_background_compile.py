"""``--model.compile background`` (and ``auto`` on one GPU): eager steps while a child process compiles the network,
then the compiled network, its graphs found in the caches the child filled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from lit_imagenet import ImageClassifier, ImageFolderDataModule
from lit_imagenet.training import background_compile, models
from lit_imagenet.training.background_compile import BackgroundCompile, CompileSwitch, input_form

REPO = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie of ours has ended
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


class Calls(pl.Callback):
    """Which network each training batch went through; the child is waited for after the first step, so that the
    switch comes at the second."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, str]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: ImageClassifier) -> None:
        switch = pl_module._switch
        network_for = switch.network_for

        def recording(images: torch.Tensor, network: nn.Module) -> nn.Module:
            chosen = network_for(images, network)
            self.calls.append((trainer.global_step, images.shape[0], "eager" if chosen is network else "compiled"))
            return chosen

        switch.network_for = recording

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: ImageClassifier, *args) -> None:
        if trainer.global_step == 1:  # callbacks' hooks come before the module's, which launched and polls the child
            pl_module._switch.child.wait(timeout=400)


def test_the_run_trains_eagerly_then_compiled_from_the_caches_its_background_compile_filled(
    shapes_root: Path, tmp_path: Path, monkeypatch, caplog
) -> None:
    """Steps before the child ended are eager; from the next one on, training batches of the first batch's form
    run compiled with every graph found in the caches; an epoch's short last batch and validation run eager."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch.compiler.reset()  # graphs compiled earlier in this process would be reused without the caches
    pl.seed_everything(0)
    dm = ImageFolderDataModule(str(shapes_root), batch_size=10, workers=0, crop_size=64, val_resize=72)
    # A network of torch.nn's own modules, which the child unpickles as it does a torchvision one: the switch is
    # what is tested, and inductor compiles it in seconds where AlexNet's graphs take it minutes on 2 cores.
    small = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 3))  # fmt: skip
    monkeypatch.setattr(models, "build_model", lambda arch, num_classes, weights: small)
    model = ImageClassifier("alexnet", num_classes=3, lr=0.01, warmup_epochs=0, channels_last=True,
                            compile="background")  # fmt: skip
    assert model.model is small
    calls = Calls()
    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", precision="bf16-mixed", max_epochs=2,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         callbacks=[calls])  # fmt: skip
    try:
        with caplog.at_level("INFO"):
            trainer.fit(model, dm)
    finally:
        torch.compiler.reset()
    lines = [r.getMessage() for r in caplog.records]
    folder = tmp_path / "background_compile"
    assert (
        f"Compile: a background process compiles the network for batches of 10x3x64x64 (log: {folder}/compile.log)."
        in lines
    )
    (switched,) = [line for line in lines if line.startswith("Compiled the network")]
    assert switched.startswith("Compiled the network from the caches of its background compile (")
    assert ") at step 1 and ran its first compiled step in " in switched
    assert f": 2 of 2 graphs found in the caches (compiler caches: {tmp_path / 'compile_cache'})." in switched
    # 24 training images in batches of 10: steps 0-2 in epoch 0 (the third a short batch), 3-5 in epoch 1.
    assert calls.calls == [(0, 10, "eager"), (1, 10, "compiled"), (2, 4, "eager"),
                           (3, 10, "compiled"), (4, 10, "compiled"), (5, 4, "eager")]  # fmt: skip
    assert json.loads((folder / "result.json").read_text())["ok"] is True
    assert model._switch.child is not None and not _alive(model._switch.child.pid)
    assert torch.isfinite(trainer.callback_metrics["train/loss_epoch"])


def _started_switch(tmp_path: Path, network: nn.Module) -> CompileSwitch:
    switch = CompileSwitch(tmp_path / "child", str(tmp_path / "cache"))
    assert switch.network_for(torch.randn(2, 8), network) is network  # the first training batch gives the form
    assert switch.launch(network) is not None
    return switch


class TestsOwnNetwork(nn.Module):  # the child cannot import this module's classes: tests/ is not on its path
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_a_background_compile_that_fails_leaves_the_run_eager_naming_the_error_and_its_log(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    network = TestsOwnNetwork()
    switch = _started_switch(tmp_path, network)
    switch.child.wait(timeout=120)
    assert switch.poll(network) is False and switch.compiled is None
    log = tmp_path / "child" / "compile.log"
    assert switch.failed == (
        f"the background compile failed (ModuleNotFoundError: No module named 'tests'; its log: {log})"
    )
    assert "Traceback" in log.read_text()
    assert switch.network_for(torch.randn(2, 8), network) is network and switch.poll(network) is False
    # The run says so once, at the next step.
    module = ImageClassifier("resnet18", num_classes=3)
    module._switch = switch
    with caplog.at_level("INFO"):
        module.on_train_batch_start(None, 0)
        module.on_train_batch_start(None, 1)
    assert [r.getMessage() for r in caplog.records] == [f"Compile: eager ({switch.failed})."]


def test_stop_ends_the_child_and_a_later_launch_starts_another(tmp_path: Path) -> None:
    network = nn.Linear(8, 3)
    switch = _started_switch(tmp_path, network)
    pid = switch.child.pid
    switch.stop()
    assert not _alive(pid)
    assert switch.waiting and switch.poll(network) is False
    assert switch.launch(network) is not None and switch.child.pid != pid
    switch.stop()


def test_the_child_ends_when_the_run_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves the run no time to stop its child: the kernel ends the child with it (Linux)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    script = (
        "import sys, time, torch\n"
        "from torch import nn\n"
        "from lit_imagenet.training.background_compile import CompileSwitch\n"
        f"switch = CompileSwitch({str(tmp_path / 'child')!r}, {str(tmp_path / 'cache')!r})\n"
        "network = nn.Linear(8, 3)\n"
        "switch.network_for(torch.randn(2, 8), network)\n"
        "switch.launch(network)\n"
        "print(switch.child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        child = int(run.stdout.readline())
        assert _alive(child)
        run.send_signal(signal.SIGKILL)
        run.wait(30)
        assert _wait_gone(child, 60), "the child outlived the run"
    finally:
        run.kill()


def test_too_little_device_memory_compiles_in_the_run_at_the_next_step(tmp_path: Path) -> None:
    switch = CompileSwitch(tmp_path / "child", str(tmp_path / "cache"))
    network = nn.Linear(8, 3)
    switch.network_for(torch.randn(2, 8), network)
    line = switch.launch(network, free_memory=3 * 2**30, needed_memory=5 * 2**30)
    assert line == (
        "Compile: default (too little free memory on cpu for a background compile: 3.0 GiB free, 5.0 GiB needed); "
        "the network compiles in this process at the next step."
    )
    assert switch.child is None and not switch.waiting
    assert switch.poll(network) is True
    assert switch.network_for(torch.randn(2, 8), network) is switch.compiled is not None
    assert switch.network_for(torch.randn(3, 8), network) is network  # another form


def _python(code: str) -> object:
    done = subprocess.run([sys.executable, "-c", "import json, torch\n" + code], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)  # fmt: skip
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("torch.set_float32_matmul_precision('high')", ["get_float32_matmul_precision"]),
        ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", ["backends.cuda.matmul.fp32_precision"]),
        ("torch.use_deterministic_algorithms(True)", ["are_deterministic_algorithms_enabled"]),
    ],
    ids=["first API", "newer API", "determinism"],
)
def test_the_child_sets_the_flags_of_the_run_that_differ_from_its_own(setting: str, expected: list[str]) -> None:
    """In a fresh process (the child's), the run's flags, whichever of torch's two APIs set them, come out the same
    by setting only what differs: a flag set to the value it had would change inductor's cache keys."""
    flags = _python(f"from lit_imagenet.training import background_compile as b\n{setting}\n"
                    "print(json.dumps(b.torch_flags()))")  # fmt: skip
    child = _python(f"from lit_imagenet.training import background_compile as b\nflags = {flags!r}\n"
                    "print(json.dumps([b.set_torch_flags(flags), b.torch_flags()]))")  # fmt: skip
    assert child == [expected, flags]
    assert background_compile.set_torch_flags(background_compile.torch_flags()) == []


def test_the_childs_network_has_the_runs_strides_dtypes_and_training_flags(tmp_path: Path) -> None:
    """What the child rebuilds from the spec, without the parameters' values."""
    network = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    network.to(memory_format=torch.channels_last)
    network[1].eval()
    network[3].weight.requires_grad_(False)
    images = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    child = BackgroundCompile(network, input_form(images), tmp_path, str(tmp_path / "cache"))
    child.stop()
    spec = torch.load(tmp_path / "network.pt", weights_only=False)
    copy = spec["network"]
    assert all(t.is_meta for t in [*copy.parameters(), *copy.buffers()])
    assert copy[0].weight.stride() == network[0].weight.stride() != nn.Conv2d(3, 4, 3).weight.stride()
    assert not copy[1].training and copy[0].training and not copy[3].weight.requires_grad
    assert spec["input"]["stride"] == list(images.stride()) and spec["input"]["autocast"] is False
    assert os.path.getsize(tmp_path / "network.pt") < 20_000  # no values


def test_a_run_resumed_at_an_epochs_short_last_batch_compiles_for_the_full_batches_after_it(tmp_path: Path) -> None:
    network = nn.Linear(8, 3)
    switch = CompileSwitch(tmp_path / "child", str(tmp_path / "cache"))
    switch.network_for(torch.randn(2, 8), network)  # the short last batch of the epoch the run resumed in
    switch.launch(network)
    first = switch.child.pid
    assert switch.network_for(torch.randn(5, 8), network) is network  # the next epoch's first, full batch
    assert not _alive(first) and switch.waiting and switch.form["shape"] == [5, 8]
    switch.launch(network)
    assert switch.child.form["shape"] == [5, 8]
    assert switch.network_for(torch.randn(2, 8), network) is network and switch.form["shape"] == [5, 8]
    switch.stop()
