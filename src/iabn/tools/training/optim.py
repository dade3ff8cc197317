"""Optimizers from the ``optimizer`` config section: SGD (Nesterov), Adam, AdamW.

Weight decay is left off the weights and biases of normalisation layers (``nn.BatchNorm*``,
iabn's ``ABN``/``InPlaceABN``/``InPlaceABNSync``, ``GroupNorm``, ``LayerNorm``) unless
``weight_decay_norm`` is true: shrinking a norm's scale towards zero only fights the next
layer's weights, as the original training scripts noted.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

NORM_TYPES = (_NormBase, nn.GroupNorm, nn.LayerNorm)


def parameter_groups(model: nn.Module, weight_decay: float,
                     decay_norm: bool) -> list[dict[str, Any]]:
    """``[{"params": decayed, "weight_decay": weight_decay}, {"params": norm parameters,
    "weight_decay": 0}]``; the second group is left out when empty or when ``decay_norm``."""
    norm_ids: set[int] = set()
    if not decay_norm:
        for module in model.modules():
            if isinstance(module, NORM_TYPES):
                norm_ids.update(id(p) for p in module.parameters(recurse=False))
    decayed, exempt = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (exempt if id(parameter) in norm_ids else decayed).append(parameter)
    groups = [{"params": decayed, "weight_decay": weight_decay}]
    if exempt:
        groups.append({"params": exempt, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, section: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer of an ``optimizer`` config section for ``model``'s parameters."""
    groups = parameter_groups(model, section["weight_decay"], section["weight_decay_norm"])
    kind, lr = section["type"], section["lr"]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=section["momentum"],
                               nesterov=section["nesterov"] and section["momentum"] > 0)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return cls(groups, lr=lr, betas=tuple(section["betas"]), eps=section["eps"])


__all__ = ["NORM_TYPES", "build_optimizer", "parameter_groups"]
