"""The activation family's autograd (in-place activations without a norm):
:class:`InPlaceActivationFunction` and the call after the checks (:func:`activation_call`).

Forward computes ``z = phi(x)`` with the registry's function (torch's own: the outputs are
torch's, bit for bit), into ``x`` (``overwrite``) or a new tensor. An activation with one
minimum also keeps one bit per element, ``x < y*`` (:func:`iabn.kernels.branch.pack_bits`);
an invertible one keeps nothing more. Backward is the backend's ``activation_grad``, which
recovers ``x`` from ``z`` (and the bit). Double backward is refused; forward-mode AD and
``torch.func`` compute the layer by composition; under ``torch.compile`` Dynamo traces the
``Function`` (on the reference's ATen operations)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..kernels import branch
from ..kernels.activations import ACTIVATIONS
from ..kernels.backends import backend_or_reference
from .call import layer_call, overwritable, refuse_double_backward, whole_base


class InPlaceActivationFunction(torch.autograd.Function):
    """Keeps the output ``z`` and, for an activation with one minimum, the packed branch bits
    (``ceil(numel / 8)`` bytes); ``overwrite``: ``z`` is written into ``x`` (marked dirty).
    ``shape``: the shape ``z`` is kept in (``x``, a view's base overwritten in the view's
    place, keeps it in the view's: a checkpoint's recomputation must keep what its first
    forward kept, which computed the view output-only)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, activation: str, activation_param: Any,  # type: ignore[override]
                overwrite: bool, shape: torch.Size | None = None) -> Tensor:
        record = ACTIVATIONS[activation]
        # y < y* in x's dtype, before x is overwritten (as the batch-norm layers' forward)
        bits = branch.pack_below(x, record.minimum.y_star) if record.needs_branch else None
        if overwrite:
            record.apply_(x, activation_param)  # torch's own function, in place (no grad mode)
            z = x
            ctx.mark_dirty(x)
        else:
            z = record.apply(x, activation_param)
        # (a detached alias: a view made here, with autograd off, would be a no-grad view of
        # the base, which a later in-place layer on the base may not modify)
        ctx.save_for_backward(z if shape is None else z.detach().view(shape), bits)
        ctx.activation, ctx.activation_param, ctx.shape = activation, activation_param, x.shape
        return z

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        if torch.is_grad_enabled():
            refuse_double_backward(
                "the in-place activation layers (iabn.InPlaceGELU, InPlaceSiLU, InPlaceMish...)",
                "nn.GELU, nn.SiLU, nn.Mish...", plural=True)
        z, bits = ctx.saved_tensors
        # (z in the view's shape where x was a view's base: the gradients reshaped both ways,
        # no copy where the layout allows)
        dx = backend_or_reference(z, ctx.activation).activation_grad(
            z, dz.reshape(z.shape), bits, ctx.activation, ctx.activation_param)
        return dx.reshape(ctx.shape), None, None, None, None


class ActivationFamily:
    """The activation family's computations for :func:`~.call.layer_call`; ``options`` is
    ``(activation, activation_param)``, no weight or bias."""

    @staticmethod
    def composed(input: Tensor, weight: None, bias: None, options: tuple,
                 overwrite: bool) -> Tensor:
        # torch's differentiable function on a copy (its backward reads its input)
        activation, param = options
        out = ACTIVATIONS[activation].apply(input.clone() if overwrite else input, param)
        return input.copy_(out) if overwrite else out

    @staticmethod
    def without_grad(input: Tensor, weight: None, bias: None, options: tuple,
                     overwrite: bool) -> Tensor:
        activation, param = options
        record = ACTIVATIONS[activation]
        if not overwrite:
            return record.apply(input, param)
        with torch.no_grad():
            record.apply_(input, param)
        return input

    @staticmethod
    def with_grad(input: Tensor, weight: None, bias: None, options: tuple,
                  overwrite: bool) -> Tensor:
        if not overwrite:
            return InPlaceActivationFunction.apply(input, *options, False)
        base = whole_base(input)
        if base is not None:  # the view's base in its place, then the view again (call.py)
            return InPlaceActivationFunction.apply(base, *options, True, input.shape).view(
                input.shape)
        return InPlaceActivationFunction.apply(overwritable(input), *options, True)


def activation_call(input: Tensor, activation: str, activation_param: Any, overwrite: bool,
                    layer: str) -> Tensor:
    """``phi(input)``, written into ``input`` where ``overwrite`` (and ``input`` returned),
    after the layer's checks."""
    return layer_call(ActivationFamily, input, None, None, (activation, activation_param),
                      overwrite, layer)


__all__ = ["InPlaceActivationFunction", "activation_call"]
