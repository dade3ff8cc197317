"""Math of the synchronised layer, split around its two collectives (no communication here).

Forward: :func:`local_moments` -> (all-gather) -> :func:`merge_moments` ->
:func:`normalize_` with the merged statistics (on the kernels the caller passes, those
:mod:`.dispatch` picks; this module does not import the dispatcher, which imports it).
Backward: :func:`local_sums` -> (all-reduce) -> :func:`input_grad`; the Triton backend has both
with the same interface (:mod:`.triton_backend`). Per-channel tensors are ``(C,)``; merged
statistics are float64 so that the merge of many ranks' moments loses nothing (docs/design.md,
"Synchronised layers").
"""

from __future__ import annotations

from types import ModuleType
from typing import NamedTuple

import torch
from torch import Tensor

from ..layer_config import LayerConfig
from .reference import (
    LOW_PRECISION,
    RecoverPiece,
    _cast,
    channel_view,
    compute_dtype,
    dx_coefficients,
    input_grad_over_pieces,
    recover,
    recovery,
    stat_dtype,
    sums_over_pieces,
)

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
            _cast(x, compute_dtype(x.dtype)), None, None, 0.0
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


def normalize_(
    kernels: ModuleType,
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    mean: Tensor,
    var: Tensor,
    config: LayerConfig,
) -> tuple[Tensor, Tensor]:
    """Overwrite ``x`` with ``phi(g * (x - mean) / sqrt(var + eps) + beta)``; return
    ``(invstd, g)``: the single-process forward in eval mode of ``kernels`` (a backend module
    from :mod:`.dispatch`), with the merged statistics standing in for the running ones."""
    sdtype = stat_dtype(x, weight, None)
    return kernels.forward_(x, weight, bias, mean.to(sdtype), var.to(sdtype), config.for_eval())


def update_running_stats_(
    running_mean: Tensor, running_var: Tensor, mean: Tensor, var: Tensor, total: Tensor,
    momentum: float,
) -> None:
    """``nn.BatchNorm``'s update with the merged statistics (unbiased variance)."""
    unbiased = var * (total / (total - 1))
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


class Recovered(NamedTuple):
    """What :func:`input_grad` needs of a half-precision backward: ``z``, whose float32 ``y``
    and ``dy`` it recomputes piece by piece with ``recover_piece`` (``index`` and
    ``recover_piece`` as :func:`.reference.grads_over_pieces` takes them: from
    :func:`.reference.recovery`, or for silu/gelu with the branch bits from
    :func:`iabn.branch_activation.recovery`)."""

    z: Tensor
    index: list[tuple]
    recover_piece: RecoverPiece


def local_sums(
    z: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor, config: LayerConfig,
) -> tuple[tuple[Tensor, Tensor] | Recovered, Tensor]:
    """``(saved, sums)`` with ``sums = [sum(dy * xhat), sum(dy)]`` stacked ``(2, C)`` and
    ``saved`` what :func:`input_grad` needs: ``(y, dy)`` as scratch tensors (see
    :func:`reference.recover`), valid until the next backward on this thread; for half
    inputs, whose ``y`` and ``dy`` are float32, :class:`Recovered` (nothing full-size in float32
    is kept across the all-reduce, or made)."""
    activation, activation_param = config.activation, config.activation_param
    if z.numel() and z.dtype in LOW_PRECISION:
        index, recover_piece = recovery(z, dz, bias, scale, activation, activation_param)
        sums = sums_over_pieces(index, recover_piece, scale, bias, compute_dtype(z.dtype))
        return Recovered(z, index, recover_piece), sums
    y, dy, g, beta = recover(z, dz, bias, scale, activation, activation_param)
    if not z.numel():
        return (y, dy), torch.zeros(2, g.shape[0], dtype=g.dtype, device=z.device)
    return (y, dy), sums_from_y(y, dy, g, beta)


def sums_from_y(y: Tensor, dy: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """``[sum(dy * xhat), sum(dy)]`` stacked ``(2, C)`` from the whole ``y`` and ``dy``."""
    # The reductions of the batch-norm backward, with the identity of reference.py.
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        dy, y, g, None, None, beta, g.reciprocal(), True, 0.0, [False, True, True],
    )
    return torch.stack([sum_dy_xhat, sum_dy])


def input_grad(
    saved: tuple[Tensor, Tensor] | Recovered, bias: Tensor | None, scale: Tensor,
    invstd: Tensor, global_sums: Tensor, total: Tensor, out_dtype: torch.dtype,
) -> Tensor:
    """``dx`` from :func:`local_sums`' ``saved`` and the sums over all ranks."""
    if isinstance(saved, Recovered):
        k1, k2, k3 = dx_coefficients(scale, invstd, bias, global_sums, total,
                                     compute_dtype(saved.z.dtype))
        return input_grad_over_pieces(saved.z, saved.index, saved.recover_piece, k1, k2, k3)
    y, dy = saved
    ndim = y.dim()
    k1, k2, k3 = dx_coefficients(scale, invstd, bias, global_sums, total, y.dtype)
    dx = torch.addcmul(channel_view(k3, ndim), dy, channel_view(k1, ndim))
    dx.addcmul_(y, channel_view(k2, ndim))
    return _cast(dx, out_dtype)
