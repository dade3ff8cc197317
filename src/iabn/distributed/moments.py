"""The statistics of the union of all ranks' batches, around the synchronised layer's
all-gather (no communication here): each rank's :func:`local_moments` -> all-gather ->
:func:`merge_moments` -> the running statistics' update, :func:`update_running_stats_`.
The merged statistics are float64, so that merging many ranks' moments loses nothing
(docs/design.md, "Synchronised layers").
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.common import cast, compute_dtype

MERGE_DTYPE = torch.float64


def local_moments(x: Tensor) -> Tensor:
    """``(count, mean_1..C, var_1..C)`` of this rank as one float64 vector of ``2C + 1``.

    ``var`` is biased (divided by the local count). A rank without samples reports zeros, so
    it still contributes a well-formed row to the all-gather.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    moments = torch.zeros(2 * channels + 1, dtype=MERGE_DTYPE, device=x.device)
    moments[0] = count
    if count:
        # ATen's batch-norm statistics kernel (mean and biased variance, no running update
        # without buffers): ~5x faster on CPU than torch.var_mean. It returns the input's
        # dtype, so half inputs are widened first.
        mean, var = torch.batch_norm_update_stats(
            cast(x, compute_dtype(x.dtype)), None, None, 0.0
        )
        moments[1 : channels + 1] = mean
        moments[channels + 1 :] = var
    return moments


def merge_moments(gathered: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Chan's parallel merge of ``(world, 2C + 1)`` rows -> ``(total count, mean, var)``.

    ``var`` is the biased variance of the union of all ranks' values. The total count stays a
    0-d tensor on the device: reading it on the host would wait for the device (a host
    synchronisation every step).
    """
    channels = (gathered.shape[1] - 1) // 2
    counts = gathered[:, :1]
    means, variances = gathered[:, 1 : channels + 1], gathered[:, channels + 1 :]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    m2 = (counts * (variances + (means - mean) ** 2)).sum(0)
    return total, mean, m2 / total


def update_running_stats_(
    running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, total: Tensor,
    momentum: float,
) -> None:
    """``nn.BatchNorm``'s update with the merged statistics (unbiased variance)."""
    unbiased = var * (total / (total - 1))
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
