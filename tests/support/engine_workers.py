"""The ranks of test_engines.py's data-parallel test (gloo, CPU): each rank converts the
model, wraps it (FSDP2's ``fully_shard`` per block and on the root, or DDP), takes one step on
its own batch and compares the gradients with the model as given on every rank's batch,
computed locally (float64)."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import engine_models as em


def run(rank: int, world: int, port: int, cases: tuple[tuple[str, str], ...]) -> None:
    """``torch.multiprocessing.spawn`` entry point; ``cases``: (model, engine) pairs, a model
    a builder's name in :mod:`engine_models`, an engine ``"fsdp2"`` or ``"ddp"``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name in dict.fromkeys(model for model, _ in cases):
            model = getattr(em, name)()
            batches = [em.images(model, batch=2, seed=seed) for seed in range(world)]
            want = em.reference_gradients(model, batches)
            converted = em.converted(model, batches[0])
            for engine in (e for m, e in cases if m == name):
                _compare(copy.deepcopy(converted), engine, batches[rank], want, rank)
    finally:
        # all ranks finish before any tears gloo down (see dist_workers.py)
        dist.barrier()
        dist.destroy_process_group()


def _compare(wrapped, engine: str, batch: torch.Tensor, want: dict, rank: int) -> None:
    if engine == "fsdp2":
        for block in em.blocks(wrapped):
            fully_shard(block)
        fully_shard(wrapped)
    else:
        wrapped = DistributedDataParallel(wrapped)
    em.loss(wrapped(batch)).backward()
    difference = em.largest_difference(em.gradients(wrapped), want)
    assert difference <= em.TOLERANCE, (type(wrapped).__name__, engine, rank, difference)
