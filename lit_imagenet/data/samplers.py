"""The order of the samples: seeded and resumable for training, sharded without padding for evaluation.

A training sample's augmentation depends only on ``(seed, epoch, index)`` and its copy (repeated augmentation), so a
run resumed part-way through an epoch continues with the very same batches, on any number of processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from torch.utils.data import Dataset, DistributedSampler

from lit_imagenet import compat
from lit_imagenet.data.crops import uniform_draws

_COPY_STREAM = 128  # a copy's seed comes after the crop's and the erasing's draws in the seed's stream


def sample_seeds(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """The augmentation seeds (uint64) of samples ``indices`` in ``epoch`` of a run seeded with ``seed``."""
    base = (((seed & 0xFFFFFFFF) * 1_000_003 + epoch) * 1_000_003) & 0x7FFFFFFFFFFFFFFF
    return (np.uint64(base) + np.asarray(indices, dtype=np.uint64)) & np.uint64(0x7FFFFFFFFFFFFFFF)


def epoch_samples(size: int, seed: int, epoch: int, reps: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The sample indices of ``epoch`` over all processes, ``size`` long, and each one's copy number: a permutation
    fixed by ``seed + epoch // reps``, or with ``reps`` above 1 its ``epoch % reps``-th run of ``ceil(size / reps)``
    samples, each ``reps`` times in a row, so ``reps`` epochs see the whole dataset."""
    generator = torch.Generator().manual_seed(seed + epoch // reps)
    perm = torch.randperm(size, generator=generator).numpy()
    if reps == 1:
        return perm, np.zeros(size, dtype=np.int64)
    shown = -(-size // reps)
    distinct = perm[(epoch % reps * shown + np.arange(shown)) % size]
    return np.repeat(distinct, reps)[:size], np.tile(np.arange(reps), shown)[:size]


def copy_seeds(seeds: np.ndarray, copies: np.ndarray) -> np.ndarray:
    """The augmentation seeds of the ``copies``-th copies of samples of ``seeds`` (``sample_seeds``): copy 0 keeps
    its seed, copy ``k`` takes the ``k``-th draw of the seed's SplitMix64 stream after ``_COPY_STREAM``."""
    out = np.asarray(seeds, dtype=np.uint64).copy()
    for k in np.unique(copies[copies > 0]).tolist():
        rows = copies == k
        draw = uniform_draws(out[rows], 1, first=_COPY_STREAM + k - 1)[:, 0]
        out[rows] = (draw * 2.0**53).astype(np.uint64)
    return out


def epoch_pass(
    size: int, seed: int, epoch: int, replicas: int, rank: int, done: int = 0, reps: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """The sample indices of ``rank`` in ``epoch`` after its first ``done`` samples (over all processes), and their
    augmentation seeds: the rest of ``epoch_samples``, padded to a multiple of ``replicas`` with the epoch's first
    samples, of which ``rank`` takes every ``replicas``-th (``DistributedSampler``'s order when ``done`` is 0 and
    ``reps`` 1), so the copies of a sample go to different processes."""
    indices, copies = epoch_samples(size, seed, epoch, reps)
    positions = np.arange(min(done, size), size)
    pad = np.resize(np.arange(size), -len(positions) % replicas)  # the epoch's first samples, repeated if need be
    positions = np.concatenate([positions, pad])
    positions = positions[rank::replicas]
    picked = indices[positions]
    return picked, copy_seeds(sample_seeds(seed, epoch, picked), copies[positions])


def epoch_order(size: int, seed: int, epoch: int, replicas: int, rank: int, done: int = 0, reps: int = 1) -> np.ndarray:
    """The sample indices of ``epoch_pass``."""
    return epoch_pass(size, seed, epoch, replicas, rank, done, reps)[0]


class EpochSeededSampler(DistributedSampler):
    """Training order fixed by ``(seed, epoch)``, resumable part-way through an epoch, on any number of processes:
    ``(index, augmentation seed)`` pairs, sharded and padded like ``DistributedSampler``, as many as the dataset's.

    Args:
        dataset: The training dataset.
        seed: Seed of the order and of the augmentation.
        num_replicas: Number of processes.
        rank: This process's rank.
        reps: Repeated augmentation (``epoch_samples``); 1: off.
    """

    def __init__(self, dataset: Dataset, seed: int, num_replicas: int = 1, rank: int = 0, reps: int = 1) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.reps = reps
        self._resume: dict[int, tuple[int, int]] = {}  # epoch -> (samples skipped, reps) of its next pass

    def resume_at(self, epoch: int, samples_done: int, reps: int | None = None) -> None:
        """Sets the epoch, and skips its first ``samples_done`` samples, over all processes, in the next pass only;
        that pass keeps the order of ``reps`` (the resumed run's; ``None``: this sampler's)."""
        self.set_epoch(epoch)
        self._resume = {epoch: (samples_done, self.reps if reps is None else reps)}

    def skips(self) -> int:
        """The samples of the current epoch, over all processes, that the next pass skips (``resume_at``)."""
        return self._resume.get(self.epoch, (0,))[0]

    def order(self) -> tuple[np.ndarray, np.ndarray]:
        """This process's sample indices of the next pass and their augmentation seeds (``epoch_pass``)."""
        skips, reps = self._resume.get(self.epoch, (0, self.reps))
        size = len(self.dataset)  # type: ignore[arg-type]
        return epoch_pass(size, self.seed, self.epoch, self.num_replicas, self.rank, skips, reps)

    def next_pass(self) -> tuple[np.ndarray, np.ndarray]:
        """``order``, as the next pass reads it: a resumed epoch's skip is used up."""
        order, self._resume = self.order(), {}
        return order

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        indices, seeds = self.next_pass()
        chunks = range(0, len(indices), 4096)  # Python ints a chunk at a time, not an epoch's at once
        return (pair for a in chunks for pair in zip(indices[a : a + 4096].tolist(), seeds[a : a + 4096].tolist()))


class UnpaddedDistributedSampler(DistributedSampler):
    """Gives each rank every ``num_replicas``-th sample without padding, so that summed validation metrics are exact."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(rank, len(dataset), num_replicas))  # type: ignore[arg-type]
        self.total_size = len(dataset)  # type: ignore[arg-type]


def split_sampler(
    dataset: Dataset,
    train: bool,
    seed: int,
    trainer: pl.Trainer | None,
    batch_size: int,
    saved: dict[str, int] | None = None,
    reps: int = 1,
) -> DistributedSampler | None:
    """The sampler of a split's loader for this process: training, an ``EpochSeededSampler`` at the restored position
    of a resumed run; evaluation, an ``UnpaddedDistributedSampler`` under DDP, else none.

    A resumed epoch skips the samples the checkpoint's run trained (with ``saved``'s ``world_size``, ``batch_size``
    and ``ra_reps``, this run's where missing) and goes on in that run's order; the fit loop's batch counts are moved
    to this run's batches.
    """
    world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
    if not train:
        return UnpaddedDistributedSampler(dataset, world, rank) if world > 1 else None
    sampler = EpochSeededSampler(dataset, seed, world, rank, reps)
    if trainer is None:
        return sampler
    old_world, old_batch = (saved["world_size"], saved["batch_size"]) if saved else (world, batch_size)
    epoch, done, loop = trainer.current_epoch, 0, trainer.fit_loop
    if loop.restarting:  # the fit loop's progress is restored before the loader is made
        epoch, done = max(loop.epoch_progress.current.started - 1, 0), compat.epoch_batches_done(trainer)
        if done >= math.ceil(math.ceil(len(dataset) / old_world) / old_batch):  # type: ignore[arg-type]
            epoch, done = epoch + 1, 0
    old_reps = (saved or {}).get("ra_reps", reps) if done else reps
    sampler.resume_at(epoch, done * old_batch * old_world, old_reps)  # every process trained its first batches
    if old_reps != reps:
        rank_zero_info(f"Epoch {epoch} goes on in the order of the checkpoint's --data.ra_reps {old_reps}; the epochs "
                       f"after it use {reps}.")  # fmt: skip
    if done and (old_world, old_batch) != (world, batch_size):
        rest = math.ceil(len(sampler.order()[0]) / batch_size)
        compat.shift_epoch_batches(trainer, math.ceil(len(sampler) / batch_size) - rest - done)
    return sampler
