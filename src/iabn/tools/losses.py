"""Segmentation losses: cross entropy with online bootstrapping (hard pixel mining).

Per crop (one image of the batch) only the hardest ``top_fraction`` of its valid pixels — those
with the highest per-pixel cross entropy — contribute, so the easy majority (large uniform
regions) does not drown the few hard pixels (boundaries, small objects). The loss is the mean
over every kept pixel of the batch, so it is ordinary cross entropy when ``top_fraction=1``.

Crop with ``v`` valid pixels keeps ``ceil(top_fraction * v)`` of them (at least one when it has
any). A crop with no valid pixel keeps none; a batch with no valid pixel at all has loss 0 (with
a zero gradient), not the NaN that ``F.cross_entropy``'s mean gives there, so one fully ignored
batch cannot poison the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _check(logits: Tensor, target: Tensor, top_fraction: float) -> None:
    if not 0.0 < top_fraction <= 1.0:
        raise ValueError(f"top_fraction={top_fraction}: must be in (0, 1] (1 = plain "
                         f"cross entropy over the valid pixels)")
    if logits.dim() < 3:
        raise ValueError(f"logits of shape {tuple(logits.shape)}: expected [N, C, *spatial] "
                         f"(one crop per row of the batch)")
    if target.shape != logits.shape[:1] + logits.shape[2:]:
        raise ValueError(f"target of shape {tuple(target.shape)} does not match logits "
                         f"{tuple(logits.shape)}: expected [N, *spatial] = "
                         f"{tuple(logits.shape[:1] + logits.shape[2:])}")
    if target.is_floating_point() or target.is_complex():
        raise ValueError(f"target has dtype {target.dtype}: class ids must be an integer "
                         f"tensor (torch.long)")


def bootstrapped_cross_entropy(logits: Tensor, target: Tensor, top_fraction: float = 0.25,
                               ignore_index: int = 255) -> Tensor:
    """Mean cross entropy of the hardest ``top_fraction`` of each crop's valid pixels.

    Args:
        logits: ``[N, C, *spatial]`` unnormalised class scores.
        target: ``[N, *spatial]`` integer class ids; ``ignore_index`` marks void pixels.
        top_fraction: share of each crop's valid pixels kept, in ``(0, 1]``.
        ignore_index: the target value of pixels that never count.

    Returns a scalar (see the module doc for crops and batches without valid pixels).
    """
    _check(logits, target, top_fraction)
    per_pixel = F.cross_entropy(logits, target.long(), ignore_index=ignore_index,
                                reduction="none").flatten(1)
    # sum in fp32 at least: a half-precision sum over a crop's pixels would lose the small ones
    per_pixel = per_pixel.to(torch.promote_types(per_pixel.dtype, torch.float32))
    valid = (target != ignore_index).flatten(1)
    # per crop, in float64 as Python's math.ceil(top_fraction * v); 0 without valid pixels
    keep = torch.ceil(valid.sum(1).double() * top_fraction).long()
    most = int(keep.max())  # one host sync: topk needs a Python k
    if most == 0:
        return per_pixel.sum() * 0.0  # no valid pixel: 0, with a graph for backward
    # Ignored pixels sort last (cross entropy is >= 0), so a crop's first keep[i] values are
    # its keep[i] hardest valid pixels.
    hardest = per_pixel.masked_fill(~valid, -1.0).topk(most, dim=1).values
    chosen = torch.arange(most, device=keep.device) < keep[:, None]
    return hardest[chosen].sum() / keep.sum()


class BootstrappedCrossEntropy(nn.Module):
    """:func:`bootstrapped_cross_entropy` as a module: ``loss(logits, target)``."""

    def __init__(self, top_fraction: float = 0.25, ignore_index: int = 255) -> None:
        super().__init__()
        if not 0.0 < top_fraction <= 1.0:  # fail when built, not at the first batch
            raise ValueError(f"top_fraction={top_fraction}: must be in (0, 1]")
        self.top_fraction, self.ignore_index = top_fraction, ignore_index

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return bootstrapped_cross_entropy(logits, target, self.top_fraction, self.ignore_index)

    def extra_repr(self) -> str:
        return f"top_fraction={self.top_fraction}, ignore_index={self.ignore_index}"


__all__ = ["BootstrappedCrossEntropy", "bootstrapped_cross_entropy"]
