"""The command line: ``python train.py fit|validate|test|predict`` with YAML configs."""

from __future__ import annotations

import sys
from typing import Any

from jsonargparse import lazy_instance
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.loggers import CSVLogger
from typing_extensions import override

from lit_imagenet.callbacks import CUDAPrefetch, PredictionWriter, Throughput
from lit_imagenet.data import DataError, ImageFolderDataModule
from lit_imagenet.module import ImageClassifier


def _trainer_defaults() -> dict[str, Any]:
    return {
        "default_root_dir": "runs",
        "max_epochs": 90,
        "logger": lazy_instance(CSVLogger, save_dir="runs"),
    }


class ImageNetCLI(LightningCLI):
    """LightningCLI for ``ImageClassifier`` on an ``ImageFolderDataModule``; the data sets the classes."""

    _model_config: dict[str, Any] = {}

    def _from_data_or_model(self, key: str) -> Any:
        """Links data -> model that keep the model's own value (the checkpoint's) when the data has none."""

        def compute(value: Any) -> Any:
            return value if value else self._model_config.get(key)

        return compute

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # With only --data.predict_root the data knows no classes: the model keeps those of --ckpt_path,
        # whose hyperparameters LightningCLI has put in the model's config.
        parser.link_arguments(
            "data.num_classes", "model.num_classes", self._from_data_or_model("num_classes"), apply_on="instantiate"
        )
        parser.link_arguments(
            "data.classes", "model.class_names", self._from_data_or_model("class_names"), apply_on="instantiate"
        )
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
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_lightning_class_args(CUDAPrefetch, "prefetch")
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(PredictionWriter, "predict_writer")

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        self._model_config = dict(config.get("model") or {})
        if (
            config.get("data") is not None
            and config.data.get("root") is None
            and not self._model_config.get("num_classes")
        ):
            raise DataError("The number of classes is unknown; give --ckpt_path of a trained model or --data.root.")
        if config.get("ckpt_path") and config.get("model") is not None:
            # The checkpoint's state replaces every weight, so the initial weights (possibly a file
            # of the machine it was trained on) are not loaded again.
            config.model.weights = None

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
