"""What every kernel backend and the layers above them share: the dtypes a layer computes in,
per-channel views and casts, the scale ``g`` and shift of the normalisation, the input
gradient's per-channel coefficients and the last step of every backward (chaining ``dg`` to
``dgamma``, casting to the inputs' dtypes).

Backend-neutral by construction: PyTorch operations on ``(C,)`` tensors, or on full-size ones
only where every backend's result passes through them (:func:`finish_grads`). The backends
(:mod:`.reference`, :mod:`.triton_backend`, :mod:`.traceable`) and the layers import these
from here, so no backend reaches into another one's private helpers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..scale import effective_scale, gamma_grad

# Host cost matters here: at small feature maps a layer's time is mostly Python and dispatch
# (benchmarks/host_overhead.py). Hence the resolved operator overload, cheaper than
# torch.ops.aten.native_batch_norm_backward's overload resolution on every call (measured on
# CPU: 3.5 vs 4.1 µs a backward).
BATCH_NORM_BACKWARD = torch.ops.aten.native_batch_norm_backward.default

#: Input dtypes whose statistics and backward are computed in float32.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def stat_dtype(x: Tensor, weight: Tensor | None, running_mean: Tensor | None) -> torch.dtype:
    """Dtype of the per-channel statistics: the parameters', else float32 for half inputs."""
    for t in (weight, running_mean):
        if t is not None:
            return t.dtype
    return torch.float32 if x.dtype in LOW_PRECISION else x.dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the backward's per-channel factors: float32 for half inputs."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def channel_view(v: Tensor, ndim: int) -> Tensor:
    """``(C,)`` -> ``(C, 1, ..., 1)`` so that it broadcasts against ``(N, C, *spatial)``."""
    return v.reshape(v.shape + (1,) * (ndim - 2))


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    # Tensor.to costs ~1 µs even when nothing changes; backward calls it ten times a layer.
    return t if t.dtype == dtype else t.to(dtype)


def effective_g(
    weight: Tensor | None, eps: float, gamma_mode: str, channels: int, dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """``g`` ``(C,)`` in ``dtype``: ``scale(weight)``, or ones without affine parameters."""
    if weight is not None:
        return effective_scale(cast(weight, dtype), eps, gamma_mode)
    return torch.ones(channels, dtype=dtype, device=device)


def running_invstd(running_var: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """``1 / sqrt(running_var + eps)`` in ``dtype``: the eval-mode normalisation's."""
    return torch.add(cast(running_var, dtype), eps).rsqrt_()


def empty_invstd(
    training: bool, running_var: Tensor | None, eps: float, channels: int, dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """``invstd`` of a zero-size input: the running statistics' where they normalise, else NaN
    (there are no batch statistics). Backward of an empty input reads neither value."""
    if training or running_var is None:
        return torch.full((channels,), float("nan"), dtype=dtype, device=device)
    return running_invstd(running_var, eps, dtype)


def scale_and_shift(
    weight: Tensor | None, bias: Tensor | None, eps: float, gamma_mode: str, channels: int,
    dtype: torch.dtype, device: torch.device,
) -> tuple[Tensor, Tensor]:
    """``(g, beta)`` ``(C,)`` in ``dtype``: ``scale(weight)`` and ``bias``, or 1 and 0."""
    g = effective_g(weight, eps, gamma_mode, channels, dtype, device)
    beta = (
        cast(bias, dtype) if bias is not None
        else torch.zeros(channels, dtype=dtype, device=device)
    )
    return g, beta


def is_dense_format(t: Tensor) -> bool:
    """True when ``t`` is contiguous, ``channels_last`` (4-D) or ``channels_last_3d`` (5-D):
    the layouts PyTorch's batch-norm kernels write in place and that fill their storage."""
    if t.is_contiguous():
        return True
    if t.dim() == 4:
        return t.is_contiguous(memory_format=torch.channels_last)
    return t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)


def dx_coefficients(
    scale: Tensor, invstd: Tensor, bias: Tensor | None, sums: Tensor, count: Tensor | int,
    dtype: torch.dtype,
) -> Tensor:
    """``(k1, k2, k3)`` ``(3, C)`` in ``dtype`` of ``dx = k1 * dy + k2 * y + k3``, which is
    ``g * invstd * (dy - xhat * sum(dy * xhat) / n - sum(dy) / n)`` from ``sums`` =
    ``[sum(dy * xhat), sum(dy)]`` over ``count`` (``n``) values per channel (over all ranks
    for the synchronised layer)."""
    g, invstd = cast(scale, dtype), cast(invstd, dtype)
    beta = cast(bias, dtype) if bias is not None else torch.zeros_like(g)
    sum_dy_xhat, sum_dy = cast(sums, dtype)
    return torch.stack([
        g * invstd,
        -invstd * sum_dy_xhat / count,
        invstd * (beta * sum_dy_xhat - g * sum_dy) / count,
    ])


def empty_grads(
    z: Tensor, weight: Tensor | None, bias: Tensor | None, output_mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of a zero-size input, as ``nn.BatchNorm`` gives them: an empty ``dx`` and
    zero parameter gradients (sums over no values). ATen's batch-norm backward is not called:
    with no samples (N = 0) its CPU kernel divides an integer by zero, which kills the process
    with SIGFPE."""
    want_dx, want_dgamma, want_dbeta = output_mask
    return (
        torch.empty_like(z) if want_dx else None,
        torch.zeros_like(weight) if want_dgamma and weight is not None else None,
        torch.zeros_like(bias) if want_dbeta and bias is not None else None,
    )


def finish_grads(
    dx: Tensor | None, dg: Tensor | None, dbeta: Tensor | None, z: Tensor,
    weight: Tensor | None, bias: Tensor | None, gamma_mode: str, output_mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Chain ``dg`` to ``dgamma``, drop what was not asked for, cast to the inputs' dtypes."""
    _, want_dgamma, want_dbeta = output_mask
    if dx is not None:
        dx = cast(dx, z.dtype)
    dgamma = None
    if want_dgamma and weight is not None and dg is not None:
        dgamma = cast(gamma_grad(dg, cast(weight, dg.dtype), gamma_mode), weight.dtype)
    keep_dbeta = want_dbeta and bias is not None and dbeta is not None
    return dx, dgamma, cast(dbeta, bias.dtype) if keep_dbeta else None
