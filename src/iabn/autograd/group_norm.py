"""The group-norm family's autograd: :class:`InPlaceGroupNormFunction` and the call of the
in-place layer after its checks (:func:`inplace_group_norm_act`); :func:`group_norm_act` is
the not-in-place layer. The math is the backend's (:mod:`iabn.kernels.group_norm` for the
reference). Under ``torch.compile`` Dynamo traces the Function as it is, on the reference's ATen
calls, on a copy of the input (:func:`~.call.overwritable`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import activations as act
from ..kernels.backends import backend_or_reference
from ..kernels.common import ABS, GroupConfig, abs_sign, effective_scale
from .call import grad_mask, layer_call, overwritable, refuse_double_backward


class InPlaceGroupNormFunction(torch.autograd.Function):
    """Autograd of :class:`iabn.InPlaceGroupNormAct`: the output is ``x`` itself, saved as
    ``z``, with ``rstd`` of shape ``(N, G)`` and, for an activation with one minimum (SiLU,
    GELU, Mish), its packed branch bits (``ceil(numel / 8)`` bytes)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None,  # type: ignore[override]
                config: GroupConfig) -> Tensor:
        kernels = backend_or_reference(x)
        rstd, bits = kernels.group_norm_forward_(x, weight, bias, config)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, rstd, bits)
        ctx.config, ctx.kernels = config, kernels
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            refuse_double_backward("InPlaceGroupNormAct", "iabn.GroupNormAct")
        z, weight, bias, rstd, bits = ctx.saved_tensors
        dx, dweight, dbias = ctx.kernels.group_norm_backward(
            z, dz, weight, bias, rstd, ctx.config, grad_mask(ctx, weight, bias), bits)
        return dx, dweight, dbias, None


class GroupNormFamily:
    """The group-norm family's computations for :func:`~.call.layer_call`; ``options`` is the
    call's :class:`~iabn.kernels.common.GroupConfig`."""

    @staticmethod
    def composed(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                 config: GroupConfig, overwrite: bool) -> Tensor:
        """Group norm of a copy with the in-place layer's scale (signed: clamped, gradient
        passed straight through), the activation, and the result written into ``input``."""
        if weight is not None and config.gamma_mode != ABS:
            clamped = effective_scale(weight.detach(), config.eps, config.gamma_mode)
            weight = weight + (clamped - weight.detach())
        out = group_norm_act(input.clone(), weight, bias, config)
        return input.copy_(out) if overwrite else out

    @staticmethod
    def without_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                     config: GroupConfig, overwrite: bool) -> Tensor:
        if not overwrite:  # (the output-only mode: on a copy)
            input = input.clone()
        with torch.no_grad():
            backend_or_reference(input).group_norm_forward_(input, weight, bias, config)
        return input

    @staticmethod
    def with_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                  config: GroupConfig, overwrite: bool) -> Tensor:
        return InPlaceGroupNormFunction.apply(overwritable(input) if overwrite else input.clone(),
                                              weight, bias, config)


def inplace_group_norm_act(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                           config: GroupConfig, *, overwrite: bool = True) -> Tensor:
    """Overwrite ``input`` with the layer's output and return it (no validation);
    ``overwrite=False``: the output-only mode (a new output; ``input`` untouched)."""
    return layer_call(GroupNormFamily, input, weight, bias, config, overwrite,
                      "InPlaceGroupNormAct")


def group_norm_act(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                   config: GroupConfig) -> Tensor:
    """Group norm, then the activation, without overwriting ``input`` (no validation)."""
    num_groups, eps, activation, activation_param, gamma_mode = config
    if weight is not None and gamma_mode == ABS:
        # |weight| + eps with d/dweight = +1 at 0 (scale.gamma_grad), not autograd's 0
        weight = weight * abs_sign(weight.detach()) + eps
    y = F.group_norm(input, num_groups, weight, bias, eps)
    # group norm's backward reads its input and statistics, not its output: overwrite it
    return act.apply_(y, activation, activation_param)


__all__ = ["InPlaceGroupNormFunction", "group_norm_act", "inplace_group_norm_act"]
