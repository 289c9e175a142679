import math
import os
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lit_imagenet import ImageClassifier, ImageFolderDataModule
from lit_imagenet.training.schedule import scaled_lr


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _trainer(tmp_path: Path, **kwargs) -> pl.Trainer:
    defaults = dict(
        default_root_dir=tmp_path,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def test_short_fit_lowers_the_loss(learnable_root: Path, tmp_path: Path) -> None:
    pl.seed_everything(0)
    dm = ImageFolderDataModule(
        str(learnable_root), batch_size=16, workers=0, crop_size=32, val_resize=36, crop_scale=(0.5, 1.0)
    )
    # 0.2 per 256 (0.0125 at batch 16), a tenth of it for the last 2 epochs: the losses of single epochs
    # at the full rate go up and down by half (seeds 0 to 3), those of the last epoch stay below 0.6.
    model = ImageClassifier(
        "resnet18", num_classes=dm.num_classes, lr=0.2, warmup_epochs=0, milestones=[4], class_names=dm.classes
    )
    record = _Record()
    trainer = _trainer(tmp_path, max_epochs=6, callbacks=[record], num_sanity_val_steps=0)
    trainer.fit(model, dm)
    per_epoch = len(record.losses) // 6
    first = sum(record.losses[:per_epoch]) / per_epoch
    last = sum(record.losses[-per_epoch:]) / per_epoch
    assert last < 0.75 * first, (first, last)
    assert trainer.callback_metrics["val/top1"] > 1 / 3 + 0.1


def test_fit_follows_the_schedule_with_accumulation(shapes_root: Path, tmp_path: Path) -> None:
    dm = ImageFolderDataModule(str(shapes_root), batch_size=5, workers=0, crop_size=32, val_resize=36)
    model = ImageClassifier("resnet18", num_classes=3, lr=0.1, warmup_epochs=2, milestones=[3])
    record = _Record()
    trainer = _trainer(tmp_path, max_epochs=4, accumulate_grad_batches=2, callbacks=[record], limit_val_batches=0)
    trainer.fit(model, dm)
    batches = math.ceil(24 / 5)  # 5 batches per epoch, 3 optimizer steps (the last one partial)
    steps = math.ceil(batches / 2)
    base = scaled_lr(0.1, 5 * 2)
    expected = []
    for epoch in range(4):
        for batch in range(batches):
            k = batch // 2 + 1
            factor = 0.1 if epoch >= 3 else 1.0
            if epoch < 2:
                factor *= (1 + k + epoch * steps) / (2 * steps)
            expected.append(base * factor)
    assert len(record.lrs) == len(expected)
    for got, want in zip(record.lrs, expected):
        assert math.isclose(got, want, rel_tol=1e-9)


def test_uint8_and_float_inputs_give_the_same_logits() -> None:
    torch.manual_seed(0)
    model = ImageClassifier("resnet18", num_classes=4).eval()
    images = torch.randint(0, 256, (2, 3, 32, 32), dtype=torch.uint8)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    floats = (images.float() / 255 - mean) / std
    with torch.no_grad():
        torch.testing.assert_close(model(images), model(floats), rtol=1e-4, atol=1e-4)


def test_compile_keeps_parameter_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile`` compiles the network in place: checkpoints keep the plain network's names."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    plain = ImageClassifier("resnet18", num_classes=3)
    compiled = ImageClassifier("resnet18", num_classes=3, compile=True)
    compiled.trainer = _trainer(tmp_path)
    compiled.setup("fit")
    assert compiled.model._compiled_call_impl is not None
    assert list(compiled.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(compiled.state_dict())


@pytest.mark.parametrize("given", ["unset", "default", "chosen", "an earlier run's"])
def test_compile_caches_go_under_the_run_root_unless_the_user_chose_a_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str
) -> None:
    """Importing torch's compiler writes inductor's default into TORCHINDUCTOR_CACHE_DIR: that is not a choice."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from lit_imagenet.training import module as module_file

    earlier = str(tmp_path / "earlier" / "compile_cache")
    monkeypatch.setattr(module_file, "_CACHES_SET", {earlier})
    values = {
        "unset": None,
        "default": default_cache_dir(),
        "chosen": str(tmp_path / "mine"),
        "an earlier run's": earlier,
    }
    if values[given] is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", values[given])
    module = ImageClassifier("resnet18", num_classes=3, compile=True)
    module.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    module.setup("fit")
    expected = str(tmp_path / "mine") if given == "chosen" else str(tmp_path / "compile_cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == expected


@pytest.mark.parametrize(("cores", "devices", "env", "workers"), [(16, 1, None, 4), (16, 8, None, 2), (2, 1, None, 2),
                                                                    (16, 1, "12", None)])  # fmt: skip
def test_compile_workers_are_four_a_process_or_a_share_of_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, devices: int, env: str | None, workers: int | None
) -> None:
    """Inductor's own default is a worker process per core (up to 32) for each training process; the user's
    TORCHINDUCTOR_COMPILE_THREADS is left to inductor."""
    from lit_imagenet.training import module as module_file

    monkeypatch.setattr(module_file, "usable_cores", lambda: cores)
    if env is None:
        monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", env)
    for mode in ("default", "cudagraphs"):  # as _compile_mode decides it, which on a CPU would be "default"
        module = ImageClassifier("resnet18", num_classes=3, compile=True)
        module.trainer = _trainer(tmp_path, devices=devices, strategy="ddp" if devices > 1 else "auto")
        monkeypatch.setattr(module, "_compile_mode", lambda mode=mode: (mode, None))
        seen: list[dict] = []
        monkeypatch.setattr(module.model, "compile", lambda seen=seen, **kwargs: seen.append(kwargs))
        module.setup("fit")
        (kwargs,) = seen
        assert kwargs["options"].get("compile_threads") == workers, kwargs
        # torch.compile's mode="reduce-overhead" is this option, which can go with the others
        assert kwargs["options"].get("triton.cudagraphs", False) == (mode == "cudagraphs"), kwargs
        assert kwargs["dynamic"] is False and "mode" not in kwargs


def test_sgd_is_fused_only_where_it_can_be() -> None:
    model = ImageClassifier("resnet18", num_classes=3)
    assert not model._fused()  # CPU parameters, no trainer
    model.hparams.fused_optimizer = True
    assert model._fused()


def test_fused_sgd_steps_like_plain_sgd_even_after_a_skipped_first_step() -> None:
    """A first step skipped for inf gradients must not leave fused SGD's momentum buffers uninitialised."""
    torch.manual_seed(0)
    models = [ImageClassifier("resnet18", num_classes=3, fused_optimizer=f, warmup_epochs=0) for f in (False, True)]
    models[1].load_state_dict(models[0].state_dict())
    grads = [[torch.randn_like(p) for p in models[0].parameters()] for _ in range(3)]
    for model in models:
        model.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
        optimizer = model.configure_optimizers()["optimizer"]
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
        scaler.scale(torch.ones(()))  # makes the scale tensor, as scaling a loss does
        for step_grads in [None, *grads]:
            for p, g in zip(model.parameters(), step_grads or grads[0]):
                p.grad = torch.full_like(p, float("inf")) if step_grads is None else g.clone()
            scaler.step(optimizer)  # the first step sees inf gradients and is skipped
            scaler.update()
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)


def test_compiled_network_keeps_static_graphs_after_a_short_batch(monkeypatch) -> None:
    """An epoch's short last batch must not turn the training graph into a dynamic-shape one."""
    import functools

    graphs: list[bool] = []

    def recording_backend(gm, example_inputs, **options):  # options: the compile workers
        graphs.append(any(not isinstance(x, torch.Tensor) for x in example_inputs))  # symbolic sizes come as ints
        return gm.forward

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=recording_backend))
    torch._dynamo.reset()
    module = ImageClassifier("resnet18", num_classes=3, channels_last=False, compile=True)
    module.setup("fit")
    try:
        for size in (4, 4, 2, 4):
            module.model(torch.randn(size, 3, 32, 32))
    finally:
        torch._dynamo.reset()
    assert graphs == [False, False]  # one graph per batch size, none of them for any size


def test_a_compile_mode_that_cannot_run_falls_back_saying_why(tmp_path: Path, monkeypatch, caplog) -> None:
    from types import SimpleNamespace

    from pytorch_lightning.strategies import DDPStrategy

    class OneGpuDDP(DDPStrategy):
        def __init__(self) -> None:  # only what _compile_mode reads
            pass

        @property
        def root_device(self) -> torch.device:
            return torch.device("cuda")

    def mode(compile_mode, device: str = "cuda", world: int = 1, accumulate: int = 1, plugin=None, ddp=False):
        module = ImageClassifier("resnet18", num_classes=3, compile=compile_mode)
        strategy = OneGpuDDP() if ddp else SimpleNamespace(root_device=torch.device(device))
        module._trainer = SimpleNamespace(precision_plugin=plugin, world_size=world, accumulate_grad_batches=accumulate,
                                          strategy=strategy)  # fmt: skip
        return module._compile_mode()

    assert mode("cudagraphs") == ("cudagraphs", None)
    assert mode(True) == mode("default") == ("default", None)
    assert mode("cudagraphs", device="cpu") == ("default", "CUDA graphs need a CUDA device")
    assert mode("cudagraphs", world=2) == ("default", "CUDA graphs are used on one process only; this run has 2")
    assert mode("cudagraphs", accumulate=2)[0] == "default"
    assert mode("auto") == mode("auto", ddp=True) == ("default", None)
    cpu = "--model.compile auto compiles on CUDA devices only; this run trains on cpu"
    assert mode("auto", device="cpu") == (None, cpu)
    from lit_imagenet.training.precision import ApexAMP

    assert mode("cudagraphs", plugin=ApexAMP.__new__(ApexAMP))[0] is None
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    module = ImageClassifier("resnet18", num_classes=3, compile="cudagraphs")
    module.trainer = _trainer(tmp_path)
    with caplog.at_level("INFO"):
        module.setup("fit")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compile:")] == [
        "Compile: default (CUDA graphs need a CUDA device)."
    ]
    assert module.model._compiled_call_impl is not None
    module = ImageClassifier("resnet18", num_classes=3, compile="auto")
    module.trainer = _trainer(tmp_path)
    caplog.clear()
    with caplog.at_level("INFO"):
        module.setup("fit")
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compile:")] == [
        "Compile: eager (--model.compile auto compiles on CUDA devices only; this run trains on cpu)."
    ]
    assert module.model._compiled_call_impl is None
    with pytest.raises(ValueError, match="compile must be false, true, auto, default or cudagraphs. Got"):
        ImageClassifier("resnet18", num_classes=3, compile="graphs")


@pytest.mark.parametrize("compile_mode", [True, "auto"])
def test_a_compiled_fit_logs_its_compile_time_once_and_an_eager_one_leaves_no_cache(
    shapes_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, compile_mode
) -> None:
    """On a CPU ``auto`` trains eager: no compiler cache folder is set or made. (Dynamo's ``eager`` backend stands
    in for inductor, whose compile would take minutes here.)"""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    torch._dynamo.reset()
    dm = ImageFolderDataModule(str(shapes_root), batch_size=8, workers=0, crop_size=32, val_resize=36)
    model = ImageClassifier("resnet18", num_classes=3, compile=compile_mode)
    try:
        with caplog.at_level("INFO"):
            _trainer(tmp_path, max_steps=3, limit_val_batches=0).fit(model, dm)
    finally:
        torch._dynamo.reset()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the network")]
    if compile_mode is True:
        (line,) = lines
        assert "ran its first step in " in line and f"(compiler caches: {tmp_path / 'compile_cache'})" in line
    else:
        assert lines == [] and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
        assert not (tmp_path / "compile_cache").exists()
