"""The group-norm family's math on PyTorch's own group-norm kernels: the reference backend's
``group_norm_forward_`` and ``group_norm_backward`` (docs/design.md, "In-place group norm").

The math, for one sample ``n`` and one group ``k`` of ``D = (C / G) * HxW`` values, with
``mean``, ``rstd = 1 / sqrt(var + eps)`` (biased variance) over the group, per channel ``c``
the effective scale ``g_c = scale(weight_c)`` (:mod:`.common`) and ``beta_c = bias_c``::

    xhat = (x - mean) * rstd,   y = g_c * xhat + beta_c,   z = phi(y)

Forward overwrites ``x`` with ``z`` and returns ``rstd`` (shape ``(N, G)``; ``mean`` is not
needed) and, for an activation with one minimum (SiLU, GELU, Mish), the packed bit
``y < y*`` of every element. Backward recovers ``y = phi^-1(z)``, ``dy = phi'(y) * dz`` (from
``z``, as :mod:`.activations` does, or from ``z`` and the bit, :func:`.branch.recover`) and
``xhat = (y - beta_c) / g_c``, then::

    dbeta_c = sum_{n, s} dy                 dg_c = sum_{n, s} dy * xhat
    dx = rstd * (dxhat - mean_D(dxhat) - xhat * mean_D(dxhat * xhat)),   dxhat = g_c * dy

``native_group_norm_backward(dy, input=xhat, mean=0, rstd=1, weight=g)`` computes exactly
``dbeta``, ``dg`` and the bracket (its normalised input ``(xhat - 0) * 1`` is ``xhat``), so
``dx`` is its first output times ``rstd`` of the sample and group (checked against
``nn.GroupNorm`` in float64 by tests/core/test_group_norm.py). ``dweight = dg`` in signed mode,
``dg`` times ``d|weight|/dweight`` in abs mode (:func:`.common.gamma_grad`).

float16 and bfloat16 inputs are normalised by the same kernel as ``nn.GroupNorm`` (forward
outputs equal its outputs); backward recovers ``xhat`` and runs the backward kernel in
float32 on parts of the activation (:func:`_grads_in_parts`), writing ``dx`` in the input's
dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import activations as act
from . import branch
from .common import (
    LOW_PRECISION,
    GroupConfig,
    at_most,
    effective_scale,
    gamma_grad,
    part_count,
)

_NATIVE_GROUP_NORM = torch.ops.aten.native_group_norm.default
_NATIVE_GROUP_NORM_BACKWARD = torch.ops.aten.native_group_norm_backward.default


def _sizes(x: Tensor) -> tuple[int, int, int]:
    n, c = x.shape[0], x.shape[1]
    return n, c, math.prod(x.shape[2:])


def _layout(x: Tensor) -> torch.memory_format:
    """ATen's ``suggest_memory_format``: channels-last where ``x`` is stored so, else
    contiguous (the group-norm kernels read both)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _per_channel(t: Tensor, x: Tensor) -> Tensor:
    """A ``(C,)`` tensor shaped to broadcast over ``x`` of shape ``(N, C, *)``."""
    return t.view((1, -1) + (1,) * (x.dim() - 2))


def group_norm_forward_(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                        config: GroupConfig) -> tuple[Tensor, Tensor | None]:
    """Overwrite ``x`` with ``phi(g * xhat + beta)``; return ``(rstd, bits)``: ``rstd`` of
    shape ``(N, G)`` and, for an activation with one minimum, the bit ``y < y*`` of every
    element in ``x``'s logical order (:func:`.branch.pack_below`; ``None`` for an invertible
    activation).

    ATen's kernel writes a new tensor, which is copied into ``x`` and freed: one
    activation-sized temporary during forward, nothing kept."""
    num_groups, eps, activation, activation_param, gamma_mode = config
    n, c, hxw = _sizes(x)
    scale = None if weight is None else effective_scale(weight.detach(), eps, gamma_mode)
    source = x.contiguous(memory_format=_layout(x))
    out, _, rstd = _NATIVE_GROUP_NORM(source, scale, bias, n, c, hxw, num_groups, eps)
    record = act.ACTIVATIONS[activation]
    bits = branch.pack_below(out, record.minimum.y_star) if record.needs_branch else None
    act.apply_(out, activation, activation_param)
    x.copy_(out)
    return rstd, bits


def group_norm_backward(z: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                        rstd: Tensor, config: GroupConfig, output_mask: list[bool],
                        bits: Tensor | None = None,
                        ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` from the output ``z``, ``rstd`` ``(N, G)`` and, for an
    activation with one minimum, the forward's branch ``bits``; ``None`` where
    ``output_mask`` does not ask for it."""
    num_groups, eps, activation, activation_param, gamma_mode = config
    scale = None if weight is None else effective_scale(weight.detach(), eps, gamma_mode)
    bias = None if bias is None else bias.detach()
    options = (num_groups, activation, activation_param, output_mask)
    if z.dtype in LOW_PRECISION and not torch.compiler.is_compiling():
        # in float32, a part at a time (Inductor fuses the casts into its kernels)
        dx, dscale, dbias = _grads_in_parts(z, dz, scale, bias, rstd, *options, bits=bits)
    else:
        dx, dscale, dbias = _grads(z, dz, scale, bias, rstd, *options, bits=bits)
    dweight = None
    if output_mask[1] and dscale is not None:
        dweight = gamma_grad(dscale, weight.detach(), gamma_mode).to(weight.dtype)
    dbias = dbias.to(bias.dtype) if output_mask[2] and dbias is not None else None
    return dx, dweight, dbias


def _grads(z: Tensor, dz: Tensor, scale: Tensor | None, bias: Tensor | None, rstd: Tensor,
           num_groups: int, activation: str, activation_param: float, mask: list[bool],
           bits: Tensor | None = None,
           ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dscale, dbias)`` of the layer from its output ``z`` (``(N, C, *)``, the
    ``num_groups`` groups of its channels), ``rstd`` ``(N, G)`` and the branch ``bits`` of an
    activation with one minimum; computed in float32 for half inputs, ``dx`` in ``z``'s
    dtype. See the module docstring for the math."""
    compute = torch.float32 if z.dtype in LOW_PRECISION else z.dtype
    layout = _layout(z)
    zc = z.to(compute).contiguous(memory_format=layout)
    dzc = dz.to(compute).contiguous(memory_format=layout)
    if bits is not None:  # y from z and its bit (the batch-norm layers' recovery)
        y, dy = branch.recover(zc, bits, dzc, activation)
        y, dy = y.contiguous(memory_format=layout), dy.contiguous(memory_format=layout)
    else:
        dy = act.grad_from_output(dzc, zc, activation, activation_param)
        y = act.invert(zc, activation, activation_param)
    # xhat = (y - beta) / g; in place where y is the recovery's own tensor, else a new one
    # (invert returns z itself for identity)
    owned = bits is not None
    if bias is not None:
        bias_c = _per_channel(bias.to(compute), zc)
        xhat = y.sub_(bias_c) if owned else y - bias_c
    else:
        xhat = y if owned else y.clone()
    if scale is not None:
        scale = scale.to(compute)
        xhat.div_(_per_channel(scale, zc))
    del y
    n, c, hxw = _sizes(z)
    zeros = rstd.new_zeros(rstd.shape, dtype=compute)
    ones = rstd.new_ones(rstd.shape, dtype=compute)
    dx, dscale, dbias = _NATIVE_GROUP_NORM_BACKWARD(
        dy, xhat, zeros, ones, scale, n, c, hxw, num_groups, mask)
    if dx is not None:
        # the kernel's dx is for rstd = 1: scale each (sample, group) by its own rstd
        # (broadcast per channel, so any memory layout of dx is written in place)
        factor = rstd.to(compute).repeat_interleave(c // num_groups, dim=1)
        dx.mul_(factor.view((n, c) + (1,) * (z.dim() - 2)))
        dx = dx.to(z.dtype)
    return dx, dscale, dbias


def _grads_in_parts(z: Tensor, dz: Tensor, scale: Tensor | None, bias: Tensor | None,
                    rstd: Tensor, num_groups: int, activation: str, activation_param: float,
                    mask: list[bool], bits: Tensor | None = None,
                    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_grads` for half inputs without a float32 tensor of the whole activation: each
    (sample, group) is normalised on its own, so the backward splits exactly into parts of
    whole samples (``N >= PIECES``) or of whole groups of one sample; ``dx`` is written part by
    part, the parameter gradients are summed over them. With fewer than ``PIECES`` (sample,
    group) pairs the parts are those pairs. (The float32 temporaries of a part, z, dz, dy, y,
    xhat and dx, hold 6 x 4 bytes an element of it: as in :data:`.common.PIECES`.)"""
    n, c = z.shape[:2]
    per = c // num_groups
    count = part_count(z.numel())
    if n >= count:
        parts = [(slice(a, b), 0, num_groups) for a, b in at_most(n, count)]
    else:
        parts = [(slice(i, i + 1), a, b)
                 for i in range(n) for a, b in at_most(num_groups, -(-count // n))]
    dx = torch.empty_like(z) if mask[0] else None
    sums = [torch.zeros(c, dtype=torch.float32, device=z.device) if want else None
            for want in mask[1:]]
    # a part's bits packed again from the whole's, in the part's own logical order
    left = branch.unpack_bits(bits, z.shape) if bits is not None else None
    for samples, g0, g1 in parts:
        channels = slice(g0 * per, g1 * per)
        at = (samples, channels)
        part = _grads(z[at], dz[at], None if scale is None else scale[channels],
                      None if bias is None else bias[channels], rstd[samples, g0:g1],
                      g1 - g0, activation, activation_param, mask,
                      None if left is None else branch.pack_bits(left[at]))
        if dx is not None:
            dx[at].copy_(part[0])
        for total, value in zip(sums, part[1:], strict=True):
            if total is not None and value is not None:
                total[channels] += value
    return dx, *sums


__all__ = ["group_norm_backward", "group_norm_forward_"]
