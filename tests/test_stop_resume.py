"""A run stopped part-way through an epoch (``max_steps``, ``max_time``, an early stop) and continued with
``--ckpt_path last`` trains the rest of that epoch, then the next: every sample once an epoch over the two runs,
on the same or another number of processes."""

import json
from pathlib import Path

import pytest

from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.samplers import epoch_order
from tests.cli_args import SMALL_ARCH, fit_args
from tests.runs import run_env, run_train
from tests.test_resume import _one_image_per_class

SAMPLES, BATCH, SEED = 48, 4, 5


def _run(root: Path, out: Path, part: str, processes: int, *extra: str, callbacks: str = "") -> str:
    """``train.py fit`` into ``out`` recording each training batch under ``out/part``; returns the console."""
    config = out / f"{part}.yaml"
    out.mkdir(parents=True, exist_ok=True)
    config.write_text("trainer:\n  callbacks:\n    - class_path: tests.run_callbacks.RecordBatches\n"
                      f"      init_args: {{folder: {out / part}}}\n{callbacks}")  # fmt: skip
    args = fit_args(root, out, "--trainer.devices", str(processes), "--seed_everything", str(SEED),
                    "--trainer.limit_val_batches", "1", "--curves.enabled", "false", "--config", str(config), *extra,
                    batch_size=BATCH, arch=SMALL_ARCH)  # fmt: skip
    proc = run_train(args, cwd=out, env=run_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _batches(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("*.jsonl")) for line in f.read_text().splitlines()]


def _slow(seconds: float) -> str:
    return f"    - class_path: tests.run_callbacks.SlowSteps\n      init_args: {{seconds: {seconds}}}\n"


STOPS = {
    "max_steps": (("--trainer.max_steps", "4"), ""),
    "max_time": (("--trainer.max_time", "00:00:00:03"), _slow(0.4)),  # about 7 of epoch 0's 12 steps
    "should_stop": ((), "    - class_path: tests.run_callbacks.StopAfterStep\n      init_args: {step: 5}\n"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("stop", "before", "after"),
    [("max_steps", 1, 1), ("max_time", 1, 1), ("should_stop", 1, 1), ("max_steps", 2, 1), ("max_time", 1, 2)],
)
def test_a_run_stopped_mid_epoch_then_continued_trains_each_sample_of_the_epoch_once(
    tmp_path: Path, stop: str, before: int, after: int
) -> None:
    root = _one_image_per_class(tmp_path / "data", SAMPLES)  # a sample's label is its index
    out = tmp_path / "run"
    flags, callbacks = STOPS[stop]
    console = _run(root, out, "first", before, *flags, callbacks=callbacks)
    assert "could not find the monitored key" not in console  # Lightning's warning for a cut before any validation
    first = _batches(out / "first")
    assert {b["epoch"] for b in first} == {0} and 0 < len(first) < SAMPLES // BATCH, first  # cut inside epoch 0

    console = _run(root, out, "second", after, "--trainer.max_epochs", "2", "--ckpt_path", "last")
    assert "Resuming from" in console
    second = _batches(out / "second")
    assert min(b["epoch"] for b in second) == 0  # the rest of the cut epoch first
    for epoch in (0, 1):
        trained = sorted(label for b in first + second if b["epoch"] == epoch for label in b["labels"])
        assert trained == list(range(SAMPLES)), (epoch, trained)  # every sample once
    labels = ImageFolderDataModule(str(root), index=False).samples("train").labels
    for rank in range(after):  # epoch 1 in the seed's order for this run's processes
        rows = (out / "second" / f"batches-rank{rank}.jsonl").read_text().splitlines()
        got = [label for b in map(json.loads, rows) if b["epoch"] == 1 for label in b["labels"]]
        assert got == labels[epoch_order(SAMPLES, SEED, 1, after, rank)].tolist()
