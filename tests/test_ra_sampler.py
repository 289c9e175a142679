"""The repeated-augmentation sampler (``ra_reps``): each shown sample ``reps`` times per epoch over the ranks, with
its own seeds, and the exact resume of the plain sampler."""

from collections import Counter

import numpy as np
import pytest
import torch

from lit_imagenet.data.samplers import EpochSeededSampler, epoch_pass, epoch_samples


def _epoch(size: int, reps: int, world: int, epoch: int = 0, seed: int = 7) -> list[list[tuple[int, int]]]:
    """Every rank's ``(index, seed)`` pairs of ``epoch``."""
    out = []
    for rank in range(world):
        sampler = EpochSeededSampler(list(range(size)), seed=seed, num_replicas=world, rank=rank, reps=reps)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("reps", [2, 4])
def test_each_shown_index_comes_reps_times_over_two_ranks_in_an_epoch_of_the_dataset_length(reps: int) -> None:
    for epoch in range(3):
        ranks = _epoch(40, reps, world=2, epoch=epoch)
        assert [len(r) for r in ranks] == [20, 20]
        counts = Counter(i for rank in ranks for i, _ in rank)
        assert set(counts.values()) == {reps} and len(counts) == 40 // reps
        for rank in ranks:  # consecutive copies go to the other rank: no rank holds all of a sample's copies
            assert max(Counter(i for i, _ in rank).values()) == reps // 2


def test_an_epoch_of_a_size_reps_does_not_divide_keeps_the_dataset_length() -> None:
    ranks = _epoch(42, 4, world=2)
    counts = Counter(i for rank in ranks for i, _ in rank)
    assert sum(counts.values()) == 42 and len(counts) == 11  # ceil(42 / 4) shown, the last one twice
    assert sorted(counts.values()) == [2] + [4] * 10


def test_the_copies_of_a_sample_get_different_seeds() -> None:
    pairs = [pair for rank in _epoch(40, 4, world=2) for pair in rank]
    assert len(set(pairs)) == 40 and len({seed for _, seed in pairs}) == 40
    plain = dict(pair for rank in _epoch(40, 1, world=2) for pair in rank)
    seeds: dict[int, set[int]] = {}
    for index, seed in pairs:
        seeds.setdefault(index, set()).add(seed)
    assert all(plain[index] in got for index, got in seeds.items())  # copy 0 keeps the plain sampler's seed


@pytest.mark.parametrize("size, reps", [(40, 4), (42, 4), (9, 2)])
def test_reps_epochs_show_the_whole_dataset_and_the_next_ones_another_subset(size: int, reps: int) -> None:
    shown = [{i for rank in _epoch(size, reps, world=2, epoch=e) for i, _ in rank} for e in range(2 * reps)]
    assert set().union(*shown[:reps]) == set(range(size))
    assert set().union(*shown[reps:]) == set(range(size))
    assert all(shown[e] != shown[e + reps] for e in range(reps))


@pytest.mark.parametrize("size, reps", [(40, 4), (42, 3)])
@pytest.mark.parametrize("resume_world", [1, 2])
def test_an_epoch_stopped_on_two_ranks_resumes_with_exactly_the_rest(size: int, reps: int, resume_world: int) -> None:
    batch, batches_done, epoch = 3, 2, 1
    before = _epoch(size, reps, world=2, epoch=epoch)
    trained = [pair for rank in before for pair in rank[: batches_done * batch]]
    rest = []
    for rank in range(resume_world):
        sampler = EpochSeededSampler(list(range(size)), seed=7, num_replicas=resume_world, rank=rank, reps=reps)
        sampler.resume_at(epoch, batches_done * batch * 2)
        rest += list(sampler)
    assert Counter(trained) + Counter(rest) == Counter(pair for rank in before for pair in rank)
    if resume_world == 1:  # the same order: the two ranks' remaining pairs interleaved
        left = [rank[batches_done * batch :] for rank in before]
        assert rest == [pair for pairs in zip(*left) for pair in pairs]
    sampler.set_epoch(epoch + 1)  # the skip is for the resumed pass only
    assert len(list(sampler)) == -(-size // resume_world)


def _fc83e45_pass(size: int, seed: int, epoch: int, replicas: int, rank: int, done: int) -> list[tuple[int, int]]:
    """The sampler's order and seeds before repeated augmentation, restated."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    perm = torch.randperm(size, generator=generator).numpy()
    rest = perm[min(done, size) :]
    pad = -len(rest) % replicas
    if pad:
        rest = np.concatenate([rest, np.resize(perm, pad)])
    indices = rest[rank::replicas]
    base = (((seed & 0xFFFFFFFF) * 1_000_003 + epoch) * 1_000_003) & 0x7FFFFFFFFFFFFFFF
    seeds = (np.uint64(base) + indices.astype(np.uint64)) & np.uint64(0x7FFFFFFFFFFFFFFF)
    return list(zip(indices.tolist(), seeds.tolist()))


@pytest.mark.parametrize("size, replicas, done", [(37, 1, 0), (37, 2, 0), (37, 4, 12), (3, 4, 0), (50, 3, 49)])
def test_one_rep_is_the_plain_order_and_seeds(size: int, replicas: int, done: int) -> None:
    for epoch in (0, 3):
        for rank in range(replicas):
            indices, seeds = epoch_pass(size, 11, epoch, replicas, rank, done, reps=1)
            assert list(zip(indices.tolist(), seeds.tolist())) == _fc83e45_pass(size, 11, epoch, replicas, rank, done)


def test_the_data_module_passes_ra_reps_to_the_training_sampler(shapes_root) -> None:
    from lit_imagenet.data.datamodule import ImageFolderDataModule

    module = ImageFolderDataModule(str(shapes_root), batch_size=4, workers=0, crop_size=32, val_resize=36, ra_reps=2)
    counts = Counter(i for i, _ in module.train_dataloader().sampler)
    assert sum(counts.values()) == 24 and set(counts.values()) == {2}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("before, after, reps_after", [(2, 1, 2), (1, 2, 1)])
def test_a_run_with_repeated_augmentation_stopped_mid_epoch_resumes_with_the_rest_of_its_samples(
    tmp_path, before: int, after: int, reps_after: int
) -> None:
    """Also when resumed with another --data.ra_reps: the cut epoch ends in its run's order, the next use the new."""
    from tests.test_resume import _one_image_per_class
    from tests.test_stop_resume import BATCH, SAMPLES, SEED, _batches, _run

    root = _one_image_per_class(tmp_path / "data", SAMPLES)  # a sample's label is its index
    out = tmp_path / "run"
    _run(root, out, "first", before, "--trainer.max_steps", "2", "--data.ra_reps", "2")
    first = _batches(out / "first")
    assert {b["epoch"] for b in first} == {0} and 0 < len(first) < SAMPLES // BATCH, first
    console = _run(root, out, "second", after, "--trainer.max_epochs", "2", "--ckpt_path", "last", "--data.ra_reps",
                   str(reps_after))  # fmt: skip
    second = _batches(out / "second")
    assert min(b["epoch"] for b in second) == 0
    changed = "Epoch 0 goes on in the order of the checkpoint's --data.ra_reps 2; the epochs after it use 1."
    assert (changed in console) == (reps_after != 2)
    for epoch, reps in ((0, 2), (1, reps_after)):
        trained = Counter(label for b in first + second if b["epoch"] == epoch for label in b["labels"])
        assert trained == Counter(epoch_samples(SAMPLES, SEED, epoch, reps=reps)[0].tolist()), epoch
        assert len(trained) == SAMPLES // reps and set(trained.values()) == {reps}


def test_a_resumed_pass_keeps_the_order_of_its_runs_reps_and_the_next_pass_takes_the_samplers() -> None:
    size, batch, done, epoch = 40, 4, 3, 2
    before = EpochSeededSampler(list(range(size)), seed=7, reps=4)
    before.set_epoch(epoch)
    trained = list(before)[: done * batch]
    after = EpochSeededSampler(list(range(size)), seed=7, reps=1)
    after.resume_at(epoch, done * batch, reps=4)
    rest = list(after)
    assert trained + rest == [*_epoch(size, 4, world=1, epoch=epoch)[0]]
    after.set_epoch(epoch + 1)
    assert sorted(i for i, _ in after) == list(range(size))  # reps 1: every sample once
