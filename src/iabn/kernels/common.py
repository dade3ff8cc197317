"""What every kernel backend and the layers above them share: a call's settings
(:class:`LayerConfig`), the effective scale ``g = scale(gamma)`` (``gamma_mode``), the dtypes
a layer computes in, per-channel views and casts, the scale ``g`` and shift of the
normalisation, the input gradient's per-channel coefficients and the last step of every
backward (chaining ``dg`` to ``dgamma``, casting to the inputs' dtypes).

Backend-neutral by construction: PyTorch operations on ``(C,)`` tensors, or on full-size ones
only where every backend's result passes through them (:func:`finish_grads`). The backends
(:mod:`.reference`, :mod:`.triton_backend`, :mod:`.traceable`) and the layers import these
from here, so no backend reaches into another one's private helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from .activations import ACTIVATIONS

# ------------------------------------------------------------------ the call's settings

class LayerConfig(NamedTuple):
    """What a norm + activation call computes, apart from its tensors.

    A ``NamedTuple``: immutable and hashable (usable as a cache key, e.g. for launch settings
    that depend on the options), and cheap to build and to pass through
    ``torch.autograd.Function.apply``, whose per-argument cost is measurable on small layers.
    The registered ``torch.library`` operators take the fields as scalars (their schema allows
    no Python objects) and convert at that boundary.
    """

    training: bool          # normalise with batch statistics (and update the running ones)
    momentum: float         # running-statistics factor (0 when not updating)
    eps: float              # added to the variance; the smallest |scale| of the in-place layer
    activation: str         # "leaky_relu", "elu", "identity" (and "relu" for ABN)
    activation_param: float  # leaky_relu's negative slope or elu's alpha
    gamma_mode: str         # "signed" or "abs" (the effective scale, below)
    variant: int = 2        # the paper's backward variant (1 or 2)

    def for_eval(self) -> LayerConfig:
        """The same layer normalising with given statistics, updating nothing (the synchronised
        layer's forward after its statistics are merged)."""
        return self._replace(training=False, momentum=0.0)


class GroupConfig(NamedTuple):
    """What a group norm + activation call computes, apart from its tensors (as
    :class:`LayerConfig`)."""

    num_groups: int
    eps: float
    activation: str
    activation_param: float
    gamma_mode: str


#: A layer norm (mean and variance) and an RMS norm (mean square only): ``RowConfig.kind``.
LAYER_NORM, RMS_NORM = "layer", "rms"


class RowConfig(NamedTuple):
    """What a layer or RMS norm call computes, apart from its tensors: each row of the
    trailing ``shape`` is normalised (with ``channels``, dim 1 of ``(N, C, *)`` instead, as
    ``InPlaceLayerNorm2d``); ``eps`` ``None`` is RMS norm's machine epsilon."""

    shape: tuple[int, ...]
    eps: float | None
    kind: str               # LAYER_NORM or RMS_NORM
    channels: bool


# ------------------------------------------------------------------ the effective scale
# g = scale(gamma) of the in-place layers (docs/design.md, "The math"). The in-place layer
# divides by g in backward, so g must stay away from zero. Two ways:
#
# "signed" (default)
#     g = sign(gamma) * max(|gamma|, eps) with sign(+0.0) = +1. Wherever |gamma| >= eps,
#     g == gamma: a state_dict trained with nn.BatchNorm loads and gives the same outputs.
#     The gradient passes straight through (dgamma = dg), so a gamma inside the clamp can
#     still move out of it.
# "abs"
#     g = |gamma| + eps, the parametrisation of the original inplace_abn package; use it to
#     load that package's checkpoints. dgamma = -dg where gamma < 0, else +dg: the
#     derivative of |gamma| taken as +1 at 0, as that package did, so a zero-initialised
#     gamma (e.g. TResNet's last BN of each residual branch) still trains.

SIGNED = "signed"
ABS = "abs"
GAMMA_MODES = (SIGNED, ABS)


def check_gamma_mode(gamma_mode: str) -> None:
    if gamma_mode not in GAMMA_MODES:
        raise ValueError(
            f"unknown gamma_mode={gamma_mode!r}: use 'signed' (weights portable to and from "
            f"nn.BatchNorm) or 'abs' (|gamma| + eps, as the original inplace_abn package)"
        )


def effective_scale(gamma: Tensor, eps: float, gamma_mode: str) -> Tensor:
    """Return ``g = scale(gamma)`` as a new tensor (no autograd through it)."""
    if gamma_mode == ABS:
        return gamma.abs() + eps
    # copysign keeps the sign bit, so sign(+0.0) = +1 (and a stored -0.0 gives -eps)
    return gamma.abs().clamp_(min=eps).copysign_(gamma)


def gamma_grad(dg: Tensor, gamma: Tensor, gamma_mode: str) -> Tensor:
    """Chain ``dL/dg`` back to ``dL/dgamma``."""
    if gamma_mode == ABS:
        return torch.where(gamma < 0, -dg, dg)
    return dg


def abs_sign(gamma: Tensor) -> Tensor:
    """The factor ``d|gamma|/dgamma`` of abs mode: -1 where ``gamma < 0``, else +1 (also at
    ``+0.0`` and ``-0.0``)."""
    return torch.where(gamma < 0, -1.0, 1.0).to(gamma.dtype)


# ------------------------------------------------------------------ shared helpers

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


def new_bits(x: Tensor, config: LayerConfig) -> Tensor | None:
    """The buffer a backend's forward fills with the branch bits of ``x`` (``ceil(numel / 8)``
    bytes) where the activation needs them (:mod:`.branch`), else ``None``."""
    if ACTIVATIONS[config.activation].minimum is None:
        return None
    return torch.empty((x.numel() + 7) // 8, dtype=torch.uint8, device=x.device)


# ------------------------------------------------------------------ parts of an activation
# A backward that computes in float32 for half inputs, or runs Newton's temporaries, cuts the
# activation into parts of whole channels (or rows), so that it holds a part's temporaries
# and not the whole activation's: the batch-norm, group-norm, row-norm and activation
# backwards of the reference backend all cut this way.

#: Parts a half-precision backward computing in float32 is cut into (:func:`pieces`): a
#: part's float32 ``z``, ``dz``, ``y``, ``dy``, ``dx`` and the activation's temporaries
#: (at most 6 x 4 bytes an element of the part) hold at most 1.5 bytes per element of the
#: whole when a part is at most 1/16 of it: under one activation in the input's dtype
#: (2 bytes an element).
PIECES = 16
#: Fewest elements of a part (4 MiB of float32): each part costs its operations' launches
#: again, which a layer of few elements would pay for little memory, so a tensor of fewer
#: than ``PIECES * MIN_PIECE`` elements is cut into fewer parts (one below twice this).
MIN_PIECE = 1 << 20


#: ``recover_piece(at, with_y) -> (y, dy)``: a piece's ``y`` (``None`` unless ``with_y``) and
#: ``dy`` in the compute dtype, for the index tuple ``at`` of :func:`pieces`.
RecoverPiece = Callable[[tuple, bool], tuple["Tensor | None", Tensor]]


def pieces(*tensors: Tensor, parts: int = PIECES) -> tuple[list[Tensor], list[tuple]]:
    """``(views, index)``: ``tensors`` (``(N, C, *spatial)``, one shape) seen as
    ``(N, C, L)`` (``L`` the spatial positions; as they are where some cannot be viewed so),
    and index tuples that cut them into parts of whole channels, each at most ``1 / parts``
    of the whole where the positions allow (and :data:`MIN_PIECE` elements allow): along
    ``N``, or with fewer samples than parts, along each sample's ``L`` too."""
    n, c = tensors[0].shape[:2]
    parts = part_count(tensors[0].numel(), parts)
    try:
        views = [t.view(n, c, -1) for t in tensors]
    except RuntimeError:  # spatial dims that do not flatten to a view: cut along N only
        views = list(tensors)
    if n >= parts or views[0].dim() != 3:
        return views, [(slice(a, b),) for a, b in at_most(n, parts)]
    per_sample = -(-parts // n)
    return views, [
        (slice(i, i + 1), slice(None), slice(a, b))
        for i in range(n) for a, b in at_most(views[0].shape[2], per_sample)
    ]


def part_count(numel: int, parts: int = PIECES) -> int:
    """How many parts :func:`pieces` aims at for ``numel`` elements: ``parts``, fewer where a
    part would have under :data:`MIN_PIECE` elements, at least one."""
    return max(1, min(parts, numel // MIN_PIECE))


def at_most(size: int, parts: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of consecutive ranges covering ``range(size)``, each at most
    ``size / parts`` long (at least 1): ``parts`` of them or up to twice as many."""
    step = max(1, size // parts)
    return [(a, min(a + step, size)) for a in range(0, size, step)]
