"""Loading checkpoints of the original ``inplace_abn`` package into iabn's models.

Those files store ``{"state_dict": {"module.<key>": tensor}}`` (ImageNet models) or
``{"state_dict": {"body": ..., "head": ..., "cls": ...}}`` (the Vistas segmentation model), were
saved before ``num_batches_tracked`` existed, and computed with ``|weight| + eps`` as the scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..modules import ABN
from ..scale import ABS


@dataclass
class LoadReport:
    """What :func:`load_original` did: keys it could not fill, and keys nobody wanted."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.shape_mismatches)

    def __str__(self) -> str:
        if self.ok:
            return "all keys matched"
        parts = []
        for title, keys in (("missing", self.missing), ("unexpected", self.unexpected),
                            ("shape mismatch", self.shape_mismatches)):
            if keys:
                shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8
                                               else "")
                parts.append(f"{title}: {shown}")
        return "; ".join(parts)


def original_state_dict(checkpoint: Mapping[str, Any] | str | Path,
                        section: str | None = None) -> dict[str, Tensor]:
    """The flat state_dict inside an original checkpoint (a path or an already loaded dict),
    ``module.`` prefixes removed; ``section`` picks ``body``/``head``/``cls`` of a Vistas
    snapshot."""
    if not isinstance(checkpoint, Mapping):
        path = Path(checkpoint)
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # a clear message naming the file, whatever torch raised
            raise ValueError(f"cannot read checkpoint {path}: {error}") from error
    state = checkpoint.get("state_dict", checkpoint)
    if section is not None:
        if section not in state:
            raise KeyError(f"checkpoint has no section {section!r}; it has {sorted(state)}")
        state = state[section]
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_original(model: nn.Module, checkpoint: Mapping[str, Any] | str | Path,
                  section: str | None = None, strict: bool = True) -> LoadReport:
    """Load an original-package checkpoint into ``model`` so that it computes what the
    original did: every iabn norm layer switches to ``gamma_mode="abs"`` (the parametrisation
    the weights were trained with); a plain ``nn.BatchNorm2d`` (``norm_act="bn"``) gets
    ``|weight| + eps`` as its weight instead.

    Missing ``num_batches_tracked`` entries are filled with 0. With ``strict=True`` any other
    missing, unexpected or mis-shaped key raises a ``ValueError`` listing them, before the
    model is touched; with ``strict=False`` the matching keys are loaded and the report says
    what was left out.
    """
    state = original_state_dict(checkpoint, section)
    own = model.state_dict()
    report = LoadReport()
    for key, value in own.items():
        if key not in state:
            if key.endswith("num_batches_tracked"):
                state[key] = torch.zeros_like(value)
            else:
                report.missing.append(key)
        elif tuple(state[key].shape) != tuple(value.shape):
            report.shape_mismatches.append(
                f"{key} {tuple(state[key].shape)} vs {tuple(value.shape)}")
    report.unexpected = [key for key in state if key not in own]
    if strict and not report.ok:
        raise ValueError(f"checkpoint does not fit {type(model).__name__}: {report}")
    usable = {k: v for k, v in state.items()
              if k in own and tuple(v.shape) == tuple(own[k].shape)}
    model.load_state_dict(usable, strict=False)
    for module in model.modules():
        if isinstance(module, ABN):
            module.gamma_mode = ABS
        elif isinstance(module, nn.BatchNorm2d) and module.weight is not None:
            with torch.no_grad():
                module.weight.copy_(module.weight.abs() + module.eps)
    return report
