"""What watches and keeps a run: checkpoints, pre-emption, the non-finite guard, console lines, logs, predictions."""

from __future__ import annotations

import pytorch_lightning as pl

from lit_imagenet.callbacks.checkpoints import BEST_CHECKPOINT, AtomicCheckpoints, BestCheckpoint, StepCheckpoint
from lit_imagenet.callbacks.console import ConsoleLog, LearningRateLog, Throughput
from lit_imagenet.callbacks.guard import NonFiniteGuard
from lit_imagenet.callbacks.logs import RunLogger as RunLogger
from lit_imagenet.callbacks.logs import TrainingCurves
from lit_imagenet.callbacks.predictions import PredictionWriter
from lit_imagenet.callbacks.preemption import SigtermConsensus
from lit_imagenet.callbacks.profiling import Profile as Profile


def default_callbacks(
    *, every_n_train_steps: int = 0, console: bool = True, curves: bool = True, max_consecutive_non_finite: int = 20
) -> list[pl.Callback]:
    """The callbacks of ``train.py fit`` with their command-line defaults, for a ``pl.Trainer`` made by hand.

    Args:
        every_n_train_steps: Save ``last-step.ckpt`` every this many optimizer steps; 0: every 15 minutes of training.
        console: Print the console line (the learning rates and throughput are logged either way).
        curves: Draw ``training_curves.png`` at the end of ``fit``.
        max_consecutive_non_finite: Consecutive NaN or infinite losses that stop the run.
    """
    return [
        BestCheckpoint(**BEST_CHECKPOINT),
        StepCheckpoint(every_n_train_steps),
        AtomicCheckpoints(),
        SigtermConsensus(),
        LearningRateLog(),
        ConsoleLog(console),  # before Throughput: an epoch's last console line comes before its summary line
        Throughput(),
        NonFiniteGuard(max_consecutive_non_finite),
        TrainingCurves(curves),
        PredictionWriter(),
    ]
