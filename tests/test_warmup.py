"""The GPU's warm-up at launch: only where the run is sure to train on this process's GPU, never before a fork."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lit_imagenet.training import warmup

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("argv", "environ", "device"),
    [
        (["fit", "--config", "configs/resnet50.yaml"], {}, 0),
        (["fit", "--trainer.devices", "8", "--trainer.strategy", "ddp"], {"LOCAL_RANK": "3"}, 3),
        (["fit", "--trainer.devices=4"], {"SLURM_LOCALID": "2"}, 2),
        (["fit", "--trainer.devices", "4"], {"LOCAL_RANK": "1", "SLURM_LOCALID": "0"}, 1),
        (["validate", "--trainer.accelerator", "gpu", "--trainer.devices", "auto"], {}, 0),
        (["predict", "--trainer.accelerator=cuda", "--trainer.devices", "-1"], {}, 0),
        (["fit", "--trainer.strategy", "ddp_find_unused_parameters_true"], {}, 0),
        (["fit", "--trainer", '{"strategy": "ddp", "devices": 2}'], {}, 0),
        (["fit", "--config", "configs/ddp.yaml"], {}, 0),
        (["fit", "--trainer.accelerator", "cpu"], {}, None),
        (["fit", "--trainer.accelerator", "mps"], {}, None),
        (["fit", "--trainer", '{"accelerator": "cpu"}'], {}, None),
        (["fit", "--trainer.devices", "[1, 3]"], {}, None),
        (["fit", "--trainer.devices", "1,3"], {}, None),
        (["fit", "--trainer.devices", "0"], {}, None),
        (["fit", "--trainer.strategy", "ddp_spawn"], {}, None),
        (["fit", "--trainer.strategy", "ddp_fork"], {}, None),
        (["fit", "--trainer.strategy=ddp_notebook"], {}, None),
        (["fit", "--trainer.strategy", "ddp_spawn_find_unused_parameters_true"], {}, None),
        (["fit", "--trainer.strategy.start_method", "fork"], {}, None),
        (["fit", "--trainer.strategy", "DDPStrategy", "--trainer.strategy.start_method", "spawn"], {}, None),
        (["fit", "--trainer", '{"strategy": {"class_path": "DDPStrategy"}}'], {}, None),
        (["fit", "--help"], {}, None),
        (["fit", "--print_config"], {}, None),
        (["--version"], {}, None),
        (["fit"], {"LIT_IMAGENET_WARMUP": "0"}, None),
    ],
)
def test_the_warm_up_runs_only_on_the_gpu_the_run_is_sure_to_train_on(
    argv: list[str], environ: dict[str, str], device: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)
    assert warmup.warm_device(argv, environ) == device


def test_a_strategy_that_forks_in_a_config_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "fork.yaml"
    config.write_text("trainer:\n  strategy: ddp_fork\n  devices: 2\n")
    monkeypatch.chdir(REPO)
    assert warmup.warm_device(["fit", "--config", "configs/resnet50.yaml", "--config", str(config)], {}) is None
    assert warmup.warm_device(["fit", "--config", str(config), "--trainer.strategy", "ddp"], {}) == 0
    both = tmp_path / "all.yaml"
    both.write_text("fit:\n  trainer:\n    accelerator: cpu\n")
    assert warmup.warm_device(["--config", str(both), "fit"], {}) is None


def test_without_a_gpu_no_thread_starts_and_train_py_imports_torch_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch is in ``sys.modules`` when ``start`` returns, so the warm-up's thread never imports it beside the
    main thread's imports of Lightning."""
    code = textwrap.dedent(
        """
        import sys, threading
        from lit_imagenet.training import warmup
        assert "torch" not in sys.modules
        started = []
        threading.Thread.start = lambda self: started.append(("torch" in sys.modules, self.name))
        import torch
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 2
        thread = warmup.start(["fit", "--trainer.devices", "2"])
        print(started, thread is not None, warmup.start(["fit", "--trainer.accelerator", "cpu"]))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[(True,", "'cuda-warmup')]", "True", "None"]


@pytest.mark.gpu
@pytest.mark.parametrize(("argv", "initialised"), [(["fit"], True), (["fit", "--trainer.strategy", "ddp_fork"], False)])
def test_the_warm_up_initialises_cuda_unless_the_strategy_forks(argv: list[str], initialised: bool) -> None:
    code = textwrap.dedent(
        f"""
        import torch
        from lit_imagenet.training import warmup
        thread = warmup.start({argv!r})
        warmup.stop(thread)
        print(torch.cuda.is_initialized(), torch.cuda.memory_reserved(0) > 0)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(initialised), str(initialised)]
