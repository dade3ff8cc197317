"""Process-group setup for ``torchrun`` and the few collectives the engine needs.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) :func:`start` joins the process
group through ``env://``: NCCL when the run uses CUDA, gloo on CPU, each rank on
``cuda:LOCAL_RANK``. Without it everything runs in one process and the collectives below
return their input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in the run."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes snapshots, TensorBoard and the console output."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class DeviceError(ValueError):
    """A ``--device`` that this machine cannot run (the message says why)."""


def _device(requested: str | None, local_rank: int) -> torch.device:
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda") or (
            device.type == "cpu" and device.index not in (None, 0)):
        raise DeviceError(f"--device {requested!r}: expected cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {requested}: CUDA is not available on this machine "
                              f"(torch {torch.__version__}, built with CUDA "
                              f"{torch.version.cuda or 'none'}); use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {requested}: this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s), numbered from 0"
                              + (f" (cuda:LOCAL_RANK = cuda:{local_rank})"
                                 if requested == "cuda" else ""))
        torch.cuda.set_device(device)
    return device


def start(device: str | None = None) -> Ranks:
    """Join the ``torchrun`` process group if there is one; pick this rank's device
    (``device=None``: CUDA when available, else CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = _device(device, local_rank)
    if world_size == 1:
        return Ranks(0, 1, 0, chosen)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo",
                                init_method="env://")
    return Ranks(dist.get_rank(), dist.get_world_size(), local_rank, chosen)


def finish(ranks: Ranks) -> None:
    """Leave the process group after every rank got here (so none tears gloo down while a
    peer still talks to it)."""
    if ranks.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(tensor: Tensor, ranks: Ranks) -> Tensor:
    """The sum of ``tensor`` over all ranks (a new tensor; the input is untouched)."""
    total = tensor.detach().clone()
    if ranks.distributed:
        # gloo moves CPU tensors, NCCL CUDA ones.
        staged = total.to(ranks.device)
        dist.all_reduce(staged)
        total = staged.to(tensor.device)
    return total


def any_rank(flag: bool, ranks: Ranks) -> bool:
    """True on every rank when ``flag`` is true on at least one."""
    return bool(all_reduce_sum(torch.tensor([float(flag)]), ranks).item() > 0)


def gather_objects(obj: Any, ranks: Ranks) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not ranks.distributed:
        return [obj]
    gathered: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


__all__ = ["DeviceError", "Ranks", "all_reduce_sum", "any_rank", "finish", "gather_objects",
           "start"]
