"""The command line: ``python train.py fit|validate|test|predict`` with YAML configs."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from jsonargparse import lazy_instance
from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_imagenet.callbacks import CUDAPrefetch, Throughput
from lit_imagenet.checkpointing import (
    CheckpointWriteError,
    StepCheckpoint,
    find_last_checkpoint,
    use_atomic_checkpoint_io,
)
from lit_imagenet.data import DataError, ImageFolderDataModule
from lit_imagenet.module import ImageClassifier
from lit_imagenet.monitoring import ConsoleLog, NonFiniteGuard, NonFiniteLossError, Profile, RunLogger, TrainingCurves


def _trainer_defaults() -> dict[str, Any]:
    return {
        "default_root_dir": "runs",
        "max_epochs": 90,
        "logger": lazy_instance(RunLogger, save_dir="runs"),
    }


class ImageNetCLI(LightningCLI):
    """LightningCLI for ``ImageClassifier`` on an ``ImageFolderDataModule``; the data sets the classes."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
        parser.link_arguments("data.classes", "model.class_names", apply_on="instantiate")
        parser.link_arguments("data.channels_last", "model.channels_last")
        # Always-present callbacks, each configurable under its own key (--checkpoint.*, --prefetch.*).
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/top1",
                "checkpoint.mode": "max",
                "checkpoint.save_last": True,
                "checkpoint.filename": "epoch{epoch:03d}-top1{val/top1:.4f}",
                "checkpoint.auto_insert_metric_name": False,
            }
        )
        parser.add_lightning_class_args(StepCheckpoint, "step_checkpoint")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_lightning_class_args(CUDAPrefetch, "prefetch")
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(NonFiniteGuard, "non_finite")
        parser.add_lightning_class_args(ConsoleLog, "console")
        parser.add_lightning_class_args(TrainingCurves, "curves")
        parser.add_lightning_class_args(Profile, "profile")

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        use_atomic_checkpoint_io(trainer)
        return trainer

    def before_fit(self) -> None:
        # Each run logs into a new version folder, where Lightning's own "last" would find nothing:
        # look in every version under the run's folders instead.
        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") != "last":
            return
        roots = {self.trainer.default_root_dir, *(lg.save_dir for lg in self.trainer.loggers if lg.save_dir)}
        found = [p for p in (find_last_checkpoint(r) for r in sorted(roots)) if p is not None]
        if found:
            config["ckpt_path"] = max(found, key=lambda p: Path(p).stat().st_mtime_ns)
            if self.trainer.is_global_zero:
                print(f"Resuming from {config['ckpt_path']}", flush=True)

    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        lines = [f"Logs: {trainer.log_dir}"]
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "best_model_path", ""):
            score = ckpt.best_model_score
            shown = f" ({ckpt.monitor}={score:.4f})" if score is not None else ""
            lines.append(f"Best checkpoint: {ckpt.best_model_path}{shown}")
            if getattr(ckpt, "last_model_path", ""):
                lines.append(f"Last checkpoint: {ckpt.last_model_path}")
        print("\n".join(lines), flush=True)


def _user_message(err: BaseException) -> str:
    """The one sentence of a ``DataError``, also when it was re-raised from a loader worker."""
    text = str(err).strip()
    if "Original Traceback" in text:  # re-raised by DataLoader: the original message is the last line
        last = text.splitlines()[-1]
        prefix = f"{type(err).__module__}.{type(err).__qualname__}: "
        text = last.removeprefix(prefix)
    return text


def main(args: list[str] | None = None, run: bool = True) -> ImageNetCLI:
    """Runs the command line; a data error prints one line and exits with status 2.

    Args:
        args: The arguments; ``None`` reads ``sys.argv``.
        run: ``False`` only parses and builds the model, data and trainer (no subcommand), as in a notebook.
    """
    try:
        return ImageNetCLI(
            ImageClassifier,
            ImageFolderDataModule,
            trainer_defaults=_trainer_defaults(),
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )
    except DataError as err:
        print(f"error: {_user_message(err)}", file=sys.stderr, flush=True)
        sys.exit(2)
    except SIGTERMException:
        # Lightning stops at the end of the batch and StepCheckpoint has saved; 128 + SIGTERM tells a
        # wrapper script or scheduler that the run did not finish.
        print("Stopped by SIGTERM; resume with --ckpt_path last.", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGTERM)
    except CheckpointWriteError as err:
        print(f"error: {err.strerror}", file=sys.stderr, flush=True)
        sys.exit(1)
    except NonFiniteLossError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(1)
