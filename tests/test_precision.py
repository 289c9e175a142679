import csv
import functools
import importlib
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pytorch_lightning.plugins.precision import HalfPrecision, MixedPrecision

from lit_imagenet.errors import ConfigError
from lit_imagenet.training.precision import (
    ApexAMP,
    KeepBatchNormHalfPrecision,
    StaticScaleGradScaler,
    StaticScaleMixedPrecision,
    import_apex_amp,
    resolve_amp,
)
from tests.cli_args import SMALL_ARCH, error_lines, fit_args
from tests.runs import run_train

REPO = Path(__file__).resolve().parents[1]
FAKE_APEX = Path(__file__).resolve().parent / "fake_apex"


@pytest.fixture
def no_apex(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = importlib.import_module

    def fake_import(name: str, *args, **kwargs):
        if name == "apex" or name.startswith("apex."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fake_import)


@pytest.fixture
def fake_apex(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(FAKE_APEX))
    for name in ("apex", "apex.amp"):
        sys.modules.pop(name, None)
    amp = importlib.import_module("apex.amp")
    amp.calls.clear()
    yield amp
    for name in ("apex", "apex.amp"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "opt_level, native", [("O0", "32-true"), ("O1", "16-mixed"), ("O2", "16-mixed"), ("O3", "16-true")]
)
def test_opt_levels_map_to_native_without_apex(no_apex, opt_level: str, native: str) -> None:
    choice = resolve_amp(opt_level)
    assert choice.precision == native and choice.plugin is None
    assert f"native {native} for apex {opt_level}" in choice.message and "not installed" in choice.message


def test_static_loss_scale_and_keep_batchnorm_map_to_native_plugins(no_apex) -> None:
    choice = resolve_amp("O1", loss_scale=128.0, device_type="cpu")
    assert isinstance(choice.plugin, StaticScaleMixedPrecision) and "static loss scale 128" in choice.message
    choice = resolve_amp("O3", keep_batchnorm_fp32=True)
    assert isinstance(choice.plugin, KeepBatchNormHalfPrecision)
    for opt_level, native in (("O0", "32-true"), ("O3", "16-true")):  # no scaler there: the line says so
        message = resolve_amp(opt_level, loss_scale=128.0).message
        assert f"--amp.loss_scale 128.0 is unused: native {native} scales no loss" in message


def test_missing_apex_names_the_native_equivalent(no_apex) -> None:
    plugin = ApexAMP("O1")  # built, so that the command line can report it in its own words
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not installed.*O1/O2 -> 16-mixed, O3 -> 16-true"):
        plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    with pytest.raises(ImportError, match="not installed"):
        resolve_amp("O2", backend="apex")


def test_the_apex_plugin_without_apex_is_one_line_as_the_amp_flags(shapes_root: Path, tmp_path: Path) -> None:
    stub = tmp_path / "stub" / "apex"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError(\"No module named 'apex'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stub.parent), str(REPO)])}
    lines = {}
    for flags in (
        ["--trainer.plugins=lit_imagenet.training.precision.ApexAMP"],
        [
            "--trainer.plugins=lit_imagenet.training.precision.ApexAMP",
            "--config",
            str(REPO / "configs/demo.yaml"),
            "--data.root",
            str(shapes_root),
        ],  # fmt: skip
        ["--amp.opt_level=O1", "--amp.backend=apex"],
    ):
        done = run_train([*_fit_args(shapes_root, tmp_path), *flags], env=env)
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        lines[" ".join(flags)] = [line for line in error_lines(done.stderr) if line.startswith("error:")]
    first, in_a_config, flags = lines.values()  # demo.yaml sets --trainer.precision beside the plugin
    assert first == in_a_config == flags and len(first) == 1 and "NVIDIA apex is not installed" in first[0], lines


def test_apex_without_amp_says_it_was_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "apex"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("__version__ = '25.07'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("apex", "apex.amp"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=r"version 25.07.*has no apex.amp \(removed in release 25.07"):
        import_apex_amp()


@pytest.mark.parametrize("bad", ["O4", "o1", ""])
def test_unknown_opt_level_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="O0, O1, O2, O3"):
        resolve_amp(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1.0, "big"])
def test_bad_loss_scale_is_refused(no_apex, bad) -> None:
    with pytest.raises(ValueError, match="positive number or 'dynamic'"):
        resolve_amp("O1", loss_scale=bad)


def test_static_scaler_keeps_its_scale_and_skips_inf_steps() -> None:
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = StaticScaleGradScaler(128.0, device="cpu")
    for x, moved in ((torch.tensor([float("inf"), 0.0, 0.0]), False), (torch.ones(3), True)):
        opt.zero_grad()
        scaler.scale((param * x).sum()).backward()
        before = param.detach().clone()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 128.0
        assert torch.equal(param.detach(), before - 1.0) is moved  # inf step skipped; finite step unscaled


def test_keep_batchnorm_half_precision_leaves_batchnorm_in_float32() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    KeepBatchNormHalfPrecision().convert_module(model)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32


def test_apex_plugin_refuses_gradient_accumulation(fake_apex) -> None:
    class Trainer:
        accumulate_grad_batches = 4

    model = torch.nn.Linear(2, 2)
    model._trainer = Trainer()
    with pytest.raises(ValueError, match="Gradient accumulation is not supported with apex AMP"):
        ApexAMP("O1").initialize(model, [torch.optim.SGD(model.parameters(), lr=0.1)])


def test_apex_plugin_state_waits_for_initialize(fake_apex) -> None:
    plugin = ApexAMP("O2", keep_batchnorm_fp32=True, loss_scale="dynamic")
    assert plugin.state_dict() == {}
    plugin.load_state_dict({"loss_scaler0": {"loss_scale": 64.0, "unskipped": 7}})
    model = torch.nn.Linear(2, 2)
    plugin.initialize(model, [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert plugin.state_dict() == {"loss_scaler0": {"loss_scale": 64.0, "unskipped": 7}}
    assert fake_apex.calls[0][3] == {"opt_level": "O2", "verbosity": 0, "keep_batchnorm_fp32": True,
                                     "loss_scale": "dynamic"}  # fmt: skip


_fit_args = functools.partial(fit_args, batch_size=6)  # 24 images on 2 ranks: 2 steps an epoch


def _run(args: list[str], tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return run_train(args, cwd=tmp_path, env={**os.environ, **env})


def test_apex_under_ddp_initialises_before_wrapping_and_resumes_scaler_state(shapes_root: Path, tmp_path: Path) -> None:
    """Two CPU processes, the apex stand-in: amp.initialize sees the bare model, the scaler state round-trips."""
    env = {"PYTHONPATH": f"{FAKE_APEX}{os.pathsep}{REPO}", "FAKE_AMP_SCALE": "512.0"}
    first = tmp_path / "first"
    proc = _run(_fit_args(shapes_root, first, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                          "--trainer.max_epochs", "1", "--amp.opt_level", "O2", arch=SMALL_ARCH),
                tmp_path, env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "AMP: apex amp O2" in proc.stderr + proc.stdout
    last = next(first.rglob("last.ckpt"))
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["ApexAMP"]["loss_scaler0"]["loss_scale"] == 512.0
    assert ckpt["ApexAMP"]["loss_scaler0"]["unskipped"] == 2  # 24 images / 2 ranks / batch 6
    second = tmp_path / "second"
    env["FAKE_AMP_SCALE"] = "1.0"  # the resumed run must take the scale from the checkpoint
    proc = _run(_fit_args(shapes_root, second, "--trainer.devices", "2", "--trainer.strategy", "ddp",
                          "--trainer.max_epochs", "2", "--amp.opt_level", "O2", "--ckpt_path", str(last),
                          arch=SMALL_ARCH),
                tmp_path, env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(next(second.rglob("last.ckpt")), weights_only=True)
    assert ckpt["ApexAMP"]["loss_scaler0"] == {"loss_scale": 512.0, "unskipped": 4}
    assert ckpt["global_step"] == 4


def test_opt_level_takes_the_place_of_the_precision_flag(shapes_root: Path, tmp_path: Path, no_apex) -> None:
    from lit_imagenet.cli import main

    args = _fit_args(shapes_root, tmp_path)[1:]
    cli = main([*args, "--trainer.precision", "bf16-mixed", "--amp.opt_level", "O0"], run=False)
    assert type(cli.trainer.precision_plugin).__name__ == "Precision"  # 32-true


def test_unknown_opt_level_is_refused_by_the_cli(shapes_root: Path, tmp_path: Path) -> None:
    from lit_imagenet.cli import main

    with pytest.raises(SystemExit) as exc:
        main([*_fit_args(shapes_root, tmp_path)[1:], "--amp.opt_level", "O4"], run=False)
    assert exc.value.code == 2


def test_opt_level_falls_back_to_native_in_the_cli(shapes_root: Path, tmp_path: Path, no_apex, caplog) -> None:
    from lit_imagenet.cli import main

    args = _fit_args(shapes_root, tmp_path)[1:]  # no subcommand when only building the objects
    cli = main([*args, "--amp.opt_level", "O3", "--amp.keep_batchnorm_fp32", "true"], run=False)
    assert isinstance(cli.trainer.precision_plugin, KeepBatchNormHalfPrecision)
    assert isinstance(cli.trainer.precision_plugin, HalfPrecision)
    cli = main([*args, "--amp.opt_level", "O1", "--amp.loss_scale", "128"], run=False)
    assert isinstance(cli.trainer.precision_plugin, MixedPrecision)
    assert cli.trainer.precision_plugin.scaler.get_scale() == 128.0


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_cpu_capable_precisions_train(shapes_root: Path, tmp_path: Path, precision: str) -> None:
    from lit_imagenet.cli import main

    cli = main(_fit_args(shapes_root, tmp_path, "--trainer.precision", precision, "--trainer.max_steps", "3",
                         "--trainer.limit_val_batches", "1", arch=SMALL_ARCH))  # fmt: skip
    assert cli.trainer.global_step == 3
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss_step"])
    # The step figures reach the logs as float32 whatever the precision, and the epoch's loss is written.
    assert cli.trainer.callback_metrics["train/loss_step"].dtype == torch.float32
    rows = list(csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")))
    losses = [float(row["train/loss_epoch"]) for row in rows if row.get("train/loss_epoch")]
    assert len(losses) == 1 and math.isfinite(losses[0]) and losses[0] > 0


def test_bf16_on_a_gpu_without_it_is_refused_before_training(monkeypatch: pytest.MonkeyPatch) -> None:
    from lit_imagenet.cli import _check_bf16
    from lit_imagenet.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ConfigError, match="Tesla V100 cannot compute in bfloat16; use --trainer.precision 16-mixed"):
        _check_bf16({"accelerator": "gpu", "precision": "bf16-mixed"})
    _check_bf16({"accelerator": "cpu", "precision": "bf16-mixed"})  # the CPU path is not a CUDA question


def test_apex_gradient_clipping_uses_the_master_parameters(shapes_root: Path, tmp_path: Path, fake_apex) -> None:
    from lit_imagenet.cli import main

    seen = []
    real = fake_apex.master_params

    def master_params(optimizer):
        seen.append(optimizer)
        return real(optimizer)

    fake_apex.master_params = master_params
    try:
        cli = main(fit_args(shapes_root, tmp_path, "--amp.opt_level", "O1", "--trainer.max_steps", "2",
                            "--trainer.gradient_clip_val", "0.5", "--trainer.limit_val_batches", "0"))  # fmt: skip
    finally:
        fake_apex.master_params = real
    assert cli.trainer.global_step == 2
    assert len(seen) == 2  # clipped once per step, on apex's parameters
    assert [c[0] for c in fake_apex.calls].count("scale_loss") == 2


@pytest.mark.parametrize("strategy", ["ddp", "ddp_default_stream", "ddp_apex"])
def test_apex_under_several_processes_takes_the_apex_ddp_strategy(fake_apex, strategy: str) -> None:
    from lit_imagenet.cli import _amp_trainer_kwargs
    from lit_imagenet.training.precision import AMPFlags

    config = {"accelerator": "cpu", "devices": 2, "strategy": strategy}
    assert _amp_trainer_kwargs(AMPFlags(opt_level="O2", backend="apex"), config)["strategy"] == "ddp_apex"


def test_apex_refuses_a_strategy_it_cannot_initialise_under(fake_apex) -> None:
    from lit_imagenet.cli import _amp_trainer_kwargs
    from lit_imagenet.errors import ConfigError
    from lit_imagenet.training.precision import AMPFlags

    config = {"accelerator": "cpu", "devices": 2, "strategy": "fsdp"}
    with pytest.raises(ConfigError, match="ddp_apex, not 'fsdp'"):
        _amp_trainer_kwargs(AMPFlags(opt_level="O2", backend="apex"), config)


@pytest.mark.parametrize(
    ("devices", "nodes", "expected"),
    [("0,1", 1, 2), ("1,", 1, 1), ([0, 3], 1, 2), ("4", 1, 4), (2, 3, 6), ("-1", 1, 8), ("auto", 2, 16)],
)
def test_the_process_count_of_the_apex_choice_reads_devices_as_lightning_does(
    monkeypatch: pytest.MonkeyPatch, devices, nodes: int, expected: int
) -> None:
    """``--trainer.devices "0,1"`` lists two GPUs; it is not a count, nor every visible GPU (8 here)."""
    from lit_imagenet.cli import _process_count

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert _process_count({"devices": devices, "num_nodes": nodes}) == expected
