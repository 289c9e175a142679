"""The LightningModule: a torchvision classifier trained and evaluated as the reference did."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from pytorch_lightning.utilities.types import OptimizerLRSchedulerConfig
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric, MetricCollection
from typing_extensions import override

from lit_imagenet.compat import (
    attached_trainer,
    epoch_batches_done,
    metric_defaults,
    record_cut_epoch_as_unfinished,
    user_inductor_cache_dir,
    writes_log_line,
)
from lit_imagenet.data.datamodule import usable_cores
from lit_imagenet.data.prefetch import CUDAPrefetch
from lit_imagenet.data.presets import IMAGENET_MEAN, IMAGENET_STD, Uint8Normalize
from lit_imagenet.errors import ConfigError
from lit_imagenet.training import mixing, models, optim
from lit_imagenet.training.ema import WeightEMA, adjusted_decay
from lit_imagenet.training.metrics import accuracy_metrics, topk_hits
from lit_imagenet.training.precision import ApexAMP
from lit_imagenet.training.readback import copy_to_host, read_host_copy, sync_device
from lit_imagenet.training.schedule import WarmupCosine, WarmupMultiStep, check_warmup, scaled_lr

#: The compiler cache folders that runs of this process set, which a later run may replace with its own.
_CACHES_SET: set[str] = set()
#: Inductor's compile workers per training process, fewer where a process has fewer cores.
COMPILE_WORKERS = 4


class ImageClassifier(pl.LightningModule):
    """A torchvision classifier trained with NVIDIA apex's ImageNet learning-rate rule, and torchvision's recipe's
    options (label smoothing, MixUp/CutMix, an EMA of the weights, per-kind weight decay, AdamW/RMSprop).

    Args:
        arch: torchvision architecture name (``resnet50``, ``resnet18``, ``efficientnet_b0``, ...).
        num_classes: Number of classes; the command line takes it from the data.
        weights: ``None`` (random), a torchvision weights name (``IMAGENET1K_V2``) or a state dict/checkpoint path.
        lr: Learning rate per 256 images; the optimizer uses ``lr * global batch / 256``.
        momentum: SGD and RMSprop momentum.
        weight_decay: Weight decay, applied to every parameter as the reference did (AdamW's is decoupled).
        warmup_epochs: Epochs of warmup, recomputed at every optimizer step.
        milestones: Epochs at which the learning rate is multiplied by ``lr_gamma`` (``step`` schedule).
        lr_gamma: The multiplier at each milestone (``step`` schedule).
        lr_schedule: ``step``: the reference's warmup and step decay at ``milestones``. ``cosine``:
            warmup, then a cosine decay to 0 at the end of ``trainer.max_epochs``, for fine-tuning.
        freeze_backbone_epochs: Train only the classifier head for this many first epochs (under DDP this needs
            ``--trainer.strategy ddp_find_unused_parameters_true``).
        backbone_lr_scale: The network but its classifier head learns at the learning rate times this.
        channels_last: Keep the network in channels_last memory format. ``None``: on a CUDA device.
        class_names: Class names in label order, stored in checkpoints; the command line takes them from the data.
        compile: ``torch.compile`` the network in place: ``false`` (eager), ``true``/``default``, ``cudagraphs``
            (``reduce-overhead`` on one CUDA process without accumulation, else ``default``) or ``auto`` (``default``
            on CUDA, eager elsewhere). Apex AMP runs eager.
        fused_optimizer: Use the fused SGD or AdamW kernel. ``None``: on CUDA, but not under apex AMP (which manages
            the optimizer) nor with ``--trainer.gradient_clip_val`` (Lightning clips only what it unscaled itself).
        optimizer: ``sgd``; ``adamw``; ``rmsprop`` (torchvision's: eps 0.0316, alpha 0.9, with ``momentum``).
        label_smoothing: The cross-entropy's label smoothing, in training and evaluation.
        mixup_alpha: MixUp's Beta(alpha, alpha) on the training batch (0: off).
        cutmix_alpha: CutMix's Beta(alpha, alpha) on the training batch (0: off); with both on, one of the two
            per batch, drawn from the data seed, rank, epoch and batch. Training accuracy then counts against each
            image's dominant label.
        ema_decay: Keep an exponential moving average of the weights with this decay, adjusted as torchvision does;
            0: no EMA. Validation reports its figures under ``val_ema/`` beside the raw weights' ``val/``.
        ema_steps: Update the EMA every this many optimizer steps.
        ema_warmup_epochs: During these first epochs the EMA is a copy of the weights. ``None``: ``warmup_epochs``.
        eval_weights: The weights that ``test``, ``predict`` and ``forward`` in eval mode use: ``raw`` or ``ema``.
            Not stored in checkpoints: give it when predicting or testing from one.
        norm_weight_decay: Weight decay of the norm layers' parameters. ``None``: ``weight_decay``.
        bias_weight_decay: Weight decay of the biases. ``None``: ``weight_decay``.
        warmup_method: ``linear`` or ``constant`` (torchvision's), with ``warmup_decay``.
        warmup_decay: The warmup's starting factor (``linear``: from it to 1; ``constant``: it throughout). ``None``:
            the reference's linear warmup, ``(1 + step) / warmup steps``.
    """

    def __init__(
        self,
        arch: str = "resnet50",
        num_classes: int = 1000,
        weights: str | None = None,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        warmup_epochs: int = 5,
        milestones: Sequence[int] = (30, 60, 80),
        lr_gamma: float = 0.1,
        lr_schedule: Literal["step", "cosine"] = "step",
        freeze_backbone_epochs: int = 0,
        backbone_lr_scale: float = 1.0,
        channels_last: bool | None = None,
        class_names: list[str] | None = None,
        compile: bool | Literal["auto", "default", "cudagraphs"] = False,
        fused_optimizer: bool | None = None,
        optimizer: Literal["sgd", "adamw", "rmsprop"] = "sgd",
        label_smoothing: float = 0.0,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        ema_decay: float = 0.0,
        ema_steps: int = 32,
        ema_warmup_epochs: int | None = None,
        eval_weights: Literal["raw", "ema"] = "raw",
        norm_weight_decay: float | None = None,
        bias_weight_decay: float | None = None,
        warmup_method: Literal["linear", "constant"] = "linear",
        warmup_decay: float | None = None,
    ) -> None:
        super().__init__()
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"Got {len(class_names)} class names for {num_classes} classes.")
        if lr_schedule not in ("step", "cosine"):
            raise ValueError(f"lr_schedule must be 'step' or 'cosine'. Got {lr_schedule!r}")
        if freeze_backbone_epochs < 0:
            raise ValueError(f"freeze_backbone_epochs must not be negative. Got {freeze_backbone_epochs}")
        if backbone_lr_scale < 0:
            raise ValueError(f"backbone_lr_scale must not be negative. Got {backbone_lr_scale}")
        if compile not in (False, True, "auto", "default", "cudagraphs"):
            raise ValueError(f"compile must be false, true, auto, default or cudagraphs. Got {compile!r}")
        if optimizer not in ("sgd", "adamw", "rmsprop"):
            raise ConfigError(f"--model.optimizer must be sgd, adamw or rmsprop, not {optimizer!r}.")
        if not 0 <= label_smoothing < 1:
            raise ConfigError(f"--model.label_smoothing must be in [0, 1), not {label_smoothing}.")
        if not 0 <= ema_decay < 1 or ema_steps < 1:
            raise ConfigError(
                f"--model.ema_decay must be in [0, 1) and ema_steps at least 1, not {ema_decay}, {ema_steps}."
            )
        if eval_weights == "ema" and not ema_decay:
            raise ConfigError("--model.eval_weights ema needs a model trained with an EMA (--model.ema_decay > 0).")
        check_warmup(warmup_method, warmup_decay)
        # Not saved: a checkpoint's hyperparameters override the command line's when it is loaded with --ckpt_path.
        self.save_hyperparameters(ignore=["eval_weights"])
        self.eval_weights = eval_weights
        self.model = models.build_model(arch, num_classes, weights)
        self.head_name = models.classifier_name(self.model)
        self.normalize = Uint8Normalize(IMAGENET_MEAN, IMAGENET_STD)
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.mixer = mixing.batch_mixer(mixup_alpha, cutmix_alpha, num_classes)
        #: The weights' moving average (``ema_decay`` > 0); its decay is set once the global batch is known.
        self.ema = WeightEMA(self.model) if ema_decay else None
        self._ema_decay = ema_decay
        # No host sync per training step: no label check, no NaN check (NonFiniteGuard watches the loss on the device).
        self.train_metrics = accuracy_metrics(num_classes, "train/", sync_free=True)
        self.val_metrics = accuracy_metrics(num_classes, "val/")
        self.test_metrics = accuracy_metrics(num_classes, "test/")
        self.train_loss = MeanMetric(nan_strategy="disable")
        # Saved in checkpoints, so that an epoch resumed part-way reports the whole epoch's figures.
        self.train_metrics.persistent(True)
        self.train_loss.persistent(True)
        self.val_loss = MeanMetric()
        self.test_loss = MeanMetric()
        self.val_ema_metrics = accuracy_metrics(num_classes, "val_ema/") if ema_decay else None
        self.val_ema_loss = MeanMetric() if ema_decay else None
        #: Attached to the trainer by ``configure_callbacks``; the command line sets it from ``--prefetch.*``.
        self.prefetch = CUDAPrefetch()
        self._compiled = False
        self._graphed = False  # the network replayed as CUDA graphs (``compile: cudagraphs``)
        self._compile_clock: float | None = None  # the first compiled step's start, 0 until it starts
        self._saved_grid: dict[str, int] | None = None  # the schedule's grid of a checkpoint's run
        self._step_figures: tuple[Tensor, torch.cuda.Event | None] | None = None

    @override
    def forward(self, images: Tensor) -> Tensor:
        """Logits for normalised float images or uint8 ones in [0, 255]; in eval mode from the ``eval_weights``."""
        ema = not self.training and self.eval_weights == "ema" and self.ema is not None
        return self._logits(images, self.ema.module if ema else self.model)

    def _normalized(self, images: Tensor) -> Tensor:
        if images.dtype != torch.uint8:
            return images
        # The first weight's dtype, not self.dtype: apex O2/O3 cast the network without telling Lightning.
        weight = next(self.model.parameters())
        return self.normalize(images, dtype=weight.dtype if weight.is_floating_point() else torch.float32)

    def _logits(self, images: Tensor, network: nn.Module) -> Tensor:
        out = network(self._normalized(images))
        return out if isinstance(out, Tensor) else out[0]  # GoogLeNet and Inception add auxiliary logits in training

    @override
    def setup(self, stage: str) -> None:
        use = self.hparams.channels_last
        if use or use is None and self.trainer.strategy.root_device.type == "cuda":
            self.model.to(memory_format=torch.channels_last)
            if self.ema is not None:
                self.ema.to(memory_format=torch.channels_last)
        if self.hparams.compile and stage == "fit" and not self._compiled:
            self._compile()

    def _compile(self) -> None:
        mode, reason = self._compile_mode()
        if reason:
            rank_zero_info(f"Compile: {mode or 'eager'} ({reason}).")
        self._compiled = True
        if mode is None:
            return
        trainer = attached_trainer(self)
        if trainer is not None and user_inductor_cache_dir() in (None, *_CACHES_SET):
            # Read at the first compile by inductor, triton (whose cache goes under it) and the compile workers.
            folder = os.path.abspath(os.path.join(trainer.default_root_dir, "compile_cache"))
            _CACHES_SET.add(folder)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        # ``triton.cudagraphs`` is what mode="reduce-overhead" sets; torch.compile takes a mode or options, not both.
        options: dict[str, Any] = {"triton.cudagraphs": True} if mode == "cudagraphs" else {}
        if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
            # Inductor's default is a worker process per core, up to 32, each counted in host memory. On one H100 with
            # 16 cores, 4 compiled ResNet-50's first step as fast as 16 did, in 0.5 GiB less (docs/benchmarks.md).
            processes = trainer.num_devices if trainer is not None else 1
            options["compile_threads"] = max(1, min(COMPILE_WORKERS, usable_cores() // max(1, processes)))
        self.model.compile(dynamic=False, options=options)
        self._graphed = mode == "cudagraphs"
        self._compile_clock = 0.0  # started by the first training batch

    def _compile_mode(self) -> tuple[str | None, str | None]:
        """The compile mode this run can have (``None``: eager), and why it is not the one asked for."""
        asked = "default" if self.hparams.compile in (True, "default") else str(self.hparams.compile)
        trainer = attached_trainer(self)
        if trainer is not None and isinstance(trainer.precision_plugin, ApexAMP):
            return None, f"--model.compile {asked} asked for; apex AMP patches functions that torch.compile traces"
        device = trainer.strategy.root_device if trainer is not None else next(self.model.parameters()).device
        if asked == "auto" and device.type != "cuda":
            return None, f"--model.compile auto compiles on CUDA devices only; this run trains on {device.type}"
        if asked != "cudagraphs":
            return "default", None
        if device.type != "cuda":
            return "default", "CUDA graphs need a CUDA device"
        if trainer is not None and trainer.world_size > 1:
            return "default", f"CUDA graphs are used on one process only; this run has {trainer.world_size}"
        if trainer is not None and trainer.accumulate_grad_batches > 1:
            return "default", "gradients accumulated over the replays of one graph would be overwritten"
        return "cudagraphs", None

    def _freeze_backbone(self, end: bool = False) -> None:
        """Freezes all but the classifier head in the first ``freeze_backbone_epochs``, unfreezes it after them."""
        if self.hparams.freeze_backbone_epochs:
            frozen = not end and self.current_epoch < self.hparams.freeze_backbone_epochs
            models.set_backbone_frozen(self.model, self.head_name, frozen, self.training)

    @override
    def on_train_epoch_start(self) -> None:
        self._freeze_backbone()

    @override
    def on_train_end(self) -> None:
        self._freeze_backbone(end=True)

    @override
    def configure_callbacks(self) -> list[pl.Callback]:
        """The prefetcher's callback, ``self.prefetch``; a ``CUDAPrefetch`` given to the Trainer takes its place."""
        return [] if any(isinstance(cb, CUDAPrefetch) for cb in self.trainer.callbacks) else [self.prefetch]

    def _logs_this_step(self, batch_idx: int) -> bool:
        """Whether Lightning writes the step metrics after this batch, or it ends the epoch or the run."""
        trainer = self.trainer
        if writes_log_line(trainer) or 0 < trainer.max_steps <= trainer.global_step + 1:
            return True
        batches = trainer.num_training_batches
        return not math.isinf(batches) and batch_idx + 1 >= batches

    def _mix_seed(self, batch_idx: int) -> int:
        trainer = attached_trainer(self)
        if trainer is None:
            return mixing.mix_seed(0, 0, batch_idx)
        # The training sampler's seed, which a resume restores from the checkpoint, else the data's or the run's.
        seed = getattr(getattr(trainer.train_dataloader, "sampler", None), "seed", None)
        seed = getattr(trainer.datamodule, "seed", None) if seed is None else seed
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if seed is None else seed
        return mixing.mix_seed(seed, trainer.global_rank, trainer.current_epoch, batch_idx)

    @override
    def training_step(self, batch: Sequence[Tensor], batch_idx: int) -> Tensor:
        images, labels = batch[0], batch[1]
        targets = labels  # soft ones under MixUp/CutMix
        if self.mixer is not None:
            images, targets = mixing.mix_batch(self.mixer, self._normalized(images), labels, self._mix_seed(batch_idx))
            labels = targets.argmax(dim=1)  # the accuracies count against each image's dominant label
        logits = self._logits(images, self.model)
        loss = self.criterion(logits, targets)
        # The epoch totals cover every batch; they stay on the device until the epoch ends.
        self.train_loss.update(loss.detach())
        self.train_metrics.update(logits.detach(), labels)
        if attached_trainer(self) is None or self._logs_this_step(batch_idx):
            # Metric objects are logged so that Lightning computes and syncs them once per epoch, not every step.
            self.log("train/loss_epoch", self.train_loss, on_step=False, on_epoch=True)
            for name, metric in self.train_metrics.items():
                self.log(f"{name}_epoch", metric, on_step=False, on_epoch=True)
            # Copied to the host now, logged in on_train_batch_end once backward and step are queued: no GPU wait.
            logits, ks = logits.detach(), [metric.k for metric in self.train_metrics.values()]
            figures = [loss.detach().float(), *(topk_hits(logits, labels, k).float().mean() for k in ks)]
            self._step_figures = copy_to_host(torch.stack(figures))
        return loss

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._graphed:
            # A new training step: the graphs' outputs of the last one (logits, gradients) may be overwritten.
            torch.compiler.cudagraph_mark_step_begin()
        if self._compile_clock == 0.0:
            self._compile_clock = time.perf_counter()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._compile_clock:
            sync_device(self)  # the first step only: it compiled the network
            seconds, caches = time.perf_counter() - self._compile_clock, os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            line = f"Compiled the network and ran its first step in {seconds:.1f} s (compiler caches: {caches})."
            rank_zero_info(line)
            self._compile_clock = None
        if self._step_figures is None:
            return
        figures, self._step_figures = read_host_copy(self._step_figures), None
        # Host tensors: Lightning turns a Python number into a tensor on the module's device, which waits.
        for name, value in zip(["train/loss", *self.train_metrics.keys()], figures.unbind()):
            self.log(f"{name}_step", value, on_step=True, on_epoch=False)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        # Here rather than in on_train_batch_end: a step checkpoint, saved before that hook, holds this update.
        if self.ema is None or attached_trainer(self) is None:
            return
        if (self.trainer.global_step + 1) % self.hparams.ema_steps:  # Lightning counts this step once the hook returns
            return
        # The average, or a copy while the last update was in the EMA's warmup epochs (torchvision resets it then).
        warmup = self.hparams.ema_warmup_epochs
        warmup = self.hparams.warmup_epochs if warmup is None else warmup
        self.ema.update(self.model, None if self.ema.fresh else self._ema_decay)
        self.ema.fresh = self.current_epoch < warmup

    def _eval_step(
        self, batch: Sequence[Tensor], metrics: MetricCollection, loss_metric: MeanMetric, network: nn.Module
    ) -> None:
        images, targets = batch[0], batch[1]
        logits = self._logits(images, network)
        loss = self.criterion(logits, targets)
        metrics.update(logits, targets)
        loss_metric.update(loss, weight=targets.numel())
        self.log(f"{metrics.prefix}loss", loss_metric, on_step=False, on_epoch=True)
        self.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True)

    @override
    def validation_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics, self.val_loss, self.model)
        if self.ema is not None:
            self._eval_step(batch, self.val_ema_metrics, self.val_ema_loss, self.ema.module)

    @override
    def test_step(self, batch: Sequence[Tensor], batch_idx: int) -> None:
        ema = self.eval_weights == "ema" and self.ema is not None
        self._eval_step(batch, self.test_metrics, self.test_loss, self.ema.module if ema else self.model)

    @override
    def predict_step(self, batch: Sequence[Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, Tensor]:
        """Class probabilities, with the batch's sample indices (``index``) to find the files."""
        return {"probs": torch.softmax(self(batch[0]).float(), dim=1), "index": batch[1]}

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        # The rates need the training loader, which loaded this early would restart a resumed epoch: see on_train_start.
        hp = self.hparams
        groups = self._parameter_groups()
        optimizer = optim.build_optimizer(hp.optimizer, groups, hp.lr, hp.momentum, hp.weight_decay, self._fused())
        # LambdaLR scales every group alike.
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._schedule(steps_per_epoch=1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _parameter_groups(self) -> list[dict[str, Any]]:
        hp = self.hparams
        return optim.parameter_groups(self.model, self.head_name, hp.backbone_lr_scale, hp.weight_decay,
                                      hp.norm_weight_decay, hp.bias_weight_decay)  # fmt: skip

    def _schedule(self, steps_per_epoch: int) -> WarmupMultiStep | WarmupCosine:
        hp = self.hparams
        if hp.lr_schedule == "step":
            return WarmupMultiStep(steps_per_epoch, hp.warmup_epochs, hp.milestones, hp.lr_gamma, hp.warmup_method,
                                   hp.warmup_decay)  # fmt: skip
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs < 1:
            raise ValueError("The cosine schedule decays over trainer.max_epochs; set --trainer.max_epochs.")
        return WarmupCosine(steps_per_epoch, max_epochs, hp.warmup_epochs, hp.warmup_method, hp.warmup_decay)

    def _fused(self) -> bool:
        fused = self.hparams.fused_optimizer
        if fused is None:
            device = next(self.model.parameters()).device.type
            trainer = attached_trainer(self)
            apex = trainer is not None and isinstance(trainer.precision_plugin, ApexAMP)
            clip = trainer.gradient_clip_val if trainer is not None else None
            fused = optim.fused_by_default(self.hparams.optimizer, device, apex, clip)
        return bool(fused)

    @override
    def on_train_start(self) -> None:
        """Scales the base rates by the global batch, sets the schedule's steps per epoch and the EMA's decay."""
        self._freeze_backbone()  # a run resumed part-way through an epoch gets no on_train_epoch_start for it
        if self.ema is not None:
            batch, epochs = optim.global_batch_size(self.trainer), max(1, self.trainer.max_epochs or 1)
            self._ema_decay = adjusted_decay(self.hparams.ema_decay, batch, self.hparams.ema_steps, epochs)
        scheduler = self.lr_schedulers()
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            return  # an optimizer or scheduler given on the command line replaces ours
        global_batch, steps = optim.global_batch_size(self.trainer), optim.steps_per_epoch(self.trainer)
        grid, self._saved_grid = self._saved_grid, None
        if grid is not None and (grid["global_batch"], grid["steps_per_epoch"]) != (global_batch, steps):
            # Resumed with another global batch: at the same point of its epoch on this run's step grid.
            epoch = self.trainer.current_epoch
            done = epoch_batches_done(self.trainer) // self.trainer.accumulate_grad_batches
            before = scheduler.last_epoch - epoch * grid["steps_per_epoch"]
            old_lr = float(self.trainer.optimizers[0].param_groups[0]["lr"])
            scheduler.last_epoch = epoch * steps + done
            new_lr = scaled_lr(self.hparams.lr, global_batch) * self._schedule(steps)(scheduler.last_epoch)
            before_world, world = grid.get("world_size", "a"), self.trainer.world_size
            rank_zero_info(
                f"Resumed a {before_world}-process run on {world} process{'es' if world > 1 else ''}: global batch "
                f"{grid['global_batch']} -> {global_batch}, learning rate {old_lr:.4g} -> {new_lr:.4g} (lr x global "
                f"batch / 256), epoch {epoch} on from its step {done} of {steps} (it was at {before} of "
                f"{grid['steps_per_epoch']})."
            )
        base_lr = scaled_lr(self.hparams.lr, global_batch)
        # This run's scales, of the optimizer's groups in order, and its schedules: a resumed LambdaLR and optimizer
        # hold the checkpoint's, whose settings this run may have changed.
        scheduler.base_lrs = [base_lr * group["lr_scale"] for group in self._parameter_groups()]
        scheduler.lr_lambdas = [self._schedule(steps) for _ in scheduler.lr_lambdas]
        for group, base, schedule in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * schedule(scheduler.last_epoch)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._saved_grid = checkpoint.get("schedule_grid")
        state = checkpoint.get("state_dict")
        if isinstance(state, dict) and self.ema is not None and not any(k.startswith("ema.") for k in state):
            # A checkpoint of a run without an EMA: this run's starts as a copy of its weights.
            state.update({f"ema.module.{k[6:]}": v.clone() for k, v in list(state.items()) if k.startswith("model.")})
            state["ema._extra_state"] = {"fresh": True}
        elif isinstance(state, dict) and self.ema is None:
            for key in [k for k in state if k.startswith("ema.")]:
                del state[key]

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["arch"] = self.hparams.arch
        checkpoint["class_names"] = self.hparams.class_names
        if attached_trainer(self) is not None and self.trainer.training:
            # A run resumed with another global batch places its schedule by these (on_train_start).
            checkpoint["schedule_grid"] = {
                "global_batch": optim.global_batch_size(self.trainer),
                "world_size": self.trainer.world_size,
                "steps_per_epoch": optim.steps_per_epoch(self.trainer),
            }
            # An epoch cut short by max_steps, max_time or an early stop goes on from its next batch when resumed.
            record_cut_epoch_as_unfinished(self.trainer, checkpoint)
        if attached_trainer(self) is not None and self.trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            # Saved at an epoch's end (before Lightning resets the metrics): the resumed run's new epoch starts empty.
            state = checkpoint.get("state_dict", {})
            for prefix, metric in self.named_modules():
                if prefix.startswith(("train_loss", "train_metrics.")) and isinstance(metric, Metric):
                    for name, default in metric_defaults(metric).items():
                        if f"{prefix}.{name}" in state and isinstance(default, Tensor):
                            state[f"{prefix}.{name}"] = default.detach().clone()
