"""SiLU and GELU in the in-place layer, with one saved bit per element (docs/design.md, "SiLU
and GELU in place").

``silu(y) = y * sigmoid(y)`` and ``gelu(y) = y * Phi(y)`` (exact, erf form) are not
invertible: each falls to one minimum ``z* = phi(y*)`` and rises again, so every output
``z* < z < 0`` comes from two inputs. Forward keeps, besides ``z``, the bit ``y < y*`` of every
element, packed eight to a byte (``uint8``, 1/32 of a float32 activation); backward recovers
``y`` on that branch by a fixed number of Newton steps in the compute dtype (float32 for half
inputs), takes ``dy = phi'(y) dz`` and the batch-norm gradients from ``y`` exactly as the
reference kernels do (:func:`iabn.kernels.reference.grads_from_y`).

An ``autograd.Function`` of its own, like :mod:`iabn.group_norm` (the ``iabn::`` operators
carry no bits). On the reference kernels its forward and backward are the ATen operations
here; with ``IABN_BACKEND=triton`` they are the Triton kernels' (their normalisation, bits
and this module's Newton steps in one pass each: :mod:`iabn.kernels.triton_kernels`), with
the constants and step counts of this module. The synchronised layer
(:mod:`iabn.distributed.function`) keeps the same bits: :func:`forward_` with the merged
statistics is its forward, :func:`sync_local_sums` the half of its backward before the
all-reduce.

The Newton steps. Near the minimum ``phi(y) - z* ~ c (y - y*)^2 / 2`` (``c = phi''(y*)``), so
Newton on ``phi`` itself stalls there; it runs on functions that are close to linear across
the minimum instead:

- right branch (``y >= y*``): ``G(y) = sqrt(phi(y) - z*) = sqrt(z - z*)``, from
  ``y0 = max(y* + sqrt(2 (z - z*) / c), z)``;
- left branch (``y < y*``, ``z* < z < 0``): ``H(y) = sqrt(log(z* / phi(y))) = sqrt(log(z* / z))``
  with ``log(-phi(y))`` formed as ``log(-y) + log sigmoid(y)`` (``log Phi(y)``), exact in the
  tail where ``z`` is tiny, from ``y0 = y* - H / |H'(y*)|`` (SiLU: or ``y* - H^2`` where that
  is further out: its tail is ``H^2 ~ -y``).

Each step is clamped to its branch; ``invert`` has the details that make float32 exact near
the minimum (``z*`` in two parts, ``log1p``, a Taylor series of ``phi - z*``). Four steps in
float32 and five in float64 reach the float64 inverse of the stored ``z`` (measured over ``y``
in [-80, 30] and 1e-9 .. 1 from ``y*``: at most 3.7e-7 relative in float32, 2.9e-8 within
0.05 of ``y*``; 4e-15 in float64 away from the minimum).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernels import activations as act
from .kernels import reference
from .kernels.backend import KernelBackend
from .kernels.common import compute_dtype, empty_grads
from .kernels.dispatch import backend_for
from .layer_config import LayerConfig
from .ops import needs_grad as layer_needs_grad
from .ops import overwritable, refuse_double_backward

#: Newton steps per compute dtype (float32 also for half inputs); measured, see above.
ITERATIONS = {torch.float32: 4, torch.float64: 5}
#: ``(y*, z*, c)`` per activation with one minimum: where ``phi' = 0``, ``phi(y*)`` and
#: ``c = phi''(y*)`` (the registry's :class:`~iabn.kernels.activations.Minimum`). Plain
#: floats: the compiler traces them as constants.
MINIMA = {name: (act.ACTIVATIONS[name].minimum.y_star, act.ACTIVATIONS[name].minimum.z_star,
                 act.ACTIVATIONS[name].minimum.curvature) for name in act.BRANCH_ACTIVATIONS}
#: ``phi(y* + u) - z* = sum_k a_k u^k``, ``k = 2..10``: the Taylor coefficients
#: ``phi^(k)(y*) / k!`` (float64, from torch's own derivatives; checked by the tests). Within
#: ``|u| <= 0.3`` they give ``phi - z*`` to 1e-9 of itself where float32 evaluation of
#: ``phi`` leaves an absolute error of ``z*``'s rounding, which the square root near the
#: minimum turns into errors in ``y`` of sqrt(eps) (measured: 5x the weight-gradient error of
#: the exact float64 inverse of the stored float32 ``z`` without them, 1.0-1.3x with them).
TAYLOR = {name: act.ACTIVATIONS[name].minimum.taylor for name in act.BRANCH_ACTIVATIONS}
TAYLOR_RADIUS = 0.3


def value(y: Tensor, activation: str) -> Tensor:
    """``phi(y)`` as a new tensor, accurate in the left tail (the registry's
    :attr:`~iabn.kernels.activations.Minimum.value`)."""
    return act.ACTIVATIONS[activation].minimum.value(y)


def apply_(x: Tensor, activation: str) -> Tensor:
    """``x <- phi(x)``; half inputs are computed in float32 and rounded once."""
    return act.ACTIVATIONS[activation].minimum.apply_(x)


def derivative(y: Tensor, activation: str) -> Tensor:
    """``phi'(y)``."""
    return act.ACTIVATIONS[activation].minimum.derivative(y)


def minimum(activation: str) -> tuple[float, float, float]:
    """``(y*, z*, c)`` of ``activation`` (:data:`MINIMA`)."""
    return MINIMA[activation]


def _log_neg(y: Tensor, activation: str) -> Tensor:
    """``log(-phi(y))`` for ``y < 0``, exact where ``phi(y)`` is tiny."""
    return torch.log(-y).add_(act.ACTIVATIONS[activation].minimum.log_tail(y))


def _log_neg_derivative(y: Tensor, activation: str) -> Tensor:
    return act.ACTIVATIONS[activation].minimum.log_tail_derivative(y).add_(y.reciprocal())


def invert(z: Tensor, left: Tensor, activation: str, stored: torch.dtype) -> Tensor:
    """``y`` with ``phi(y) = z`` on the branch ``left`` (``y < y*``) names, in ``z``'s dtype.

    ``stored``: the dtype ``z`` was rounded to. A left-branch ``z`` that underflowed to 0 is
    taken as the smallest subnormal of that dtype: ``y`` then is the point below which every
    output rounds to 0 (docs/design.md: the bound)."""
    y_star, z_star, c = minimum(activation)
    info = torch.finfo(z.dtype)
    # below this, G and H are dominated by the rounding of z: use their slope at y*
    floor = 4 * math.sqrt(info.eps)
    smallest = torch.finfo(stored).tiny * torch.finfo(stored).eps
    slope_right = math.sqrt(c / 2)
    slope_left = math.sqrt(c / (2 * -z_star))
    log_star = math.log(-z_star)
    # z* in two parts: z - z_hi is exact near z* (Sterbenz), so z* rounded to z's dtype does
    # not shift every target near the minimum by the same amount (measured in float32: 8x
    # the weight-gradient error of the exact inverse, 1.0x with the split)
    z_hi = float(torch.tensor(z_star, dtype=z.dtype))
    z_lo = z_star - z_hi

    def above_minimum(f: Tensor) -> Tensor:
        return (f - z_hi).sub_(z_lo)

    y_hi = float(torch.tensor(y_star, dtype=z.dtype))
    y_lo = y_star - y_hi
    series = TAYLOR[activation] if z.dtype == torch.float32 else None

    def phi_above_minimum(y: Tensor) -> tuple[Tensor, Tensor]:
        """``(phi(y), phi(y) - z*)``, the latter from the Taylor series near y* (float32)."""
        f = value(y, activation)
        d = above_minimum(f)
        if series is None:
            return f, d
        u = (y - y_hi).sub_(y_lo)
        poly = torch.full_like(u, series[-1])
        for coefficient in series[-2::-1]:
            poly.mul_(u).add_(coefficient)
        poly.mul_(u).mul_(u)
        return f, torch.where(u.abs() <= TAYLOR_RADIUS, poly, d)

    def log_ratio(f: Tensor, d: Tensor, log_f: Tensor | None) -> Tensor:
        # log(z* / f) for z* <= f < 0: log1p(d / -f) near the minimum, where it is exact;
        # log(-z*) - log(-f) in the tail, where d / -f grows without bound
        ratio = d / -f
        tail = log_star - (torch.log(-f) if log_f is None else log_f)
        return torch.where(ratio <= 1, torch.log1p(ratio), tail).clamp_(min=0)

    # right branch: G(y) = sqrt(phi(y) - z*) = target_r
    target_r = above_minimum(z).clamp_(min=0).sqrt_()
    y_r = torch.maximum(target_r / slope_right + y_star, z)
    # left branch: H(y) = sqrt(log(z* / phi(y))) = target_l
    z_left = z.clamp(min=z_star, max=-smallest)
    target_l = log_ratio(z_left, above_minimum(z_left).clamp_(min=0), None).sqrt_()
    y_l = y_star - target_l / slope_left
    if act.ACTIVATIONS[activation].minimum.exponential_tail:
        y_l = torch.minimum(y_l, y_star - target_l.square())
    for _ in range(ITERATIONS[z.dtype]):
        g = phi_above_minimum(y_r)[1].clamp_(min=0).sqrt_()
        g_slope = derivative(y_r, activation) / (2 * g).clamp_(min=info.tiny)
        g_slope = torch.where(g > floor, g_slope, slope_right)
        y_r = (y_r - (g - target_r) / g_slope).clamp_(min=y_star)
        f, d = phi_above_minimum(y_l)
        f = f.clamp_(max=-info.tiny)
        h = log_ratio(f, d.clamp_(min=0), _log_neg(y_l, activation)).sqrt_()
        h_slope = _log_neg_derivative(y_l, activation) / (-2 * h).clamp_(max=-info.tiny)
        h_slope = torch.where(h > floor, h_slope, -slope_left)
        y_l = (y_l - (h - target_l) / h_slope).clamp_(max=y_star)
    return torch.where(left, y_l, y_r)


# ------------------------------------------------------------------ the branch bits

def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(mask: Tensor) -> Tensor:
    """A bool tensor as ``uint8`` bytes, eight elements each in its logical (contiguous)
    order, the last byte padded with zeros: ``ceil(numel / 8)`` bytes."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = F.pad(flat, (0, pad))
    return flat.view(-1, 8).mul_(_bit_weights(mask.device)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, shape: torch.Size) -> Tensor:
    """The inverse of :func:`pack_bits`: a contiguous bool tensor of ``shape``."""
    bits = packed.unsqueeze(-1).bitwise_and(_bit_weights(packed.device)).ne(0)
    return bits.reshape(-1)[: math.prod(shape)].view(shape)


# ------------------------------------------------------------------ the layer

def _triton_branch(kernels: KernelBackend, z: Tensor, activation: str,
                  bits: Tensor) -> Any:
    """The Triton kernels' :class:`~iabn.kernels.triton_backend.Branch` of a layer whose
    output is (or will be) ``z``: its bits, the constants of ``activation`` in the compute
    dtype, and this module's Newton steps."""
    compute = compute_dtype(z.dtype)
    consts = kernels.branch_constants(MINIMA[activation], TAYLOR[activation], compute, z.dtype,
                                      z.device,
                                      act.ACTIVATIONS[activation].minimum.exponential_tail)
    return kernels.Branch(bits, consts, ITERATIONS[compute], compute == torch.float32)


def forward_(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, config: LayerConfig, bits: bool,
    kernels: KernelBackend = reference,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Overwrite ``x`` with ``phi(y)``; return ``(invstd, g, packed bits or None)``.

    ``kernels``: :mod:`iabn.kernels.reference` (the reference normalisation, then ``y``
    compared with ``y*`` in ``x``'s dtype, as the activation then reads it; bits in logical
    order, :func:`pack_bits`) or the Triton backend (one fused pass; ``y`` compared in the
    compute dtype; bits in the order of ``x``'s memory, which only its backward reads)."""
    if kernels is not reference and x.numel():
        packed = torch.empty((x.numel() + 7) // 8, dtype=torch.uint8, device=x.device)
        invstd, g = kernels.forward_(x, weight, bias, running_mean, running_var, config,
                                     _triton_branch(kernels, x, config.activation, packed))
        return invstd, g, packed if bits else None
    invstd, g = reference.forward_(
        x, weight, bias, running_mean, running_var, config._replace(activation=act.IDENTITY)
    )
    packed = pack_bits(x < minimum(config.activation)[0]) if bits else None
    apply_(x, config.activation)
    return invstd, g, packed


def recovery(z: Tensor, packed: Tensor, dz: Tensor, activation: str) -> tuple[
    list[tuple], reference.RecoverPiece
]:
    """``(index, recover_piece)``: :func:`reference.pieces` of ``z``, its branch bits and
    ``dz``, and the function that gives a piece's ``y`` (by :func:`invert`) and
    ``dy = phi'(y) dz`` in the compute dtype, as :func:`reference.grads_over_pieces` and
    :func:`reference.sums_over_pieces` take them."""
    compute = compute_dtype(z.dtype)
    # Newton's temporaries (at their peak 16.25 float32 tensors of what it inverts, measured
    # with iabn.traffic) are a piece's, not the activation's: 1/64 of it for large
    # activations (reference.pieces)
    (zv, dzv, leftv), index = reference.pieces(z, dz, unpack_bits(packed, z.shape),
                                               parts=4 * reference.PIECES)

    def recover_piece(at: tuple, with_y: bool) -> tuple[Tensor, Tensor]:
        y = invert(zv[at].to(compute), leftv[at], activation, z.dtype)
        return y, derivative(y, activation).mul_(dzv[at].to(compute))

    return index, recover_piece


def recover_all(z: Tensor, index: list[tuple],
                recover_piece: reference.RecoverPiece) -> tuple[Tensor, Tensor]:
    """``(y, dy)`` of the whole of ``z`` (whose dtype is its compute dtype), a piece at a
    time."""
    y, dy = torch.empty_like(z), torch.empty_like(z)
    (yv, dyv), _ = reference.pieces(y, dy)
    for at in index:
        y_piece, dy_piece = recover_piece(at, True)
        yv[at].copy_(y_piece)
        dyv[at].copy_(dy_piece)
    return y, dy


def backward(
    z: Tensor, packed: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
    invstd: Tensor, g: Tensor, config: LayerConfig, output_mask: list[bool],
    kernels: KernelBackend = reference,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dgamma, dbeta)`` from ``z``, its branch bits and ``dz``, by the ``kernels``
    that ran forward."""
    if z.numel() == 0:
        return empty_grads(z, weight, bias, output_mask)
    if kernels is not reference:
        return kernels.backward(z, dz, weight, bias, invstd, g, config, output_mask,
                                _triton_branch(kernels, z, config.activation, packed))
    compute = compute_dtype(z.dtype)
    index, recover_piece = recovery(z, packed, dz, config.activation)
    if compute != z.dtype:  # half inputs: nothing of the activation's size in float32
        return reference.grads_over_pieces(z, weight, bias, invstd, g, config, output_mask,
                                           index, recover_piece)
    y, dy = recover_all(z, index, recover_piece)
    g = g.to(compute)
    beta = bias.to(compute) if bias is not None else torch.zeros_like(g)
    return reference.grads_from_y(y, dy, g, beta, invstd, z, weight, bias, config, output_mask)


# ------------------------------------------------------------------ the synchronised layer

def sync_local_sums(
    z: Tensor, packed: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor,
    config: LayerConfig, kernels: KernelBackend = reference,
) -> tuple[KernelBackend, Any, Tensor]:
    """:func:`iabn.kernels.reference.local_sums` with ``y`` recovered from ``z`` and its
    branch bits: ``(module, saved, [sum(dy * xhat), sum(dy)])``; ``module.input_grad(saved,
    ...)`` gives ``dx`` after the all-reduce. With the reference ``kernels``, ``saved`` is the
    whole ``(y, dy)`` where the compute dtype is ``z``'s, and for half inputs a
    :class:`~iabn.kernels.reference.Recovered` whose pieces are inverted again for
    ``dx`` (no float32 tensor of the activation's size, as in :func:`backward`); the Triton
    kernels invert in both of their passes."""
    if z.numel() == 0:  # nothing to invert: the identity's empty (y, dy) and zero sums
        return reference, *reference.local_sums(
            z, dz, bias, scale, config._replace(activation=act.IDENTITY))
    if kernels is not reference:
        branch = _triton_branch(kernels, z, config.activation, packed)
        return kernels, *kernels.local_sums(z, dz, bias, scale, config, branch)
    compute = compute_dtype(z.dtype)
    index, recover_piece = recovery(z, packed, dz, config.activation)
    if compute != z.dtype:
        sums = reference.sums_over_pieces(index, recover_piece, scale, bias, compute)
        return reference, reference.Recovered(z, index, recover_piece), sums
    y, dy = recover_all(z, index, recover_piece)
    g = scale.to(compute)
    beta = bias.to(compute) if bias is not None else torch.zeros_like(g)
    return reference, (y, dy), reference.sums_from_y(y, dy, g, beta)


class BranchABNFunction(torch.autograd.Function):
    """Autograd of the in-place layer with ``silu``/``gelu``: the output is ``x`` itself,
    saved as ``z`` with the packed branch bits and ``(C,)`` tensors."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None,
        running_mean: Tensor | None, running_var: Tensor | None, config: LayerConfig,
    ) -> Tensor:
        kernels = backend_for(x)
        invstd, g, packed = forward_(x, weight, bias, running_mean, running_var, config, True,
                                     kernels)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, packed, weight, bias, invstd, g)
        ctx.config, ctx.kernels = config, kernels
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            refuse_double_backward("InPlaceABN")
        z, packed, weight, bias, invstd, g = ctx.saved_tensors
        want_dx, want_dweight, want_dbias = ctx.needs_input_grad[:3]
        mask = [want_dx, want_dweight and weight is not None, want_dbias and bias is not None]
        dx, dgamma, dbeta = backward(z, packed, dz, weight, bias, invstd, g, ctx.config, mask,
                                     ctx.kernels)
        return (dx if mask[0] else None, dgamma if mask[1] else None,
                dbeta if mask[2] else None, None, None, None)


def inplace_abn(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig,
) -> Tensor:
    """The in-place layer with ``silu``/``gelu`` (no validation but the backend's)."""
    kernels = backend_for(input)
    needs_grad = layer_needs_grad(input, weight, bias)
    if not needs_grad:
        with torch.no_grad():
            forward_(input, weight, bias, running_mean, running_var, config, False, kernels)
        return input
    return BranchABNFunction.apply(
        overwritable(input), weight, bias, running_mean, running_var, config
    )


__all__ = ["BranchABNFunction", "invert", "minimum", "pack_bits", "unpack_bits"]
