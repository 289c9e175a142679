"""The command line: ``python train.py fit|validate|test|predict`` with YAML configs."""

from __future__ import annotations

import contextlib
import os
import pydoc
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import yaml
from jsonargparse import Namespace, lazy_instance
from pytorch_lightning import LightningDataModule, Trainer
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only
from pytorch_lightning.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lit_imagenet.callbacks.checkpoints import (
    BEST_CHECKPOINT,
    BestCheckpoint,
    CheckpointWriteError,
    StepCheckpoint,
    find_last_checkpoint,
    use_atomic_checkpoint_io,
)
from lit_imagenet.callbacks.console import ConsoleLog, LearningRateLog, Throughput, quiet_third_party
from lit_imagenet.callbacks.guard import NonFiniteGuard, NonFiniteLossError
from lit_imagenet.callbacks.logs import RunLogger, TrainingCurves
from lit_imagenet.callbacks.predictions import PredictionWriter
from lit_imagenet.callbacks.preemption import (
    RequeueSignal,
    SigtermConsensus,
    catch_requeue_signal,
    requeue_slurm_job,
    torchrun_restart_problem,
)
from lit_imagenet.callbacks.profiling import Profile
from lit_imagenet.compat import untested_version_warning
from lit_imagenet.data.datamodule import ImageFolderDataModule
from lit_imagenet.data.prefetch import CUDAPrefetch
from lit_imagenet.errors import ConfigError, DataError, UserError
from lit_imagenet.training.module import ImageClassifier
from lit_imagenet.training.precision import AMPFlags, ApexAMP, resolve_amp
from lit_imagenet.training.strategies import ApexDDPStrategy  # also registers ddp_default_stream and ddp_apex

#: Seconds that rank 0, after an error of its own, gives the ranks it launched to end by themselves.
LAUNCHED_RANKS_GRACE = 10.0


class EndLaunchedRanks(pl.Callback):
    """Ends the launched ranks still running ``LAUNCHED_RANKS_GRACE`` s after this rank's error (Lightning does on
    Ctrl-C only; they would wait for the process group's timeout). ``main`` calls ``end`` after the trainer, so that
    every callback's ``on_exception`` (a checkpoint saved by every rank) runs first."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    @override
    def on_exception(self, trainer: Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, KeyboardInterrupt):
            self.procs = [p for p in getattr(trainer.strategy.launcher, "procs", None) or [] if p.poll() is None]

    def end(self) -> None:
        deadline = time.monotonic() + LAUNCHED_RANKS_GRACE
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        left = [proc for proc in self.procs if proc.poll() is None]
        for proc in left:
            proc.kill()
            proc.wait()
        if left:
            ranks = f"{len(left)} launched rank{'s' if len(left) > 1 else ''}"
            line = f"Ended {ranks} still running {LAUNCHED_RANKS_GRACE:.0f} s after this rank's error."
            print(line, file=sys.stderr, flush=True)


class ImageNetCLI(LightningCLI):
    """LightningCLI for ``ImageClassifier`` on an ``ImageFolderDataModule``; the data sets the classes."""

    #: The model's config as given (a checkpoint's hyperparameters with --ckpt_path), set for each parse.
    _model_config: dict[str, Any]

    def _from_data_or_model(self, key: str) -> Any:
        """Links data -> model that keep the model's own value (the checkpoint's) when the data has none."""
        return lambda value: value if value else self._model_config.get(key)

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # With only --data.predict_root the data knows no classes: the model keeps those of --ckpt_path.
        for source, target in (("num_classes", "num_classes"), ("classes", "class_names")):
            link = self._from_data_or_model(target)
            parser.link_arguments(f"data.{source}", f"model.{target}", link, apply_on="instantiate")
        parser.link_arguments("data.channels_last", "model.channels_last")
        # Always-present callbacks, each configurable under its own key (--checkpoint.*, --prefetch.*).
        parser.add_lightning_class_args(BestCheckpoint, "checkpoint")
        parser.set_defaults({f"checkpoint.{key}": value for key, value in BEST_CHECKPOINT.items()})
        parser.add_lightning_class_args(StepCheckpoint, "step_checkpoint")
        parser.add_lightning_class_args(SigtermConsensus, "sigterm")
        parser.add_lightning_class_args(LearningRateLog, "lr_monitor")
        # Not a trainer callback here: the model attaches its own (configure_callbacks), which --prefetch.* sets.
        parser.add_class_arguments(CUDAPrefetch, "prefetch", fail_untyped=False, sub_configs=True)
        # ConsoleLog before Throughput: an epoch's last console line comes before its summary line.
        parser.add_lightning_class_args(ConsoleLog, "console")
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(NonFiniteGuard, "non_finite")
        parser.add_lightning_class_args(TrainingCurves, "curves")
        parser.add_lightning_class_args(Profile, "profile")
        parser.add_class_arguments(AMPFlags, "amp")
        parser.add_lightning_class_args(PredictionWriter, "predict_writer")

    def _section(self, config: Namespace) -> Namespace:
        """The part of ``config`` for the subcommand that runs (all of it when only building the objects)."""
        return config[self.subcommand] if self.subcommand else config

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        config = self._section(self.config_init)
        if isinstance(config.get("prefetch"), CUDAPrefetch) and isinstance(self.model, ImageClassifier):
            self.model.prefetch = config.prefetch
        if self.subcommand not in (None, "fit"):
            # Evaluating or predicting writes no run: no config.yaml.
            self.save_config_callback = None
        trainer_config = dict(config.get("trainer") or {})
        amp = config.get("amp")
        if amp is not None and amp.opt_level is not None:
            kwargs.update(_amp_trainer_kwargs(amp, {**trainer_config, **kwargs}))
        _check_bf16({**trainer_config, **kwargs})
        _check_precision_plugin({**trainer_config, **kwargs})
        trainer = super().instantiate_trainer(**kwargs)
        use_atomic_checkpoint_io(trainer)
        return trainer

    def before_predict(self) -> None:
        config = self.config_init[self.subcommand]
        if config.get("return_predictions") is None:
            # The PredictionWriter writes as it goes; Lightning would also keep every batch's output in host memory.
            config["return_predictions"] = False
        # Predict logs nowhere: predictions.csv goes into the checkpoint's run, else --trainer.default_root_dir.
        ckpt_path = config.get("ckpt_path")
        folder = Path(ckpt_path).parent if ckpt_path else Path(self.trainer.default_root_dir)
        folder = folder.parent if ckpt_path and folder.name == "checkpoints" else folder
        for writer in (c for c in self.trainer.callbacks if isinstance(c, PredictionWriter)):
            if writer.output is None:
                writer.output = str(folder / "predictions.csv")

    def before_fit(self) -> None:
        config = self.config_init[self.subcommand]
        trainer = self.trainer
        folders = _checkpoint_folders(trainer)
        newest = find_last_checkpoint(*folders)
        ckpt_path = config.get("ckpt_path")
        if ckpt_path == "last":
            # "last" is this run's own: the checkpoints of its folder, never another run's.
            config["ckpt_path"] = newest
            if newest is None:
                if trainer.is_global_zero:
                    print(f"No checkpoint in {folders[0]}: training from the start.", flush=True)
                return
        elif ckpt_path is None:
            if newest is not None:
                epoch, step, _ = _checkpoint_summary(newest)
                raise ConfigError(
                    f"{os.path.dirname(newest)} already holds a run's checkpoint (epoch {epoch}, step {step}): "
                    "continue it with --ckpt_path last, or start a new run with another --trainer.default_root_dir."
                )
            return
        path = str(config["ckpt_path"])
        if "://" in path:  # a remote file: Lightning reads it, with no cheap look beforehand
            return
        epoch, step, hparams = _checkpoint_summary(path)
        problem = _cannot_continue(trainer, self.model, epoch, step, hparams)
        if problem:
            raise ConfigError(f"{path} (epoch {epoch}, step {step}) cannot continue here: {problem}.")
        # Continued in its own folder, the checkpoint folder is expected to hold files: no Lightning warning.
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        if trainer.is_global_zero:
            print(f"Resuming from {path} (epoch {epoch}, step {step}).", flush=True)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        given = sys.argv[1:] if args is None else args
        if isinstance(given, (list, tuple)) and (problem := linked_model_argument(list(given))):
            raise ConfigError(problem)
        super().parse_arguments(parser, args)

    @override
    def before_instantiate_classes(self) -> None:
        config = self._section(self.config)
        trainer_config = config.get("trainer")
        if trainer_config is not None:
            if trainer_config.get("default_root_dir") is None:
                trainer_config.default_root_dir = run_folder(config.get("config"))
            if self.subcommand in ("validate", "test", "predict"):
                trainer_config.logger = False  # results go to the console; no new log folder
            # A RunLogger given no save_dir logs into --trainer.default_root_dir (built before it).
            loggers = trainer_config.get("logger")
            for logger in loggers if isinstance(loggers, list) else [loggers]:
                if isinstance(logger, Namespace) and pydoc.locate(str(logger.get("class_path"))) is RunLogger:
                    if logger.init_args.get("save_dir") is None:
                        logger.init_args.save_dir = trainer_config.default_root_dir or os.getcwd()
        self._model_config = dict(config.get("model") or {})
        data = config.get("data")
        if data is not None and data.get("root", "") is None and not self._model_config.get("num_classes"):
            raise DataError("The number of classes is unknown; give --ckpt_path of a trained model or --data.root.")
        if config.get("ckpt_path") not in (None, "last") and config.get("model") is not None:
            # The checkpoint replaces every weight, so the initial weights are not loaded (unless "last" finds none).
            config.model.weights = None

    def after_fit(self) -> None:
        trainer = self.trainer
        log_dir = trainer.log_dir  # a collective under DDP: every rank must ask
        if not trainer.is_global_zero:
            return
        lines = [f"Logs: {str(log_dir).rstrip('/')}"]  # no trailing / of an empty version
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "best_model_path", ""):
            score = ckpt.best_model_score
            shown = f" ({ckpt.monitor}={score:.4f})" if score is not None else ""
            lines.append(f"Best checkpoint: {ckpt.best_model_path}{shown}")
            if getattr(ckpt, "last_model_path", ""):
                lines.append(f"Last checkpoint: {ckpt.last_model_path}")
        print("\n".join(lines), flush=True)


def run_folder(configs: list[Any] | None) -> str:
    """The command line's default run folder: ``runs/`` and the name of the first config file, else ``runs/default``."""
    files = [Path(os.fspath(c)) for c in configs or [] if isinstance(c, (str, os.PathLike))]
    return os.path.join("runs", files[0].stem if files else "default")


def _checkpoint_folders(trainer: Trainer) -> list[str]:
    """The folders the trainer's checkpoint callbacks save into, as Lightning resolves them at setup."""
    logged = trainer.default_root_dir
    if trainer.loggers:
        logger = trainer.loggers[0]
        version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
        logged = os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name or ""), version)
    default = os.path.join(logged, "checkpoints")
    return [str(cb.dirpath) if cb.dirpath else default for cb in trainer.checkpoint_callbacks] or [default]


def _checkpoint_summary(path: str) -> tuple[int, int, dict[str, Any]]:
    """A checkpoint's epoch, global step and hyperparameters, read without loading its tensors (memory-mapped)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 - any reason a file is no checkpoint
        raise ConfigError(f"Cannot read checkpoint {path} ({type(err).__name__}: {err}).") from None
    return int(ckpt.get("epoch", 0)), int(ckpt.get("global_step", 0)), dict(ckpt.get("hyper_parameters") or {})


def _cannot_continue(trainer: Trainer, model: Any, epoch: int, step: int, hparams: dict[str, Any]) -> str | None:
    """Why a checkpoint at ``epoch`` and ``step`` with ``hparams`` cannot continue with this trainer and model."""
    if trainer.max_epochs not in (None, -1) and trainer.max_epochs <= epoch:
        return f"--trainer.max_epochs {trainer.max_epochs} ends before its epoch {epoch} (from 0); give more"
    if trainer.max_steps != -1 and trainer.max_steps <= step:
        return f"--trainer.max_steps {trainer.max_steps} ends at or before its step {step}; give more"
    mine = getattr(model, "hparams", {})
    if "arch" in hparams and "arch" in mine and hparams["arch"] != mine["arch"]:
        return f"it is a {hparams['arch']}, not --model.arch {mine['arch']}"
    names, theirs = list(mine.get("class_names") or []), list(hparams.get("class_names") or [])
    if "num_classes" in hparams and hparams["num_classes"] != mine.get("num_classes", hparams["num_classes"]):
        return f"it has {hparams['num_classes']} classes, the data {mine['num_classes']}"
    if names and theirs and names != theirs:
        differ = next((a, b) for a, b in zip([*theirs, None], [*names, None]) if a != b)
        return f"its classes differ from the data's (class {differ[0]!r} where the data has {differ[1]!r})"
    return None


def _process_count(trainer_config: dict[str, Any]) -> int:
    devices = trainer_config.get("devices", "auto")
    if isinstance(devices, str) and "," in devices:  # "0,1" or "1,": the GPUs listed, as Lightning reads it
        devices = [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, (list, tuple)):
        count = len(devices)
    elif str(devices).strip().lstrip("-").isdigit() and int(devices) != -1:
        count = int(devices)
    else:
        count = max(1, torch.cuda.device_count())
    return count * int(trainer_config.get("num_nodes", 1) or 1)


def _device_type(trainer_config: dict[str, Any]) -> str:
    accelerator = str(trainer_config.get("accelerator", "auto"))
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def _amp_trainer_kwargs(amp: AMPFlags, trainer_config: dict[str, Any]) -> dict[str, Any]:
    """Trainer arguments for the reference's AMP flags, which take the place of ``--trainer.precision``."""
    precision = trainer_config.get("precision")
    try:
        choice = resolve_amp(amp.opt_level, amp.keep_batchnorm_fp32, amp.loss_scale, amp.backend,
                             _process_count(trainer_config), _device_type(trainer_config))  # fmt: skip
    except ImportError as err:
        raise ConfigError(str(err)) from None
    replaced = f", in place of --trainer.precision {precision}" if precision not in (None, "32-true") else ""
    rank_zero_info(choice.message + replaced)
    # A precision plugin and a precision flag cannot both reach the Trainer.
    kwargs: dict[str, Any] = {"precision": choice.precision}
    if choice.plugin is not None:
        plugins = trainer_config.get("plugins") or []
        kwargs["plugins"] = [*(plugins if isinstance(plugins, list) else [plugins]), choice.plugin]
    if choice.strategy is not None:
        strategy = trainer_config.get("strategy", "auto")
        if not isinstance(strategy, ApexDDPStrategy):
            if strategy not in ("auto", "ddp", "ddp_default_stream", "ddp_apex"):
                raise ConfigError(f"apex AMP runs with one process or --trainer.strategy ddp_apex, not {strategy!r}.")
            kwargs["strategy"] = choice.strategy
    return kwargs


def _check_precision_plugin(trainer_config: dict[str, Any]) -> None:
    """One line, not Lightning's traceback, for a precision plugin given beside ``--trainer.precision``."""
    plugins = trainer_config.get("plugins") or []
    given = [p for p in (plugins if isinstance(plugins, list) else [plugins]) if isinstance(p, pl.plugins.Precision)]
    if not given or trainer_config.get("precision") is None:
        return
    if isinstance(given[0], ApexAMP):
        given[0].amp  # noqa: B018  (without apex: its one sentence)
    name = type(given[0]).__name__
    precision = trainer_config["precision"]
    raise ConfigError(f"--trainer.plugins gives the precision plugin {name}, and --trainer.precision {precision} is "
                      "set too (in a config, say); set it to null or drop the plugin.")  # fmt: skip


def _check_bf16(trainer_config: dict[str, Any]) -> None:
    precision = str(trainer_config.get("precision"))
    cuda = _device_type(trainer_config) == "cuda" and torch.cuda.is_available()
    if precision.startswith("bf16") and cuda and not torch.cuda.is_bf16_supported():
        name, instead = torch.cuda.get_device_name(), f"use --trainer.precision 16-mixed instead of {precision}"
        raise ConfigError(f"{name} cannot compute in bfloat16; {instead}.")


# The model's arguments that the data sets (ImageNetCLI.add_arguments_to_parser), and where they come from.
_FROM_CLASSES = "the data's classes (the class folders, or --ckpt_path's classes with no training data); remove it"
_LINKED = {
    "num_classes": _FROM_CLASSES,
    "class_names": _FROM_CLASSES,
    "channels_last": "data.channels_last (the batches and the network share one memory format); set that instead",
}


def _yaml_mapping(value: str) -> dict[str, Any] | None:
    """The mapping in a YAML file named ``value``, or in ``value`` itself; ``None`` if it holds none."""
    try:
        loaded = yaml.safe_load(Path(value).read_text() if os.path.isfile(value) else value)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None


def linked_model_argument(args: list[str]) -> str | None:
    """The error for ``args`` giving a model argument that the data sets (a config's is dropped silently), or None."""
    for i, arg in enumerate(args):
        key, equals, value = arg.partition("=")
        if key.startswith("-c") and not key.startswith("--") and len(key) > 2:  # -cFILE
            key, value = "-c", arg[2:]
        elif not equals:
            value = args[i + 1] if i + 1 < len(args) else ""
        if key.startswith("--model.") and key.removeprefix("--model.") in _LINKED:
            return f"{key} is set from {_LINKED[key.removeprefix('--model.')]}."
        given = _yaml_mapping(value) if key in ("--config", "-c", "--model") else None
        model = given if key == "--model" else (given or {}).get("model")
        linked = [name for name in _LINKED if isinstance(model, dict) and name in model]
        if linked:
            source = value if os.path.isfile(value) else "the config given"
            return f"model.{linked[0]} in {source} is set from {_LINKED[linked[0]]}."
    return None


def main(
    args: list[str] | None = None, run: bool = True, datamodule_class: type[LightningDataModule] = ImageFolderDataModule
) -> ImageNetCLI:
    """Runs the command line; a data or configuration error prints one line and exits with status 2.

    Args:
        args: The arguments; ``None`` reads ``sys.argv``.
        run: ``False`` only parses and builds the model, data and trainer (no subcommand), as in a notebook.
        datamodule_class: The ``--data.*`` class; it needs ``classes``, ``num_classes`` and ``channels_last``.
    """
    quiet_third_party()
    if warning := untested_version_warning():
        rank_zero_only(print)(warning, file=sys.stderr, flush=True)
    if run:
        catch_requeue_signal()
        if (problem := torchrun_restart_problem()) and os.environ.get("RANK", "0") == "0":
            print(f"warning: {problem}", file=sys.stderr, flush=True)
    ender = EndLaunchedRanks()
    try:
        # One run, one folder: runs/NAME (run_folder), with its logs and checkpoints/ straight in it.
        defaults = {"default_root_dir": None, "max_epochs": 90, "logger": lazy_instance(RunLogger, name="", version=""),
                    "callbacks": [ender]}  # fmt: skip
        return ImageNetCLI(ImageClassifier, datamodule_class, trainer_defaults=defaults,
                           save_config_kwargs={"overwrite": True}, args=args, run=run)  # fmt: skip
    except UserError as err:
        text = str(err).strip()
        if "Original Traceback" in text:  # re-raised from a loader worker: the original message is the last line
            text = text.splitlines()[-1].removeprefix(f"{type(err).__module__}.{type(err).__qualname__}: ")
        print(f"error: {text}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RequeueSignal:
        sys.exit(requeue_slurm_job())
    except SIGTERMException:
        # StepCheckpoint has saved; 128 + SIGTERM tells a wrapper script or scheduler that the run did not finish.
        print("Stopped by SIGTERM; resume with --ckpt_path last.", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGTERM)
    except (CheckpointWriteError, NonFiniteLossError) as err:
        print(f"error: {err.strerror if isinstance(err, CheckpointWriteError) else err}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        ender.end()
        if run and torch.distributed.is_available() and torch.distributed.is_initialized():
            # Left to interpreter shutdown, the process group's threads can abort the process and its exit status.
            torch.distributed.destroy_process_group()
