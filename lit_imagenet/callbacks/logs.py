"""The run's logs: ``metrics.csv`` and TensorBoard events side by side, and the training curves drawn from them."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override


class RunLogger(CSVLogger):
    """A ``CSVLogger`` that also writes TensorBoard files into its folder; a continued run appends to ``metrics.csv``.

    Args:
        save_dir: Folder of the logs. ``None``: ``--trainer.default_root_dir`` on the command line, else ``runs``.
        name: Sub-folder of the run's versions; ``""``: none.
        version: Version number or folder name (``""``: none); ``None``: the next free ``version_N``.
        prefix: Prefix of every metric name.
        flush_logs_every_n_steps: Write ``metrics.csv`` every this many steps.
        tensorboard: Set to ``False`` for the CSV file only.
    """

    def __init__(
        self,
        save_dir: str | None = None,
        name: str = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
        tensorboard: bool = True,
    ) -> None:
        super().__init__("runs" if save_dir is None else save_dir, name, version, prefix, flush_logs_every_n_steps)
        self.tensorboard = tensorboard
        self._tb_prefix = prefix
        self._tb: TensorBoardLogger | None = None
        self._writer: Any = None

    @property
    @override
    def experiment(self) -> Any:
        """The CSV writer; one made in a folder that already has a ``metrics.csv`` appends to it."""
        if self._writer is not None or rank_zero_only.rank != 0:
            return self._writer or super().experiment
        metrics = Path(self.log_dir) / "metrics.csv"
        kept = metrics.with_name(".metrics.csv.kept")
        if metrics.is_file():
            metrics.replace(kept)  # Lightning's writer deletes the file of a folder it finds in use
        try:
            with warnings.catch_warnings():
                # "Previous log files ... will be deleted": not this one, kept above.
                warnings.filterwarnings("ignore", message="Experiment logs directory")
                self._writer = super().experiment
        finally:
            if kept.is_file():
                kept.replace(metrics)
        if metrics.is_file():
            with open(metrics, newline="") as f:
                self._writer.metrics_keys = next(csv.reader(f), [])
        return self._writer

    @property
    def tb(self) -> TensorBoardLogger | None:
        """The TensorBoard logger writing into this logger's version folder (``None`` when off)."""
        if self.tensorboard and self._tb is None:
            self._tb = TensorBoardLogger(
                self.save_dir, name=self.name, version=self.version, prefix=self._tb_prefix, default_hp_metric=False
            )
        return self._tb if self.tensorboard else None

    @override
    @rank_zero_only
    def log_hyperparams(self, params: Any = None) -> None:
        super().log_hyperparams(params)
        if self.tb is not None:
            self.tb.log_hyperparams(params)

    @override
    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        super().log_metrics(metrics, step)
        if self.tb is not None:
            self.tb.log_metrics(metrics, step)

    @override
    @rank_zero_only
    def save(self) -> None:
        super().save()
        if self._tb is not None:
            self._tb.experiment.flush()

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._tb is not None:
            self._tb.finalize(status)


_CURVES = (
    ("loss", ("train/loss_step", "val/loss")),
    ("top-1", ("train/top1_step", "val/top1")),
    ("top-5", ("train/top5_step", "val/top5")),
    ("learning rate", ("lr-SGD",)),
    ("images/s", ("train/images_per_sec",)),
)


def plot_curves(metrics_csv: str | Path, out: str | Path) -> Path:
    """Draws loss, top-1, top-5, learning rate and images/s against the step from a ``metrics.csv``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend to switch
    from matplotlib.figure import Figure

    series: dict[str, list[tuple[float, float]]] = {}
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            step = row.pop("step", None)
            for key, value in row.items():
                if step and value:
                    series.setdefault(key, []).append((float(step), float(value)))
    fig = Figure(figsize=(4 * len(_CURVES), 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (title, keys) in zip(fig.subplots(1, len(_CURVES)), _CURVES):
        for key in keys:
            points = series.get(key) or next((v for k, v in series.items() if k.startswith(key)), [])
            if points:
                ax.plot(*zip(*points), label=key, marker="." if key.startswith("val/") else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize="small")
    fig.savefig(out, dpi=80)
    return Path(out)


class TrainingCurves(pl.Callback):
    """At the end of ``fit``, saves ``training_curves.png`` (loss, top-1, top-5, LR, images/s) next to ``metrics.csv``.

    Args:
        enabled: Set to ``False`` for no picture.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path: Path | None = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not (self.enabled and trainer.is_global_zero):
            return
        logger = next((lg for lg in trainer.loggers if isinstance(lg, CSVLogger)), None)
        if logger is None:
            return
        logger.save()
        metrics = Path(logger.experiment.metrics_file_path)
        if metrics.is_file():
            self.path = plot_curves(metrics, Path(logger.log_dir) / "training_curves.png")
            rank_zero_info(f"Training curves: {self.path}")
