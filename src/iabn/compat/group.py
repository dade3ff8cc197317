"""``inplace_abn.group`` of the original package: ``active_group`` and ``set_active_group``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_groups: dict[frozenset[int], Any] = {}


def active_group(active: bool) -> Any:
    """A process group of the ranks that pass ``active=True`` (every rank must call it), the
    world group when all do, ``None`` when none does. Groups are created once and cached."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
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
    if members not in _groups:
        _groups[members] = dist.new_group(sorted(members))
    return _groups[members]


def set_active_group(module: nn.Module, group: Any) -> None:
    """Call ``set_group(group)`` on every submodule that has it (the sync layers)."""
    for m in module.modules():
        if hasattr(m, "set_group"):
            m.set_group(group)


__all__ = ["active_group", "set_active_group"]
