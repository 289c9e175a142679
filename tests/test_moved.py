"""Runs made with the package's first, flat layout still load: their configs' class paths and their checkpoints.

``fixtures/flat_layout_run`` holds the ``config.yaml`` and a mid-epoch ``last-step.ckpt`` (step 2 of 3,
ShuffleNet on 3 classes of generated 40x40 shapes) that ``train.py fit`` wrote when every module sat
directly in ``lit_imagenet/``.
"""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import lit_imagenet
from lit_imagenet.cli import main
from lit_imagenet.data.synthetic import make_shapes
from lit_imagenet.training.module import ImageClassifier
from tests.runs import global_step

OLD_RUN = Path(__file__).parent / "fixtures" / "flat_layout_run"

# Class paths that configs, scripts and checkpoints of the flat layout name, and where they live now.
OLD_PATHS = {
    "lit_imagenet.monitoring.RunLogger": "lit_imagenet.callbacks.logs.RunLogger",
    "lit_imagenet.monitoring.ConsoleLog": "lit_imagenet.callbacks.console.ConsoleLog",
    "lit_imagenet.monitoring.Throughput": "lit_imagenet.callbacks.console.Throughput",
    "lit_imagenet.monitoring.LearningRateLog": "lit_imagenet.callbacks.console.LearningRateLog",
    "lit_imagenet.monitoring.TrainingCurves": "lit_imagenet.callbacks.logs.TrainingCurves",
    "lit_imagenet.monitoring.Profile": "lit_imagenet.callbacks.profiling.Profile",
    "lit_imagenet.checkpointing.StepCheckpoint": "lit_imagenet.callbacks.checkpoints.StepCheckpoint",
    "lit_imagenet.checkpointing.AtomicCheckpointIO": "lit_imagenet.callbacks.checkpoints.AtomicCheckpointIO",
    "lit_imagenet.checkpointing.SigtermConsensus": "lit_imagenet.callbacks.preemption.SigtermConsensus",
    "lit_imagenet.guard.NonFiniteGuard": "lit_imagenet.callbacks.guard.NonFiniteGuard",
    "lit_imagenet.callbacks.PredictionWriter": "lit_imagenet.callbacks.predictions.PredictionWriter",
    "lit_imagenet.precision.ApexAMP": "lit_imagenet.training.precision.ApexAMP",
    "lit_imagenet.precision.StaticScaleMixedPrecision": "lit_imagenet.training.precision.StaticScaleMixedPrecision",
    "lit_imagenet.precision.ApexDDPStrategy": "lit_imagenet.training.strategies.ApexDDPStrategy",
    "lit_imagenet.ddp.DefaultStreamDDPStrategy": "lit_imagenet.training.strategies.DefaultStreamDDPStrategy",
    "lit_imagenet.prefetch.CUDAPrefetch": "lit_imagenet.data.prefetch.CUDAPrefetch",
    "lit_imagenet.datamodule.ImageFolderDataModule": "lit_imagenet.data.datamodule.ImageFolderDataModule",
    "lit_imagenet.module.ImageClassifier": "lit_imagenet.training.module.ImageClassifier",
    "lit_imagenet.synthetic.SyntheticDataModule": "lit_imagenet.data.synthetic.SyntheticDataModule",
    "lit_imagenet.synthetic.make_shapes": "lit_imagenet.data.synthetic.make_shapes",
    "lit_imagenet.samplers.EpochSeededSampler": "lit_imagenet.data.samplers.EpochSeededSampler",
    "lit_imagenet.dali.DALILoader": "lit_imagenet.data.dali.loader.DALILoader",
    "lit_imagenet.schedule.WarmupMultiStep": "lit_imagenet.training.schedule.WarmupMultiStep",
    "lit_imagenet.collate_uint8": "lit_imagenet.data.datasets.collate_uint8",
    "lit_imagenet.scaled_lr": "lit_imagenet.training.schedule.scaled_lr",
}


def _resolve(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_import_path_gives_the_object_of_the_new_one(old: str) -> None:
    assert _resolve(old) is _resolve(OLD_PATHS[old])


def test_the_old_module_names_are_modules_of_the_package() -> None:
    import lit_imagenet.monitoring as monitoring

    assert lit_imagenet.monitoring is monitoring
    with pytest.raises(AttributeError, match="lit_imagenet.monitoring.*NoSuchThing"):
        monitoring.NoSuchThing  # noqa: B018


def test_an_old_module_path_leaves_the_new_module_its_own_name() -> None:
    old = importlib.import_module("lit_imagenet.schedule")
    new = importlib.import_module("lit_imagenet.training.schedule")

    assert old is new and new.__spec__.name == new.__name__ == "lit_imagenet.training.schedule"


def test_the_package_imports_no_moved_module_until_one_is_named(tmp_path: Path) -> None:
    code = (
        "import sys, lit_imagenet; "
        "early = {'lit_imagenet.data.synthetic', 'lit_imagenet.monitoring'} & set(sys.modules); "
        "assert not early, early; "
        "import lit_imagenet.synthetic; assert 'lit_imagenet.data.synthetic' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    # So the shapes generator runs as a module with no warning that it was imported twice.
    run = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "lit_imagenet.data.synthetic", str(tmp_path / "s"),
         "--train_per_class", "1", "--val_per_class", "1", "--width", "8", "--height", "8", "--num_classes", "2"],
        capture_output=True, text=True, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert run.returncode == 0 and "RuntimeWarning" not in run.stderr, run.stderr
    assert len(list((tmp_path / "s").rglob("*.jpg"))) == 4


def test_a_run_of_the_flat_layout_resumes_from_its_config_and_checkpoint(tmp_path: Path) -> None:
    config = yaml.safe_load((OLD_RUN / "config.yaml").read_text())
    assert config["trainer"]["logger"]["class_path"] == "lit_imagenet.monitoring.RunLogger"
    data = make_shapes(str(tmp_path / "data"), train_per_class=8, val_per_class=4, width=40, height=40, num_classes=3)
    ckpt = OLD_RUN / "last-step.ckpt"
    assert global_step(ckpt) == 2
    out = tmp_path / "out"
    main(["fit", "--config", str(OLD_RUN / "config.yaml"), "--data.root", str(data), "--trainer.default_root_dir",
          str(out), "--trainer.logger.init_args.save_dir", str(out), "--trainer.max_steps", "3",
          "--ckpt_path", str(ckpt)])  # fmt: skip
    (last,) = out.rglob("last.ckpt")
    assert global_step(last) == 3
    # Its weights moved on from the old checkpoint's, which loads into the model of today.
    old = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu")
    new = torch.load(last, map_location="cpu", weights_only=True)["state_dict"]
    assert old.hparams.arch == "shufflenet_v2_x0_5" and old.hparams.class_names == ["circle", "square", "triangle"]
    assert not torch.equal(old.state_dict()["model.fc.weight"], new["model.fc.weight"])
