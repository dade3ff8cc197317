"""Samplers that split a dataset over the ranks of a distributed run.

:class:`ShuffledShardSampler` (training) draws a fresh permutation every epoch, keeps only full
global batches and gives every rank one contiguous slice of each, so the samples of global
batch ``k`` are the same whatever the number of ranks. It yields ``(index, sample_seed)``
pairs: the seed depends only on ``(seed, epoch, index)``, so random augmentation does not
depend on the number of ranks or data-loading workers, nor on where a resumed run restarts.

:class:`ExactShardSampler` (evaluation) gives every index to exactly one rank, with no padding
duplicates and no drops, so metrics summed over ranks count each sample once.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

SampleKey = tuple[int, int]
"""``(index, sample_seed)``: what :class:`ShuffledShardSampler` yields for a dataset."""


def shard_bounds(length: int, num_replicas: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of ``rank``'s contiguous share of ``range(length)``; shares differ in
    size by at most one and together cover every index once."""
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} must be in [0, num_replicas={num_replicas})")
    return rank * length // num_replicas, (rank + 1) * length // num_replicas


class ExactShardSampler(Sampler[int]):
    """Rank ``rank``'s contiguous share of ``range(length)``, in order (see module doc)."""

    def __init__(self, length: int, num_replicas: int = 1, rank: int = 0) -> None:
        self.start, self.stop = shard_bounds(length, num_replicas, rank)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The augmentation seed of sample ``index`` in ``epoch`` (a 32-bit integer)."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0])


class ShuffledShardSampler(Sampler[SampleKey]):
    """Training order: per epoch a permutation of ``range(length)`` seeded by ``(seed, epoch)``,
    cut into global batches of ``batch_size`` (an incomplete last batch is dropped, so every
    rank runs the same number of steps); rank ``r`` takes items ``[r*b, (r+1)*b)`` of each
    global batch, ``b = batch_size // num_replicas``. ``max_batches`` caps the batches per
    epoch. Call :meth:`set_epoch` before iterating; ``skip_batches`` resumes mid-epoch.
    """

    def __init__(self, length: int, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 seed: int = 0, max_batches: int | None = None) -> None:
        if batch_size % num_replicas:
            raise ValueError(f"batch size {batch_size} is not divisible by the {num_replicas} "
                             f"ranks: every rank needs the same share of a batch")
        if length < batch_size:
            raise ValueError(f"batch size {batch_size} is larger than the {length} samples: "
                             f"not even one full batch per epoch")
        shard_bounds(batch_size, num_replicas, rank)  # validates rank
        self.length, self.batch_size = length, batch_size
        self.per_rank = batch_size // num_replicas
        self.rank, self.seed = rank, seed
        full = length // batch_size
        self.batches_per_epoch = full if max_batches is None else min(full, max_batches)
        self.epoch, self.skip_batches = 0, 0

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Iterate over epoch ``epoch``, starting after its first ``skip_batches`` batches."""
        if not 0 <= skip_batches <= self.batches_per_epoch:
            raise ValueError(f"skip_batches={skip_batches} outside [0, "
                             f"{self.batches_per_epoch}]")
        self.epoch, self.skip_batches = epoch, skip_batches

    def __iter__(self) -> Iterator[SampleKey]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.length)
        for batch in range(self.skip_batches, self.batches_per_epoch):
            first = batch * self.batch_size + self.rank * self.per_rank
            for index in order[first:first + self.per_rank].tolist():
                yield index, sample_seed(self.seed, self.epoch, index)

    def __len__(self) -> int:
        return (self.batches_per_epoch - self.skip_batches) * self.per_rank


__all__ = ["ExactShardSampler", "SampleKey", "ShuffledShardSampler", "sample_seed",
           "shard_bounds"]
