"""GPU behaviour: the same code as on CPU, checked where CUDA exists (skipped elsewhere)."""

import functools
import gc
import logging
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from lit_imagenet import ImageClassifier, ImageFolderDataModule
from lit_imagenet.data.prefetch import CUDAPrefetcher, PrefetchLoader
from lit_imagenet.data.presets import Uint8Normalize
from tests.runs import run_train, sigterm_once_written

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


def _batches(n: int, size: int = 512, pinned: bool = True) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    batches = [
        [torch.randint(0, 256, (size, 3, 224, 224), dtype=torch.uint8, generator=g),
         torch.randint(0, 10, (size,))]
        for _ in range(n)
    ]  # fmt: skip
    return [[t.pin_memory() for t in batch] for batch in batches] if pinned else batches


def _compute(x: torch.Tensor, weight: torch.Tensor, reps: int) -> torch.Tensor:
    """``reps`` products of the whole batch (as rows of ``weight``'s width) with ``weight``: a few large kernels, so
    that the GPU, not the launching thread, sets its time."""
    y = x.reshape(-1, weight.shape[0]).to(weight.dtype)
    for _ in range(reps):
        y = torch.tanh(y @ weight)
    return y


@pytest.mark.parametrize("pin", [False, True])
def test_prefetcher_output_equals_plain_normalisation(pin: bool) -> None:
    device = torch.device("cuda")
    batches = _batches(3, size=8, pinned=not pin)
    out = list(CUDAPrefetcher(iter(batches), device, Uint8Normalize(), pin=pin))
    assert len(out) == 3
    cpu_norm = Uint8Normalize()
    for (x, y), (gx, gy) in zip(batches, out):
        assert gx.is_cuda and gx.dtype == torch.float32
        torch.testing.assert_close(gx.cpu(), cpu_norm(x))
        assert torch.equal(gy.cpu(), y)


@pytest.mark.parametrize("pin", [False, True])
def test_prefetcher_overlaps_copies_with_compute(pin: bool) -> None:
    device = torch.device("cuda")
    batches = _batches(12, pinned=not pin)  # with pin, the prefetcher's thread pins them
    weight = torch.randn(8192, 8192, device=device, dtype=torch.float16) / 90  # 512*3*224*224 = 9,408 rows of 8,192
    norm = Uint8Normalize()

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def copies_only() -> None:
        for _ in CUDAPrefetcher(iter(batches), device, norm, pin=pin):
            pass

    x0 = torch.zeros(512, 3, 224, 224, device=device)

    def compute_only(reps: int) -> None:
        for _ in batches:
            _compute(x0, weight, reps)

    def both(reps: int) -> None:
        for x, _ in CUDAPrefetcher(iter(batches), device, norm, pin=pin):
            _compute(x, weight, reps)

    timed(copies_only)
    timed(functools.partial(compute_only, 1))  # warm-up: cuBLAS initialisation is not compute
    t_copy = min(timed(copies_only) for _ in range(3))
    reps = 1  # size the compute to about the copy time, where overlap matters most
    while timed(functools.partial(compute_only, reps)) < t_copy and reps < 4096:
        reps *= 2
    t_compute = min(timed(functools.partial(compute_only, reps)) for _ in range(3))
    t_both = min(timed(functools.partial(both, reps)) for _ in range(3))
    print(f"copy {t_copy * 1e3:.1f} ms, compute {t_compute * 1e3:.1f} ms, both {t_both * 1e3:.1f} ms")
    # Serial would be t_copy + t_compute; at least a quarter of the shorter one must be hidden.
    assert t_both < t_copy + t_compute - 0.25 * min(t_copy, t_compute)


class _FlatImages(torch.utils.data.Dataset):
    """uint8 pictures of one size, made in the loader's workers."""

    def __len__(self) -> int:
        return 20 * 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 224, 224), i % 256, dtype=torch.uint8), i % 10


def _most_pinned_bytes(loader: torch.utils.data.DataLoader) -> int:
    """The most page-locked bytes torch's host allocator held while ``loader`` ran ahead of slow steps."""
    # Garbage cycles of earlier tests (a DALI pipeline's, say) are freed here, where their threads live: a worker
    # forked with them would free them itself, and hang or crash.
    gc.collect()
    torch.cuda.synchronize()
    torch._C._host_emptyCache()  # blocks earlier tests left cached
    most, on_gpu = 0, []
    for images, _ in loader:
        time.sleep(0.05)  # a slow step: the workers run ahead
        most = max(most, torch.cuda.host_memory_stats()["allocated_bytes.current"])
        on_gpu.append(images.is_cuda)
    assert on_gpu == [isinstance(loader, PrefetchLoader)] * 20
    return most


def test_the_prefetcher_pins_only_the_batches_it_copies() -> None:
    block = 16 * 2**20  # a batch of 64 pictures, 9.6 MB, takes a 16 MiB block (powers of two)
    common = {"batch_size": 64, "num_workers": 4, "prefetch_factor": 2, "pin_memory": True}
    # DataLoader's pin thread pins each batch the workers hand over: up to the 8 they have ahead.
    by_loader = _most_pinned_bytes(torch.utils.data.DataLoader(_FlatImages(), **common))
    ahead = 2
    by_prefetcher = _most_pinned_bytes(
        PrefetchLoader(_FlatImages(), device=torch.device("cuda"), decode_ahead=ahead, **common)
    )
    mib = 2**20
    print(f"pinned at most: {by_loader / mib:.0f} MiB by DataLoader, {by_prefetcher / mib:.0f} MiB by the prefetcher")
    assert by_prefetcher <= (ahead + 2) * block + 2**20  # the queued batches, one being copied, one being pinned
    assert by_loader >= 6 * block


def test_channels_last_16_mixed_fit(learnable_root: Path, tmp_path: Path) -> None:
    pl.seed_everything(0)
    dm = ImageFolderDataModule(str(learnable_root), batch_size=16, workers=2, crop_size=32, val_resize=36)
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, lr=0.4, warmup_epochs=0, milestones=[6])
    seen = {}

    class Check(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            images = batch[0]
            seen["batch"] = (images.device.type, images.dtype, images.is_contiguous(memory_format=torch.channels_last))
            seen["weight"] = pl_module.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)

    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="gpu",
        devices=1,
        precision="16-mixed",
        max_epochs=8,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[Check()],
    )
    trainer.fit(model, dm)
    assert seen["batch"] == ("cuda", torch.float32, True)
    assert seen["weight"] is True
    assert torch.isfinite(trainer.callback_metrics["train/loss_epoch"])
    assert trainer.callback_metrics["val/top1"] > 1 / 3 + 0.1


def test_nvjpeg_batches_match_the_cpu_decoder(tmp_path: Path) -> None:
    from lit_imagenet.data.synthetic import make_shapes

    root = make_shapes(str(tmp_path / "jpeg"), train_per_class=6, val_per_class=4, width=160, height=120,
                       num_classes=3)  # fmt: skip
    for split in ("train", "val"):
        batches = {}
        for decoder in ("torchvision", "nvjpeg"):
            dm = ImageFolderDataModule(str(root), batch_size=12, workers=0, crop_size=64, val_resize=72,
                                       decoder=decoder, seed=5)  # fmt: skip
            dm.prefetch_device = torch.device("cuda")
            loader = dm.train_dataloader() if split == "train" else dm.val_dataloader()
            batches[decoder] = next(iter(loader))
        cpu, gpu = batches["torchvision"], batches["nvjpeg"]
        assert gpu[0].is_cuda and gpu[0].dtype == torch.float32
        assert gpu[0].is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(cpu[1].cpu(), gpu[1].cpu())
        # Same crops and flips; nvJPEG's IDCT and chroma upsampling differ from libjpeg-turbo's by about
        # a level on average. Validation also crops and resizes in one step instead of two.
        diff = (cpu[0].float() - gpu[0].float()).abs() * 0.226 * 255  # back to pixel levels
        print(f"{split}: mean {diff.mean():.3f}, max {diff.max():.1f} levels")
        assert diff.mean() < (1.5 if split == "train" else 3.5)


def test_compiled_fit_saves_plain_parameter_names(tmp_path: Path) -> None:
    from benchmarks.fit_synthetic import SyntheticDataModule

    dm = SyntheticDataModule(batch_size=8, crop_size=64, num_classes=4, train_steps=3, val_steps=1)
    model = ImageClassifier("resnet18", num_classes=4, compile=True, warmup_epochs=0)
    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="gpu", devices=1, precision="16-mixed", max_epochs=1,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False)  # fmt: skip
    trainer.fit(model, dm)
    assert model.model._compiled_call_impl is not None
    path = tmp_path / "compiled.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    assert not [k for k in state if "_orig_mod" in k]
    plain = ImageClassifier.load_from_checkpoint(path, map_location="cpu", compile=False)
    torch.testing.assert_close(plain.model.conv1.weight, model.model.conv1.weight.detach().cpu())


def test_no_host_device_sync_during_an_epoch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No training batch, log steps included, waits for all the GPU's queued work: not fused SGD, the gradient scaler,
    the metrics, the step figures (which wait on an event for the batch's forward pass only), the console line, the
    learning-rate log, the guard or the loggers."""
    import warnings

    from pytorch_lightning.loggers import CSVLogger

    from benchmarks.fit_synthetic import SyntheticDataModule
    from lit_imagenet.callbacks.console import ConsoleLog, LearningRateLog, Throughput
    from lit_imagenet.callbacks.guard import NonFiniteGuard

    every, steps = 5, 12
    syncs: dict[int, int] = {}

    class Watch(pl.Callback):
        """Counts the synchronising calls from one batch's start to the next one's (or the epoch's end)."""

        def __init__(self) -> None:
            self._batch: int | None = None

        def _close(self) -> None:
            if self._batch is not None:
                torch.cuda.set_sync_debug_mode(0)
                self._catch.__exit__(None, None, None)
                syncs[self._batch] = sum("synchroniz" in str(w.message) for w in self._seen)
                self._batch = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self._close()
            self._batch = batch_idx
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

        def on_train_epoch_end(self, trainer, pl_module):
            self._close()

    dm = SyntheticDataModule(batch_size=8, crop_size=64, num_classes=4, train_steps=steps, val_steps=0)
    model = ImageClassifier("resnet18", num_classes=4, warmup_epochs=1)
    watch = Watch()
    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="gpu", devices=1, precision="16-mixed", max_epochs=1,
                         log_every_n_steps=every, logger=CSVLogger(tmp_path), enable_progress_bar=False,
                         enable_checkpointing=False, callbacks=[watch, ConsoleLog(), NonFiniteGuard(), Throughput(),
                                                                LearningRateLog()])  # fmt: skip
    try:
        with caplog.at_level(logging.INFO):
            trainer.fit(model, dm)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print("synchronisations per batch:", syncs)
    # The epoch's line, with its pace from batch 11 timed by CUDA events (recorded inside the checked window).
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Epoch 0:"))
    found = re.search(r": ([\d,]+) images/s over .*; ([\d,]+) images/s from batch 11 to the last", line)
    assert found, line
    whole, steady = found.groups()
    assert float(steady.replace(",", "")) > float(whole.replace(",", "")) / 2 > 0, line
    # Batch 0 starts the run (cuDNN autotuning, first allocations); the epoch's end waits, in the last batch's window.
    checked = {i: n for i, n in syncs.items() if 0 < i < steps - 1}
    assert len(checked) == steps - 2 and not any(checked.values()), checked
    rows = list(__import__("csv").DictReader(open(Path(trainer.log_dir) / "metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    assert {"train/loss_step", "train/top1_step", "train/images_per_sec", "lr-SGD/pg1"} <= logged, logged


class _Losses(pl.Callback):
    """Each training step's loss, and the gradient scaler's scale after it."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(float(scaler.get_scale()) if scaler is not None else 1.0)


def _graph_fit(
    root: Path, out: Path, compile_mode, steps: int, precision: str = "16-mixed", callbacks=(), **trainer_kwargs
) -> tuple[ImageClassifier, _Losses]:
    from pytorch_lightning.plugins.precision import MixedPrecision

    pl.seed_everything(0)
    # No loader workers and deterministic kernels: two runs differ by their kernels' arithmetic alone, and at a small
    # rate that keeps the trajectories together (at 0.2 per 256 on these 144 images two eager runs part within steps).
    dm = ImageFolderDataModule(str(root), batch_size=16, workers=0, crop_size=64, val_resize=72, seed=0)
    model = ImageClassifier("resnet18", num_classes=dm.num_classes, lr=0.05, warmup_epochs=0, compile=compile_mode)
    losses = _Losses()
    if precision == "16-mixed":
        # A first scale of 2**30: the first steps overflow float16, and the scaler skips them and halves the scale.
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**30)
        trainer_kwargs["plugins"] = [MixedPrecision("16-mixed", "cuda", scaler=scaler)]
    else:
        trainer_kwargs["precision"] = precision
    trainer = pl.Trainer(default_root_dir=out, accelerator="gpu", devices=1, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, callbacks=[losses, *callbacks],
                         num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
                         **trainer_kwargs)  # fmt: skip
    trainer.fit(model, dm)
    return model, losses


def _graph_skips() -> int:
    """How many compiled graphs inductor has run without CUDA graphs in this process (each says why in a warning)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def test_cuda_graph_fit_replays_the_compiled_steps_exactly_overflows_included(
    learnable_root: Path, tmp_path: Path, caplog, monkeypatch
) -> None:
    """50 steps replayed as CUDA graphs give the compiled network's losses bit for bit, overflowing steps skipped
    alike; against eager steps: the same skipped steps and scales, the same losses while the weights are the first
    ones, and a curve that learns as eager's does after (inductor's kernels round otherwise, so the trajectories
    part); the run says it compiled and how long that took."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile_cache"))
    with caplog.at_level("INFO"):
        graphed, graph_losses = _graph_fit(learnable_root, tmp_path / "graphs", "cudagraphs", 50)
    assert not [r for r in caplog.records if r.getMessage().startswith("Compile:")]  # no fallback
    assert any(r.getMessage().startswith("Compiled the network and ran its first step in") for r in caplog.records)
    _, compiled_losses = _graph_fit(learnable_root, tmp_path / "compiled", "default", 50)
    assert graph_losses.scales == compiled_losses.scales and graph_losses.losses == compiled_losses.losses
    _, eager_losses = _graph_fit(learnable_root, tmp_path / "eager", False, 50)
    assert graph_losses.scales == eager_losses.scales and graph_losses.scales[0] < 2.0**30  # the same skipped steps
    a, b = torch.tensor(graph_losses.losses), torch.tensor(eager_losses.losses)
    skipped = next(k for k, s in enumerate(eager_losses.scales) if s == eager_losses.scales[k + 1]) + 1
    assert skipped > 5 and torch.allclose(a[:skipped], b[:skipped], rtol=2e-3), (a, b)  # the same weights so far
    assert torch.isfinite(a).all() and a[-10:].mean() < 0.6 * a[0] and b[-10:].mean() < 0.6 * b[0], (a, b)
    assert abs(a[-10:].mean() - b[-10:].mean()) < 0.15 * b[-10:].mean(), (a, b)
    assert all(torch.isfinite(p).all() for p in graphed.model.parameters())


def test_auto_on_one_gpu_compiles_from_the_first_step_into_the_runs_caches_and_a_restart_reads_them(
    learnable_root: Path, tmp_path: Path, caplog, monkeypatch
) -> None:
    """The recipe's ``auto`` on CUDA: compiled from its first step, with the losses of ``true``, its compile time said
    once, and its graphs cached under the run's root, where a second run in that root finds them."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    seconds = []
    for _ in range(2):
        torch.compiler.reset()  # graphs compiled by earlier runs would be reused without the caches
        caplog.clear()
        with caplog.at_level("INFO"):
            _, auto = _graph_fit(learnable_root, tmp_path / "auto", "auto", 12)
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiled the network")]
        assert str(tmp_path / "auto" / "compile_cache") in line, line
        seconds.append(float(line.split(" in ")[1].split(" s")[0]))
    assert any((tmp_path / "auto" / "compile_cache").rglob("*")), "the run's root holds no compiler cache"
    assert seconds[1] < seconds[0], seconds  # the restart read the graphs the first run cached
    torch.compiler.reset()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    _, compiled = _graph_fit(learnable_root, tmp_path / "compiled", True, 12)
    assert auto.scales == compiled.scales and auto.losses == compiled.losses, (auto.losses, compiled.losses)


def test_a_cuda_graph_run_resumes_mid_epoch(learnable_root: Path, tmp_path: Path, monkeypatch) -> None:
    from lit_imagenet.cli import main

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile_cache"))  # compiled once for the 3 runs
    from tests.cli_args import fit_args

    def args(out: Path, *extra: str) -> list[str]:
        return fit_args(learnable_root, out, "--trainer.accelerator", "gpu", "--trainer.precision", "16-mixed",
                        "--model.compile", "cudagraphs", "--trainer.max_epochs", "2", "--trainer.deterministic",
                        "true", "--seed_everything", "3", "--step_checkpoint.every_n_train_steps", "4",
                        "--trainer.limit_val_batches", "2", "--curves.enabled", "false", *extra,
                        batch_size=16)  # fmt: skip

    main(args(tmp_path / "whole"))
    main(args(tmp_path / "cut", "--trainer.max_steps", "12"))  # 9 steps an epoch: stopped in epoch 1
    (ckpt,) = (tmp_path / "cut").rglob("last-step.ckpt")
    main(args(tmp_path / "cut", "--ckpt_path", str(ckpt)))
    from tests.runs import final_checkpoint, network

    whole, resumed = network(final_checkpoint(tmp_path / "whole")), network(final_checkpoint(tmp_path / "cut"))
    for name in whole:
        torch.testing.assert_close(resumed[name].float(), whole[name].float(), rtol=2e-3, atol=2e-4, msg=name)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_cuda_graphs_train_in_bfloat16_and_float32_as_the_compiled_network_does(
    learnable_root: Path, tmp_path: Path, caplog, monkeypatch, precision: str
) -> None:
    """Replayed as CUDA graphs (none skipped), 30 steps learn as the compiled network without graphs does: in float32
    with its losses, in bfloat16 (whose kernels round apart from the first step on) to a like loss; at the first
    step, before any update, eager gives the same loss."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile_cache"))
    skips = _graph_skips()
    with caplog.at_level("WARNING"):
        _, graphs = _graph_fit(learnable_root, tmp_path / "graphs", "cudagraphs", 30, precision=precision)
    reasons = [r.getMessage() for r in caplog.records if "cudagraph" in r.getMessage()]
    assert _graph_skips() == skips, reasons
    _, compiled = _graph_fit(learnable_root, tmp_path / "compiled", "default", 30, precision=precision)
    _, eager = _graph_fit(learnable_root, tmp_path / "eager", False, 2, precision=precision)
    a, b = torch.tensor(graphs.losses), torch.tensor(compiled.losses)
    print(f"{precision}: graphs {a.tolist()}, compiled {b.tolist()}, eager {eager.losses}")
    if precision == "32-true":
        assert torch.allclose(a, b, rtol=1e-3), (a, b)
    else:
        assert abs(a[0] - b[0]) < 2e-2 * b[0] and abs(a[-10:].mean() - b[-10:].mean()) < 0.25 * b[-10:].mean(), (a, b)
    assert abs(a[0] - eager.losses[0]) < (2e-2 if precision == "bf16-mixed" else 2e-3) * eager.losses[0], (a, eager)
    assert torch.isfinite(a).all() and a[-5:].mean() < 0.7 * a[:5].mean(), a


def test_a_nan_inside_a_cuda_graph_stops_the_run_naming_the_step(learnable_root: Path, tmp_path: Path) -> None:
    """A weight gone NaN makes the graphed step's loss NaN: the guard counts it from the graph's output before the
    next replay overwrites it, and stops the run naming the step where the bad run began."""
    from lit_imagenet.callbacks.guard import NonFiniteGuard, NonFiniteLossError

    class PoisonAt(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if trainer.global_step == 5:
                with torch.no_grad():
                    pl_module.model.fc.weight.fill_(float("nan"))  # in place: the graphs read this memory

    guard = NonFiniteGuard(max_consecutive=3, check_every_n_steps=1)
    with pytest.raises(NonFiniteLossError, match="3 consecutive batches from global step 5"):
        _graph_fit(learnable_root, tmp_path, "cudagraphs", 40, precision="bf16-mixed", callbacks=[guard, PoisonAt()])


def _pythonpath() -> str:
    """This checkout first, then what the environment's ``PYTHONPATH`` named (packages installed beside)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def _train(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})}
    done = run_train(args, timeout=420, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_the_ddp_strategy_on_one_gpu_replays_cuda_graphs_and_compiles_as_one_process_does(
    learnable_root: Path, tmp_path: Path, monkeypatch
) -> None:
    """``configs/ddp.yaml`` with ``--trainer.devices 1``: with ``cudagraphs`` no fallback and no graph skipped, and with
    the recipe's ``auto`` the compiled network; both learn as a run without DDP does. (Under DDP, torch.compile splits
    the network's graph where DDP's gradient buckets end, so the kernels, and their rounding, differ from a single
    process's: the losses agree at the first step and part after.)"""
    import csv

    from tests.cli_args import fit_args

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile_cache"))  # compiled once for the 3 runs

    def args(out: Path, mode: str, *ddp: str) -> list[str]:
        (command, *rest) = fit_args(learnable_root, out, "--trainer.accelerator", "gpu", "--trainer.devices", "1",
                                    "--trainer.precision", "16-mixed", "--model.compile", mode, "--trainer.max_steps",
                                    "27", "--trainer.deterministic", "true", "--seed_everything", "3",
                                    "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "0",
                                    "--curves.enabled", "false", batch_size=16)  # fmt: skip
        return [command, *ddp, *rest]

    def losses(out: Path) -> torch.Tensor:
        (metrics,) = out.rglob("metrics.csv")
        rows = csv.DictReader(open(metrics))
        return torch.tensor([float(r["train/loss_step"]) for r in rows if r["train/loss_step"]])

    single = _train(args(tmp_path / "single", "cudagraphs"), tmp_path)
    graphed = _train(args(tmp_path / "ddp", "cudagraphs", "--config", str(REPO / "configs/ddp.yaml")), tmp_path)
    auto = _train(args(tmp_path / "auto", "auto", "--config", str(REPO / "configs/ddp.yaml")), tmp_path)
    for done in (single, graphed, auto):
        assert "Compiled the network and ran its first step in" in done.stdout + done.stderr
        assert "skipping cudagraphs" not in done.stdout + done.stderr
    for done in (graphed, auto):
        assert "Compile:" not in done.stdout + done.stderr  # no fallback: auto compiles under DDP too
    assert "Starting with 1 processes" in graphed.stdout + graphed.stderr  # DDP's process group, of one
    alone = losses(tmp_path / "single")
    assert len(alone) == 27 and torch.isfinite(alone).all() and alone[-5:].mean() < 0.8 * alone[:5].mean(), alone
    for run in ("ddp", "auto"):
        other = losses(tmp_path / run)
        print(f"{run}: {other.tolist()}; without DDP: {alone.tolist()}")
        assert len(other) == 27 and torch.isfinite(other).all(), other
        assert abs(other[0] - alone[0]) < 5e-3 * alone[0], (run, other, alone)  # the same weights, the same batch
        assert abs(other[-10:].mean() - alone[-10:].mean()) < 0.25 * alone[-10:].mean(), (run, other, alone)


def test_sigterm_stops_a_cuda_graph_run_with_its_console_lines_and_it_resumes(
    learnable_root: Path, tmp_path: Path
) -> None:

    from tests.cli_args import fit_args

    env = {**os.environ, "PYTHONPATH": _pythonpath(), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "compile_cache")}
    common = ("--trainer.accelerator", "gpu", "--trainer.precision", "16-mixed", "--model.compile", "cudagraphs",
              "--trainer.log_every_n_steps", "2", "--trainer.limit_val_batches", "2",
              "--curves.enabled", "false")  # fmt: skip
    args = fit_args(learnable_root, tmp_path, *common, "--trainer.max_epochs", "1000", batch_size=16)
    checkpoints = tmp_path / "checkpoints"
    # epoch 0 ended: compiled, graphs recorded and replayed
    out = sigterm_once_written(args, checkpoints / "last.ckpt", 300, settle=1.0, env=env, cwd=tmp_path)
    steps = [line for line in out.splitlines() if line.startswith("Epoch 0 [") and " step " in line]
    assert len(steps) >= 4 and "loss" in steps[-1], out[-3000:]
    saved = torch.load(checkpoints / "last-step.ckpt", weights_only=True)["global_step"]
    assert saved >= 9
    resumed = _train(fit_args(learnable_root, tmp_path, *common, "--trainer.max_steps", str(saved + 3),
                              "--step_checkpoint.every_n_train_steps", "1", "--ckpt_path", "last", batch_size=16),
                     tmp_path, env=env)  # fmt: skip
    assert f"Resuming from {checkpoints / 'last-step.ckpt'}" in resumed.stdout
    last = tmp_path / "checkpoints" / "last-step.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == saved + 3


@pytest.mark.parametrize("decoder", ["pil", "nvjpeg", pytest.param("dali", marks=pytest.mark.dali)])
def test_the_tv2_recipe_trains_on_cuda_with_each_decoder(learnable_root: Path, tmp_path: Path, decoder: str) -> None:
    """``configs/resnet50_tv2.yaml``'s options on a GPU, at 16-mixed and channels_last: the policy and erasing where
    the decoder runs them (DALI's pipeline, nvJPEG's GPU tensors, the workers), MixUp/CutMix on the device batch,
    repeated augmentation, the EMA; every loss is finite and each validation reports both sets of weights."""
    import csv

    from tests.cli_args import small_args

    args = ["fit", "--config", str(REPO / "configs" / "resnet50_tv2.yaml"), *small_args(
        learnable_root, "--trainer.accelerator", "gpu", "--trainer.devices", "1", "--trainer.precision", "16-mixed",
        "--trainer.default_root_dir", str(tmp_path), "--data.decoder", decoder, "--data.train_crop_size", "28",
        "--trainer.max_epochs", "6", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
        "--trainer.log_every_n_steps", "1", "--model.compile", "false", "--model.ema_steps", "2",
        "--model.ema_warmup_epochs", "1", batch_size=16, workers=2)]  # fmt: skip
    done = _train(args, tmp_path)
    assert "EMA top-1" in done.stdout
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    losses = [float(r["train/loss_step"]) for r in rows if r.get("train/loss_step")]
    assert len(losses) == 18 and all(map(lambda x: x == x and abs(x) < 1e4, losses)), losses
    validations = [r for r in rows if r.get("val_ema/top1")]
    assert len(validations) == 6 and all(r.get("val/top1") for r in validations)
