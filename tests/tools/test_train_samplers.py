"""Distributed samplers: evaluation covers every index exactly once; training batches are the
same samples whatever the number of ranks, and resume mid-epoch continues the same order."""

from collections import Counter

import numpy as np
import pytest

from iabn.tools.data.samplers import ExactShardSampler, ShuffledShardSampler, sample_seed


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("length", [0, 1, 2, 5, 13, 360])
def test_exact_shards_count_every_index_once(world, length):
    shards = [list(ExactShardSampler(length, world, rank)) for rank in range(world)]
    counts = Counter(i for shard in shards for i in shard)
    assert sorted(counts) == list(range(length))
    assert set(counts.values()) <= {1}
    sizes = [len(shard) for shard in shards]
    assert sizes == [len(ExactShardSampler(length, world, r)) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1


def test_exact_shard_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank=2"):
        ExactShardSampler(10, 2, 2)


def _global_batches(sampler_per_rank: list[ShuffledShardSampler]) -> list[list[tuple]]:
    """Rank-ordered concatenation of every rank's k-th batch."""
    per_rank = [list(s) for s in sampler_per_rank]
    b = sampler_per_rank[0].per_rank
    steps = len(per_rank[0]) // b
    return [[key for keys in per_rank for key in keys[k * b:(k + 1) * b]] for k in range(steps)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("length", [16, 37])
def test_training_batches_do_not_depend_on_the_world_size(world, length):
    batch = 8
    single = ShuffledShardSampler(length, batch, seed=5)
    single.set_epoch(3)
    ranks = [ShuffledShardSampler(length, batch, world, r, seed=5) for r in range(world)]
    for sampler in ranks:
        sampler.set_epoch(3)
    assert _global_batches(ranks) == _global_batches([single])
    keys = [key for key in single]
    # The permutation of (seed, epoch), full batches only, each sample at most once.
    order = np.random.default_rng([5, 3]).permutation(length)[: (length // batch) * batch]
    assert [index for index, _ in keys] == order.tolist()
    assert all(seed == sample_seed(5, 3, index) for index, seed in keys)


def test_epochs_and_seeds_change_the_order():
    def order(seed, epoch):
        sampler = ShuffledShardSampler(64, 8, seed=seed)
        sampler.set_epoch(epoch)
        return [i for i, _ in sampler]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    assert sorted(order(0, 1)) == list(range(64))


def test_skip_batches_resumes_with_the_remaining_samples():
    sampler = ShuffledShardSampler(50, 10, 2, 1, seed=2)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4, skip_batches=3)
    assert list(sampler) == full[3 * 5:]
    assert len(sampler) == len(full) - 15


def test_max_batches_caps_the_epoch():
    sampler = ShuffledShardSampler(100, 10, max_batches=3)
    sampler.set_epoch(0)
    assert sampler.batches_per_epoch == 3 and len(list(sampler)) == 30


@pytest.mark.parametrize(("length", "batch", "world", "match"), [
    (100, 10, 3, "not divisible by the 3 ranks"),
    (5, 8, 1, "larger than the 5 samples"),
])
def test_impossible_batch_splits_are_refused(length, batch, world, match):
    with pytest.raises(ValueError, match=match):
        ShuffledShardSampler(length, batch, world, 0)
