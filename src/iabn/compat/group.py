"""``inplace_abn.group`` of the original package: ``active_group`` and ``set_active_group``."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..distributed.groups import active_group


def set_active_group(module: nn.Module, group: Any) -> None:
    """Call ``set_group(group)`` on every submodule that has it (the sync layers)."""
    for m in module.modules():
        if hasattr(m, "set_group"):
            m.set_group(group)


__all__ = ["active_group", "set_active_group"]
