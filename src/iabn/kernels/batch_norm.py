"""The batch-norm family's math on PyTorch's native vectorised batch-norm kernels: the reference
backend's ``forward_``, ``backward``, ``local_sums`` and ``input_grad`` (:mod:`.reference`).

No autograd here: these functions are the bodies of the ``torch.library`` operators in
:mod:`iabn.autograd.operators`. Shapes: ``x``/``z``/``dz`` are ``(N, C, *spatial)`` with 0 to 3
spatial dims;
every per-channel tensor is ``(C,)``.

Forward runs ``aten::native_batch_norm.out`` with ``out=x`` (normalise, scale and shift in
place) and then the activation in place. Backward uses the identity of docs/design.md,
"The math": given ``input = y``, ``save_mean = beta``, ``save_invstd = 1/g`` and
``weight = g^2 * invstd``, ATen's batch-norm backward computes exactly the gradients of
variant II from ``y``, so no chain of elementwise ops is needed. Variant I first materialises
``xhat = (y - beta) / g`` and runs the standard backward on it (one more pass: it exists as
the paper's reference).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from . import activations as act
from . import branch, scratch
from .common import (
    BATCH_NORM_BACKWARD,
    LOW_PRECISION,
    LayerConfig,
    RecoverPiece,
    cast,
    channel_view,
    compute_dtype,
    dx_coefficients,
    effective_g,
    empty_grads,
    empty_invstd,
    finish_grads,
    is_dense_format,
    pieces,
    running_invstd,
    stat_dtype,
)


def full_dtype(dtype: torch.dtype, activation: str, variant: int) -> torch.dtype:
    """Dtype of the backward's full-size temporaries: the input's for the default layer, the
    compute dtype for ``elu`` and for variant I.

    ATen's batch-norm backward reads half tensors and computes in float32 with float32
    per-channel tensors, so a half input needs no float32 copy (which would hold twice its
    bytes). Recovering ``y = z / a`` of leaky_relu in half precision rounds it once more
    where ``z < 0`` (relative ``2^-9`` in bfloat16), and ``dy`` is rounded as PyTorch's own
    LeakyReLU backward rounds it: within the bounds of tests/core/test_dtypes.py (twice PyTorch's
    error). Two cases are not, measured there in bfloat16: ``elu``, whose
    ``dy = dz * (z + alpha)`` and ``y = log1p(z / alpha)`` cancel near ``z = -alpha`` (bias
    gradient 2.3x PyTorch's error), and variant I, whose ``xhat`` rounded to bfloat16 puts
    a rounding error on every element of the weight gradient's sum (2.1x the bound's
    yardstick).
    """
    if variant == 1 or act.ACTIVATIONS[activation].half_in_float32:
        return compute_dtype(dtype)
    return dtype


def forward_(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    config: LayerConfig,
    bits: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Overwrite ``x`` with ``phi(g * (x - mu) * invstd + beta)``; return ``(invstd, g)``.

    ``g = scale(weight)`` (ones without affine) and ``invstd`` are ``(C,)`` in the statistics
    dtype; backward needs both, so they are returned rather than recomputed there.
    ``config.training`` normalises with the batch statistics and, when the running buffers are
    given, updates them in place as ``nn.BatchNorm`` does (unbiased variance,
    ``config.momentum``); otherwise it normalises with the running statistics.

    An activation with one minimum (:mod:`.branch`): ``y`` is compared with ``y*`` in ``x``'s
    dtype, as the activation then reads it, and where ``bits`` is given (from
    :func:`.branch.new_bits`) the bits go there in logical element order
    (:func:`.branch.pack_bits`).
    """
    training, momentum, eps, activation, activation_param, gamma_mode, _ = config
    record = act.ACTIVATIONS[activation]
    channels = x.shape[1]
    sdtype = stat_dtype(x, weight, running_mean)
    device = x.device
    g = effective_g(weight, eps, gamma_mode, channels, sdtype, device)
    if x.numel() == 0:
        # Nothing to normalise, and no kernel is launched: ATen's batch-norm kernels are not
        # all safe on empty inputs (see empty_grads).
        return empty_invstd(training, running_var, eps, channels, sdtype, device), g
    # The kernel treats a missing bias as 0: no zeros tensor needed.
    beta = cast(bias, sdtype) if bias is not None else None
    # For other strides the native kernel's ``out=`` write does not follow the input's
    # layout (measured: wrong values), so such inputs go through a dense copy.
    work = x if is_dense_format(x) else x.contiguous()
    # The public ``torch.native_batch_norm(..., out=...)`` binding is the cheapest route to
    # ATen's forward kernel (measured on CPU: 9.6 vs 11.4 µs through the operator overload).
    if training:
        save_mean = torch.empty(channels, dtype=sdtype, device=device)
        invstd = torch.empty(channels, dtype=sdtype, device=device)
        torch.native_batch_norm(
            work, g, beta, running_mean, running_var, True, momentum, eps,
            out=(work, save_mean, invstd),
        )
    else:
        unused = torch.empty(0, dtype=sdtype, device=device)
        torch.native_batch_norm(
            work, g, beta, running_mean, running_var, False, 0.0, eps,
            out=(work, unused, torch.empty(0, dtype=sdtype, device=device)),
        )
        invstd = running_invstd(running_var, eps, sdtype)
    if record.minimum is None:
        record.apply_(work, activation_param)
    else:
        if bits is not None:
            bits.copy_(branch.pack_below(work, record.minimum.y_star))
        record.minimum.apply_(work)
    if work is not x:
        x.copy_(work)
    return invstd, g


def backward(
    z: Tensor,
    dz: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    invstd: Tensor,
    scale: Tensor,
    config: LayerConfig,
    output_mask: list[bool],
    bits: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``(dx, dgamma, dbeta)`` from the stored output ``z`` and its gradient ``dz``
    (and ``bits``, the branch bits forward wrote, for an activation with one minimum).

    ``invstd`` and ``scale`` (``g``) are what :func:`forward_` returned. ``config.training``
    says whether forward used batch statistics (their gradient flows into ``dx``) or running
    statistics (``dx = dy * g * invstd``). ``output_mask`` selects which of the three are
    computed; the others are ``None``. ``z`` and ``dz`` are only read.

    Full-size tensors stay in the input's dtype (half inputs included: ATen's batch-norm
    kernels compute in float32 from half tensors and float32 per-channel ones); per-channel
    ones are in the compute dtype.
    """
    if z.numel() == 0:
        return empty_grads(z, weight, bias, output_mask)
    if bits is not None:
        return _branch_backward(z, dz, weight, bias, invstd, scale, config, output_mask, bits)
    training, _, _, activation, activation_param, _, variant = config
    want_dx, want_dgamma, want_dbeta = output_mask
    # The batch-norm reductions (over y and dy) give the parameter gradients and, in training,
    # dx. Eval-mode dx scales dy alone: a frozen layer (eval mode, parameters without
    # gradients) needs neither y nor the reductions.
    train_dx = want_dx and training
    sums = train_dx or want_dgamma or want_dbeta
    dtype = z.dtype  # (the call below only for half inputs: a layer's host cost counts)
    if dtype in LOW_PRECISION:
        dtype = full_dtype(dtype, activation, variant)
        if dtype != z.dtype:
            return backward_in_pieces(z, dz, weight, bias, invstd, scale, config, output_mask)
    y, dy, g, beta = recover(z, dz, bias, scale, activation, activation_param, dtype, sums)
    return grads_from_y(y, dy, g, beta, invstd, z, weight, bias, config, output_mask)


def grads_from_y(
    y: Tensor | None, dy: Tensor, g: Tensor, beta: Tensor, invstd: Tensor, z: Tensor,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig, output_mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The second half of :func:`backward`: the gradients from the recovered ``y`` (``None``
    where no reduction needs it: eval-mode ``dx`` alone), ``dy = phi'(y) dz`` and ``(g, beta)``
    in the compute dtype, as :func:`recover` gives them (also what
    the branch-bit backward gives). ``z`` only sets the dtype of ``dx``."""
    training, _, eps, _, _, gamma_mode, variant = config
    want_dx, want_dgamma, want_dbeta = output_mask
    train_dx = want_dx and training
    sums = train_dx or want_dgamma or want_dbeta
    invstd = cast(invstd, g.dtype)
    if sums:
        inv_g = g.reciprocal()
        if variant == 1:
            # Variant I: recover xhat = (y - beta) / g explicitly, then standard BN backward.
            # The eval-mode batch-norm kernel forms it as (y - beta) / sqrt(1 + 0) * (1/g).
            center, inv_scale = torch.zeros_like(g), torch.ones_like(g)
            y = torch.native_batch_norm(y, inv_g, None, beta, inv_scale, False, 0.0, 0.0)[0]
            dx_weight = g * invstd if train_dx else g
        else:
            # Variant II: feed y itself; center and scale of the identity in the module
            # docstring.
            center, inv_scale = beta, inv_g
            dx_weight = torch.mul(g, g).mul_(invstd) if train_dx else g
        # Without dx the weight is not read, but it must be a tensor: CUDA's kernel returns an
        # empty grad_weight for a missing weight, and one of its paths takes its device.
        dx, dg, dbeta = BATCH_NORM_BACKWARD(
            dy, y, dx_weight, None, None, center, inv_scale, True, eps,
            [train_dx, want_dgamma, want_dbeta],
        )
    else:
        dx = dg = dbeta = None
    if want_dx and not training:
        # dx = dy * g * invstd by the eval-mode kernel, which computes in the per-channel dtype
        # and rounds once into dy's (a product with a float32 factor would promote a half dy
        # to a full-size float32 tensor). It takes invstd from save_invstd on CUDA and as
        # 1 / sqrt(running_var + eps) on CPU: running_var = invstd^-2 and eps = 0 give both.
        # Its input is not read for dx (its CPU kernel reads it for a dot product it then
        # discards, with running_mean as the centre): dy stands in for y when y was not made.
        dx = BATCH_NORM_BACKWARD(
            dy, dy if y is None else y, g, beta, invstd.pow(-2), beta, invstd, False, 0.0,
            [True, False, False],
        )[0]

    return finish_grads(dx, dg, dbeta, z, weight, bias, gamma_mode, output_mask)


def backward_in_pieces(
    z: Tensor,
    dz: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    invstd: Tensor,
    scale: Tensor,
    config: LayerConfig,
    output_mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`backward` for half inputs whose ``y`` and ``dy`` must be float32
    (:func:`full_dtype`), with no full-size float32 tensor: :func:`grads_over_pieces` with
    this activation's inverse."""
    index, recover_piece = recovery(z, dz, bias, scale, config.activation,
                                    config.activation_param)
    return grads_over_pieces(z, weight, bias, invstd, scale, config, output_mask, index,
                             recover_piece)


def recovery(
    z: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor, activation: str,
    activation_param: float,
) -> tuple[list[tuple], RecoverPiece]:
    """``(index, recover_piece)``: :func:`pieces` of ``z`` and ``dz``, and the function that
    gives a piece's ``y`` and ``dy`` in the compute dtype (:func:`recover`), as
    :func:`grads_over_pieces`, :func:`sums_over_pieces` and :func:`input_grad_over_pieces`
    take them."""
    (zv, dzv), index = pieces(z, dz)

    def recover_piece(at: tuple, with_y: bool) -> tuple[Tensor | None, Tensor]:
        return recover(zv[at], dzv[at], bias, scale, activation, activation_param, None,
                       with_y)[:2]

    return index, recover_piece


def grads_over_pieces(
    z: Tensor, weight: Tensor | None, bias: Tensor | None, invstd: Tensor, scale: Tensor,
    config: LayerConfig, output_mask: list[bool], index: list[tuple],
    recover_piece: RecoverPiece,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients a piece at a time (``index`` from :func:`pieces`): a first pass sums
    ``dy * xhat`` and ``dy``, a second recomputes each piece's ``y`` and ``dy`` for ``dx``
    (twice the inversion, for a backward that holds at most one more activation in the
    input's dtype than BatchNorm's). Variants I and II are one formula here:
    ``dx = k1 * dy + k2 * y + k3`` in the compute dtype (:func:`dx_coefficients`)."""
    training, gamma_mode = config.training, config.gamma_mode
    want_dx, want_dgamma, want_dbeta = output_mask
    cdtype = compute_dtype(z.dtype)
    dx = dg = dbeta = None
    if (want_dx and training) or want_dgamma or want_dbeta:
        dg, dbeta = sums_over_pieces(index, recover_piece, scale, bias, cdtype)
    if want_dx:
        if training:
            sums = torch.stack([dg, dbeta])
            k1, k2, k3 = dx_coefficients(scale, invstd, bias, sums, z.numel() // z.shape[1],
                                         cdtype)
        else:  # dx = dy * g * invstd
            k1, k2, k3 = cast(scale, cdtype) * cast(invstd, cdtype), None, None
        dx = input_grad_over_pieces(z, index, recover_piece, k1, k2, k3)
    return finish_grads(dx, dg, dbeta, z, weight, bias, gamma_mode, output_mask)


def sums_over_pieces(
    index: list[tuple], recover_piece: RecoverPiece, scale: Tensor, bias: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """``[sum(dy * xhat), sum(dy)]`` ``(2, C)`` in ``dtype``, summed over the pieces."""
    g = cast(scale, dtype)
    beta = cast(bias, dtype) if bias is not None else torch.zeros_like(g)
    inv_g = g.reciprocal()
    sums = None
    for at in index:
        y, dy = recover_piece(at, True)
        # The reductions of the batch-norm backward, with the identity in the module docstring.
        _, sum_dy_xhat, sum_dy = BATCH_NORM_BACKWARD(
            dy, y, g, None, None, beta, inv_g, True, 0.0, [False, True, True],
        )
        part = torch.stack([sum_dy_xhat, sum_dy])
        sums = part if sums is None else sums.add_(part)
    return sums


def input_grad_over_pieces(
    z: Tensor, index: list[tuple], recover_piece: RecoverPiece, k1: Tensor,
    k2: Tensor | None = None, k3: Tensor | None = None,
) -> Tensor:
    """``dx = k1 * dy + k2 * y + k3`` (``(C,)`` each; ``dx = k1 * dy`` without ``k2`` and
    ``k3``) in ``z``'s dtype, each piece's ``y`` and ``dy`` (in ``k1``'s dtype) rounded once
    into ``dx``."""
    dx = torch.empty_like(z)
    (dxv,), _ = pieces(dx)
    ndim = dxv.dim()
    k1, with_y = channel_view(k1, ndim), k2 is not None
    if with_y:
        k2, k3 = channel_view(k2, ndim), channel_view(k3, ndim)
    for at in index:
        y, dy = recover_piece(at, with_y)
        dxv[at].copy_(torch.addcmul(k3, dy, k1).addcmul_(y, k2) if with_y else dy * k1)
    return dx


def recover(
    z: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor, activation: str,
    activation_param: float, dtype: torch.dtype | None = None, with_y: bool = True,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
    """``(y, dy, g, beta)`` from the stored output ``z``, its gradient and the per-channel
    ``scale`` (``g``) and ``bias`` (``beta``; 0 without one). ``y`` and ``dy`` are in ``dtype``
    (default: the compute dtype, float32 for half inputs, which the synchronised layer's
    elementwise ``dx`` needs), ``g`` and ``beta`` in the compute dtype. ``y`` is ``None``
    unless ``with_y``.

    ``y`` and ``dy`` never leave the backward, so large CPU ones live in reused scratch memory
    where the activation's kernels can write into it (leaky_relu, the layer's default; see
    :mod:`.scratch`). Valid until the next backward on this thread.
    """
    cdtype = compute_dtype(z.dtype)
    full = cdtype if dtype is None else dtype
    zc, dzc = cast(z, full), cast(dz, full)
    g = cast(scale, cdtype)
    beta = cast(bias, cdtype) if bias is not None else torch.zeros_like(g)
    y_out = dy_out = None
    record = act.ACTIVATIONS[activation]
    # (the size test first, spelled out: a small tensor does not call into scratch at all)
    if (record.writes_out and zc.is_cpu and zc.numel() * zc.element_size() >= scratch.MIN_BYTES
            and scratch.worth_reusing(zc)):
        y_out = scratch.empty_like(zc, scratch.INVERSE) if with_y else None
        dy_out = scratch.empty_like(zc, scratch.GRADIENT)
    y = record.invert(zc, activation_param, y_out) if with_y else None
    dy = record.grad_from_output(dzc, zc, activation_param, dy_out)
    return y, dy, g, beta


# ------------------------------------------------------ the synchronised layer's two halves
# The synchronised layer's backward, split around its one all-reduce (docs/design.md,
# "Synchronised layers"): local_sums -> all-reduce of the sums -> input_grad.


class Recovered(NamedTuple):
    """What :func:`input_grad` needs of a half-precision backward: ``z``, whose float32 ``y``
    and ``dy`` it recomputes piece by piece with ``recover_piece`` (``index`` and
    ``recover_piece`` as :func:`grads_over_pieces` takes them: from :func:`recovery`, or for
    an activation with a branch bit from :func:`.branch.recovery`)."""

    z: Tensor
    index: list[tuple]
    recover_piece: RecoverPiece


def local_sums(
    z: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor, config: LayerConfig,
    bits: Tensor | None = None,
) -> tuple[tuple[Tensor, Tensor] | Recovered, Tensor]:
    """``(saved, sums)`` with ``sums = [sum(dy * xhat), sum(dy)]`` stacked ``(2, C)`` and
    ``saved`` what :func:`input_grad` needs: ``(y, dy)`` as scratch tensors (see
    :func:`recover`), valid until the next backward on this thread; for half
    inputs, whose ``y`` and ``dy`` are float32, :class:`Recovered` (nothing full-size in float32
    is kept across the all-reduce, or made). With ``bits``, ``y`` is recovered from ``z`` and
    its branch bits (:func:`.branch.recovery`), the same way."""
    if bits is not None and z.numel():
        return _branch_local_sums(z, dz, bias, scale, config, bits)
    if bits is not None:  # nothing to invert: the identity's empty (y, dy) and zero sums
        config = config._replace(activation=act.IDENTITY)
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
    # The reductions of the batch-norm backward, with the identity of this module's docstring.
    _, sum_dy_xhat, sum_dy = BATCH_NORM_BACKWARD(
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
    return cast(dx, out_dtype)


# ------------------------------------------------------ activations with a branch bit
# (docs/design.md, "SiLU and GELU in place"): y from z and the bit by the Newton steps of
# .branch, then the same gradients as the invertible activations'.


def _branch_backward(
    z: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None, invstd: Tensor,
    g: Tensor, config: LayerConfig, output_mask: list[bool], bits: Tensor,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    compute = compute_dtype(z.dtype)
    if compute != z.dtype:  # half inputs: nothing of the activation's size in float32
        index, recover_piece = branch.recovery(z, bits, dz, config.activation)
        return grads_over_pieces(z, weight, bias, invstd, g, config, output_mask, index,
                                 recover_piece)
    y, dy = branch.recover(z, bits, dz, config.activation)
    g = g.to(compute)
    beta = bias.to(compute) if bias is not None else torch.zeros_like(g)
    return grads_from_y(y, dy, g, beta, invstd, z, weight, bias, config, output_mask)


def _branch_local_sums(
    z: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor, config: LayerConfig,
    bits: Tensor,
) -> tuple[tuple[Tensor, Tensor] | Recovered, Tensor]:
    """:func:`local_sums` with ``y`` from ``z`` and its branch bits: ``saved`` is the whole
    ``(y, dy)`` where the compute dtype is ``z``'s, and for half inputs a :class:`Recovered`
    whose pieces are inverted again for ``dx`` (no float32 tensor of the activation's size,
    as in :func:`backward`)."""
    compute = compute_dtype(z.dtype)
    if compute != z.dtype:
        index, recover_piece = branch.recovery(z, bits, dz, config.activation)
        sums = sums_over_pieces(index, recover_piece, scale, bias, compute)
        return Recovered(z, index, recover_piece), sums
    y, dy = branch.recover(z, bits, dz, config.activation)
    g = scale.to(compute)
    beta = bias.to(compute) if bias is not None else torch.zeros_like(g)
    return (y, dy), sums_from_y(y, dy, g, beta)
