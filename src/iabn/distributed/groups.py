"""Which ranks a synchronised layer normalises over: the process group a step uses
(:func:`resolve_group`, :func:`group_to_sync`) and the one helper that builds a group of the
ranks that have data (:func:`active_group`)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

_warned_single_process = False
#: the groups :func:`active_group` made, by member set: torch.distributed.new_group is a
#: collective call that every rank must make, so a group is made once and reused
_active_groups: dict[frozenset[int], Any] = {}


def resolve_group(group: Any = None) -> Any | None:
    """The process group to synchronise over now, or ``None`` when there is nothing to sync
    with (``torch.distributed`` unavailable or not initialised, or a group of one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if group is None else group
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        raise RuntimeError(
            "this rank is not a member of the process group given to InPlaceABNSync: create "
            "the layer with a group that contains every rank that runs it"
        )
    return group if dist.get_world_size(group) > 1 else None


def _warn_single_process() -> None:
    global _warned_single_process
    if not _warned_single_process:
        _warned_single_process = True
        warnings.warn(
            "InPlaceABNSync runs without a torch.distributed process group of more than one "
            "rank, so it normalises with this process's batch only (like InPlaceABN). Call "
            "torch.distributed.init_process_group first (e.g. under torchrun) to synchronise.",
            stacklevel=3,
        )


def group_to_sync(group: Any, training: bool) -> Any | None:
    """The group a step synchronises over: none in eval mode; in training, none (with the
    one-time warning) when there is no multi-rank process group."""
    if not training:
        return None
    resolved = resolve_group(group)
    if resolved is None:
        _warn_single_process()
    return resolved


def active_group(active: bool) -> Any:
    """A process group of the ranks that pass ``active=True`` (e.g. those that have data):
    the world group when all do, ``None`` when none does. Every rank of the world must call
    it, with its own flag: the flags are all-gathered, so every rank then calls
    ``torch.distributed.new_group`` with the same members, as it requires. Inactive ranks get
    ``GroupMember.NON_GROUP_MEMBER`` and must not run the synchronised layers with it. A group
    is made once per member set and reused."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    mine = torch.tensor(rank if active else -1, dtype=torch.long, device=device)
    everyone = torch.empty(world_size, dtype=torch.long, device=device)
    dist.all_gather(list(everyone.unbind(0)), mine)
    members = frozenset(int(r) for r in everyone.tolist() if r != -1)
    if not members:
        return None
    if len(members) == world_size:
        return dist.group.WORLD
    if members not in _active_groups:
        _active_groups[members] = dist.new_group(sorted(members))
    return _active_groups[members]


__all__ = ["active_group", "group_to_sync", "resolve_group"]
