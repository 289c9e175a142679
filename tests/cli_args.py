"""Command-line arguments shared by the tests that run ``train.py`` on the tiny generated data."""

import re
from pathlib import Path

#: A network with batch norm and a quarter of ResNet-18's step time on a CPU thread at 32x32 (49 against 185 ms for a
#: batch of 6): for the tests whose checks hold for any network (resumes, signals, processes), where the steps are
#: not what is tested.
SMALL_ARCH = "shufflenet_v2_x0_5"


def small_args(root: Path, *extra: str, batch_size: int = 8, workers: int = 0, arch: str = "resnet18") -> list[str]:
    """The arguments of ``fit_args`` without the subcommand and the run's folder."""
    return [
        "--data.root", str(root), "--data.batch_size", str(batch_size), "--data.workers", str(workers),
        "--data.crop_size", "32", "--data.val_resize", "36", "--model.arch", arch,
        "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", *extra,
    ]  # fmt: skip


def fit_args(
    root: Path, out: Path, *extra: str, batch_size: int = 8, workers: int = 0, arch: str = "resnet18"
) -> list[str]:
    """``fit`` on CPU at 32x32 with ``arch`` (ResNet-18), logging and checkpointing under ``out``; ``extra`` goes
    last."""
    folders = ["--trainer.default_root_dir", str(out), "--trainer.logger.init_args.save_dir", str(out)]
    return ["fit", *small_args(root, *folders, *extra, batch_size=batch_size, workers=workers, arch=arch)]


def error_lines(err: str) -> list[str]:
    """The lines of a run's standard error without the warnings that libraries print (``path.py:LINE: message``):
    on a machine with SLURM's ``srun``, Lightning warns that it is not used before the error a test looks at."""
    return [line for line in err.strip().splitlines() if not re.match(r"^\S+\.py:\d+: ", line)]
