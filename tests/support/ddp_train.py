"""A few DDP training steps of a small InPlaceABNSync model; run by test_ddp.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/support/ddp_train.py OUT.json
    python tests/support/ddp_train.py OUT.json            # the same training in one process

Every step uses the same 12-sample batch on every launch; under torchrun each of the N ranks
trains on its 12/N slice, with batch statistics synchronised and gradients averaged by DDP,
so the global loss curve must equal the single-process one. float64 keeps the comparison exact.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import iabn

BATCH, STEPS = 12, 5


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), iabn.InPlaceABN(8),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), iabn.InPlaceABN(8, activation="elu",
                                                                   activation_param=1.0),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    ).double()


def main(out_path: str) -> None:
    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    rank, world = 0, 1
    model = build_model()
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model = nn.parallel.DistributedDataParallel(iabn.convert_sync(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = BATCH // world
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        images = torch.randn(BATCH, 3, 8, 8, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, 4, (BATCH,), generator=generator)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images[mine]), labels[mine])
        loss.backward()
        optimizer.step()
        global_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(global_loss.item())
    if rank == 0:
        module = model.module if distributed else model
        state = {k: v.tolist() for k, v in module.state_dict().items()}
        with open(out_path, "w") as f:
            json.dump({"world": world, "losses": losses, "state": state}, f)
    if distributed:
        # Let every rank finish before any tears gloo down: a rank that exits while a peer
        # still holds its connections can abort ("terminate called without an active
        # exception"), seen about once in a dozen runs without this barrier.
        dist.barrier()
        dist.destroy_process_group()
        # Still seen twice on 2026-11-23 on a loaded 2-core machine, at interpreter exit, after
        # the results were written: a gloo thread left joinable when C++ statics are destroyed.
        # Skip that teardown: everything this rank had to do is done and flushed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
