"""Mixed precision: NVIDIA apex AMP as a Lightning precision plugin, and the native equivalents of its flags."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lit_imagenet.compat import attached_trainer, run_after_closure
from lit_imagenet.errors import ConfigError
from lit_imagenet.training.models import BATCH_NORMS

OptLevel = Literal["O0", "O1", "O2", "O3"]
NATIVE_EQUIVALENT = {"O0": "32-true", "O1": "16-mixed", "O2": "16-mixed", "O3": "16-true"}


def import_apex_amp() -> Any:
    """``apex.amp``, or an ``ImportError`` whose one sentence says what is missing and the native way."""
    hint = "use native AMP instead: O0 -> --trainer.precision 32-true, O1/O2 -> 16-mixed, O3 -> 16-true"
    try:
        apex = importlib.import_module("apex")
    except ImportError:
        raise ImportError(f"NVIDIA apex is not installed, so apex AMP is not available; {hint}.") from None
    try:
        return importlib.import_module("apex.amp")
    except ImportError:
        version = getattr(apex, "__version__", "unknown")
        raise ImportError(
            f"The installed apex (version {version}, at {getattr(apex, '__file__', '?')}) has no apex.amp "
            f"(removed in release 25.07; 25.05 is the last with it); {hint}."
        ) from None


def _parse_loss_scale(loss_scale: float | str | None) -> float | str | None:
    if loss_scale is None or loss_scale == "dynamic":
        return loss_scale
    try:
        if float(loss_scale) > 0:
            return float(loss_scale)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"loss_scale must be a positive number or 'dynamic'. Got {loss_scale!r}")


class ApexAMP(Precision):
    """Mixed precision through NVIDIA apex's ``amp``, as the reference trained.

    Use with one process, or with ``--trainer.strategy ddp_apex`` for several; gradient accumulation is refused.

    Args:
        opt_level: ``O0`` fp32; ``O1`` patched functions in fp16; ``O2`` fp16 with fp32 master weights; ``O3`` fp16.
        keep_batchnorm_fp32: Keep batch norm in float32 (apex's default: on for O2, off for O3).
        loss_scale: A fixed loss scale, or ``"dynamic"`` (apex's default for O1-O2).
    """

    def __init__(
        self,
        opt_level: OptLevel = "O1",
        keep_batchnorm_fp32: bool | None = None,
        loss_scale: float | Literal["dynamic"] | None = None,
    ) -> None:
        if opt_level not in NATIVE_EQUIVALENT:
            raise ValueError(f"opt_level must be one of {', '.join(NATIVE_EQUIVALENT)}. Got {opt_level!r}")
        try:
            self._amp: Any = import_apex_amp()
            self._missing = ""
        except ImportError as err:
            # Raised here, the command line would wrap it in its own errors; the run refuses at its start instead.
            self._amp, self._missing = None, str(err)
        self.opt_level = opt_level
        self.keep_batchnorm_fp32 = keep_batchnorm_fp32
        self.loss_scale = _parse_loss_scale(loss_scale)
        self.precision = NATIVE_EQUIVALENT[opt_level]
        self._initialized = False
        self._pending_state: dict[str, Any] | None = None

    @property
    def amp(self) -> Any:
        """The ``apex.amp`` module; a ``ConfigError`` saying why and the native equivalent where it cannot import."""
        if self._amp is None:
            raise ConfigError(self._missing)
        return self._amp

    def initialize(self, model: nn.Module, optimizers: list[Optimizer]) -> tuple[nn.Module, list[Optimizer]]:
        """Calls ``amp.initialize`` on the bare model and its optimizers, before DDP wraps them; raises ``ConfigError``
        where apex AMP cannot be imported."""
        amp = self.amp
        if isinstance(model, DistributedDataParallel):
            raise RuntimeError(
                "apex AMP must initialise the model before DDP wraps it; use --trainer.strategy ddp_apex."
            )
        trainer = attached_trainer(model)
        if trainer is not None and trainer.accumulate_grad_batches > 1:
            raise ValueError(
                "Gradient accumulation is not supported with apex AMP (it would unscale every micro-batch); "
                "use --trainer.precision 16-mixed, or --trainer.accumulate_grad_batches 1."
            )
        options = {"keep_batchnorm_fp32": self.keep_batchnorm_fp32, "loss_scale": self.loss_scale}
        kwargs = {"opt_level": self.opt_level, "verbosity": 0, **{k: v for k, v in options.items() if v is not None}}
        if optimizers:
            model, optimizers = amp.initialize(model, optimizers, **kwargs)
        else:
            model = amp.initialize(model, **kwargs)
        self._initialized = True
        if self._pending_state is not None:
            self.amp.load_state_dict(self._pending_state)
            self._pending_state = None
        return model, list(optimizers)

    @override
    def connect(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        if not self._initialized:
            model, optimizers = self.initialize(model, optimizers)
        return model, optimizers, lr_schedulers

    @override
    def backward(  # type: ignore[override]
        self, tensor: Tensor, model: pl.LightningModule, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if optimizer is None:
            raise RuntimeError("apex AMP needs the optimizer to scale the loss; manual optimization is not supported.")
        with self.amp.scale_loss(tensor, optimizer) as scaled:
            model.backward(scaled, *args, **kwargs)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # apex's patched step refuses closures, so the closure (forward and backward) runs first.
        closure_result = closure()
        run_after_closure(self, model, optimizer)
        if closure_result is None and model.automatic_optimization:
            return None  # backward was skipped: nothing to step
        return optimizer.step(**kwargs)

    @override
    def main_params(self, optimizer: Optimizer) -> Iterator[torch.nn.Parameter]:
        return self.amp.master_params(optimizer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self.amp.state_dict()) if self._initialized else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._initialized:
            self.amp.load_state_dict(state_dict)
        else:
            self._pending_state = dict(state_dict)


class StaticScaleGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose scale never changes; steps with inf/NaN gradients are still skipped."""

    def __init__(self, scale: float, device: str = "cuda") -> None:
        super().__init__(device, init_scale=scale)
        self.static_scale = float(scale)

    @override
    def update(self, new_scale: float | Tensor | None = None) -> None:
        super().update(self.static_scale if new_scale is None else new_scale)


class StaticScaleMixedPrecision(MixedPrecision):
    """Native ``16-mixed`` with a fixed loss scale, like the reference's ``--loss-scale 128.0``.

    Args:
        loss_scale: The fixed loss scale.
        device: The device type autocast runs on.
    """

    def __init__(self, loss_scale: float = 128.0, device: str = "cuda") -> None:
        scale = _parse_loss_scale(loss_scale)
        if not isinstance(scale, float):
            raise ValueError(f"loss_scale must be a positive number. Got {loss_scale!r}")
        super().__init__("16-mixed", device, scaler=StaticScaleGradScaler(scale, device))


class KeepBatchNormHalfPrecision(HalfPrecision):
    """Native ``16-true`` with batch norm layers kept in float32 (apex's O3 with keep_batchnorm_fp32)."""

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        module = super().convert_module(module)
        for m in module.modules():
            if isinstance(m, BATCH_NORMS):
                m.float()
        return module


@dataclass
class AMPFlags:
    """The reference's AMP flags, as ``--amp.*``: resolved to apex AMP or to the closest native precision.

    Args:
        opt_level: The reference's ``--opt-level`` (O0, O1, O2, O3). Unset: ``--trainer.precision`` decides.
        keep_batchnorm_fp32: The reference's ``--keep-batchnorm-fp32``.
        loss_scale: The reference's ``--loss-scale``: a number for a fixed scale, or ``dynamic``.
        backend: ``auto`` (apex if ``apex.amp`` imports, else native), ``apex`` or ``native``.
    """

    opt_level: OptLevel | None = None
    keep_batchnorm_fp32: bool | None = None
    loss_scale: float | Literal["dynamic"] | None = None
    backend: Literal["auto", "apex", "native"] = "auto"


@dataclass
class AMPChoice:
    """What ``resolve_amp`` chose: a precision flag or plugin (and strategy) for the Trainer, and a line saying so."""

    precision: str | None
    plugin: Precision | None
    strategy: str | None
    message: str


def resolve_amp(
    opt_level: OptLevel,
    keep_batchnorm_fp32: bool | None = None,
    loss_scale: float | str | None = None,
    backend: Literal["auto", "apex", "native"] = "auto",
    devices: int = 1,
    device_type: str = "cuda",
) -> AMPChoice:
    """Maps the reference's AMP flags to apex AMP when it can be imported, or to the closest native setting.

    Args:
        opt_level, keep_batchnorm_fp32, loss_scale, backend: As in ``AMPFlags``.
        devices: Processes in the run; more than one with apex selects the ``ddp_apex`` strategy.
        device_type: The device type, for native autocast.
    """
    if opt_level not in NATIVE_EQUIVALENT:
        raise ValueError(f"opt_level must be one of {', '.join(NATIVE_EQUIVALENT)}. Got {opt_level!r}")
    scale = _parse_loss_scale(loss_scale)
    if backend in ("auto", "apex"):
        try:
            import_apex_amp()
        except ImportError as err:
            if backend == "apex":
                raise
            reason = str(err).split(";")[0]
        else:
            bn, scale_name = (("apex default" if v is None else str(v)) for v in (keep_batchnorm_fp32, scale))
            message = f"AMP: apex amp {opt_level} (keep_batchnorm_fp32={bn}, loss_scale={scale_name})"
            plugin = ApexAMP(opt_level, keep_batchnorm_fp32, scale)
            return AMPChoice(None, plugin, "ddp_apex" if devices > 1 else None, message)
    else:
        reason = "native AMP was asked for"
    native = NATIVE_EQUIVALENT[opt_level]
    note = f"AMP: native {native} for apex {opt_level} ({reason})"
    if scale is not None and native != "16-mixed":  # said, not dropped silently
        note += f"; --amp.loss_scale {scale} is unused: native {native} scales no loss"
    if native == "16-mixed" and isinstance(scale, float):
        plugin = StaticScaleMixedPrecision(scale, device_type)
        return AMPChoice(None, plugin, None, f"{note}, static loss scale {scale:g}")
    if native == "16-true" and keep_batchnorm_fp32:
        return AMPChoice(None, KeepBatchNormHalfPrecision(), None, f"{note}, batch norm kept in float32")
    if native == "16-mixed" and keep_batchnorm_fp32 is False:
        note += "; autocast keeps batch norm in float32 regardless"
    return AMPChoice(native, None, None, note)
