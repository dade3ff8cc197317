"""The batch-norm family's autograd: :class:`InPlaceABNFunction`, the in-place layer's one eager
``Function``, and :func:`compute_inplace`, its call after the checks (docs/design.md, "The
in-place contract"); :func:`compute_abn` is the not-in-place layer.

:func:`compute_inplace` is what every single-process in-place call runs after validation (the
modules, the functional form, compat, and the synchronised layers without a process group):
:func:`~.call.layer_call` with :class:`BatchNormFamily` (the debug mode's poisoned call, the
composed layer under forward-mode AD and ``torch.func``, the traceable layer while compiling
(:mod:`.compiled`), the kernels alone without autograd, or the ``Function``).

:class:`InPlaceABNFunction` calls the kernels (:func:`iabn.kernels.backends.backend_for`)
directly. It marks ``x`` dirty (the output *is* the input's storage) and saves only ``z``,
per-channel tensors and, for an activation with one minimum, the packed branch bits that the
backend writes and reads (:mod:`iabn.kernels.backend`): it asks neither which backend nor
which activation it has. Scalar options travel as one :class:`~iabn.kernels.common.LayerConfig`
from the layer to the kernels, so that ``Function.apply`` handles six arguments rather than
thirteen (its per-argument overhead is measurable on small layers). The synchronised layer's
Function (:mod:`iabn.distributed.function`) is the same one with its two collectives around
the same backend calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels import activations as act
from ..kernels.backends import backend_for
from ..kernels.common import ABS, LayerConfig, abs_sign, effective_scale, new_bits
from ..kernels.traceable import traces
from . import compiled
from .call import grad_mask, layer_call, overwritable, refuse_double_backward
from .operators import RegisteredOperators


def compute_inplace(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig, *, overwrite: bool = True,
) -> Tensor:
    """Overwrite ``input`` with the layer's output and return it (autograd node when needed):
    :func:`~.call.layer_call` with this family. ``overwrite=False``: the output-only mode (a
    new output; ``input`` untouched)."""
    return layer_call(BatchNormFamily, input, weight, bias, (running_mean, running_var, config),
                      overwrite, "iabn.functional.inplace_abn")


def _traced(config: LayerConfig) -> bool:
    """Whether the call goes to the ATen operations the compiler sees (:mod:`.compiled`)."""
    return torch.compiler.is_compiling() and compiled.TRACEABLE and traces(config)


class BatchNormFamily:
    """The batch-norm family's computations for :func:`~.call.layer_call`; ``options`` is
    ``(running_mean, running_var, config)``. While compiling, the ATen operations the compiler
    sees (:mod:`.compiled`) where the activation needs no branch bit (one with a bit is traced
    through :class:`InPlaceABNFunction`)."""

    @staticmethod
    def composed(input: Tensor, weight: Tensor | None, bias: Tensor | None, options: tuple,
                 overwrite: bool) -> Tensor:
        return _composed_inplace(input if overwrite else input.clone(), options[0], options[1],
                                 weight, bias, options[2])

    @staticmethod
    def without_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                     options: tuple, overwrite: bool) -> Tensor:
        running_mean, running_var, config = options
        if not overwrite:  # (the output-only mode: on a copy)
            input = input.clone()
        if _traced(config):  # (traced_inplace_abn records no node without a gradient)
            return compiled.traced_inplace_abn(input, running_mean, running_var, weight, bias,
                                               config)
        kernels_for(input, config).forward_(input, weight, bias, running_mean, running_var,
                                            config)
        return input

    @staticmethod
    def with_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None, options: tuple,
                  overwrite: bool) -> Tensor:
        running_mean, running_var, config = options
        if _traced(config):
            return compiled.traced_inplace_abn(input if overwrite else input.clone(),
                                               running_mean, running_var, weight, bias, config)
        # overwritable: a copy where the compiler is given the opaque iabn:: operators instead
        # (compiled.TRACEABLE off); the output-only mode runs on a copy too
        return InPlaceABNFunction.apply(
            overwritable(input) if overwrite else input.clone(), weight, bias, running_mean,
            running_var, config
        )


def _composed_inplace(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig,
) -> Tensor:
    """The in-place layer from PyTorch's differentiable operators, for forward-mode AD and
    ``torch.func``: batch norm of a copy of ``input`` with the in-place layer's scale (signed:
    ``|weight|`` clamped to ``eps`` with the gradient passed straight through, as its backward
    does; abs: ``|weight| + eps``), the activation, and the result written into ``input``,
    which is returned. Every derivative comes from ATen's own formulas; no memory is saved
    (the copy is kept for backward, as ``ABN`` keeps its input)."""
    if weight is not None and config.gamma_mode != ABS:
        clamped = effective_scale(weight.detach(), config.eps, config.gamma_mode)
        weight = weight + (clamped - weight.detach())
    out = compute_abn(input.clone(), running_mean, running_var, weight, bias, config)
    return input.copy_(out)


def compute_abn(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig,
) -> Tensor:
    """Batch norm, then the activation, without overwriting ``input`` (``config.variant`` is
    not used: nothing is inverted)."""
    training, momentum, eps, activation, activation_param, gamma_mode, _ = config
    if weight is not None and gamma_mode == ABS:
        # Signed mode uses the weight as it is: nothing is inverted here, so |weight| < eps
        # needs no clamp and ABN computes exactly nn.BatchNorm + activation.
        # |weight| + eps with d/dweight = +1 at 0 (scale.gamma_grad), not autograd's 0
        weight = weight * abs_sign(weight.detach()) + eps
    y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    # The batch-norm output is a fresh tensor that batch norm's backward does not need, so the
    # activation may overwrite it.
    return act.apply_(y, activation, activation_param)


def kernels_for(x: Tensor, config: LayerConfig) -> Any:
    """What runs a layer on ``x``: the kernel module
    :func:`~iabn.kernels.backends.backend_for` picks, called directly; while compiling, the
    registered operators for an invertible activation (they carry no branch bits: with bits
    the compiler traces the backend's own ATen operations). Resolved once per layer call;
    backward reuses the forward's choice."""
    if torch.compiler.is_compiling() and traces(config):
        return RegisteredOperators
    return backend_for(x, config.activation)


class InPlaceABNFunction(torch.autograd.Function):
    """Autograd for the in-place layer: the output is ``x`` itself, saved as ``z`` with
    ``(C,)`` tensors and, for an activation with one minimum, its packed branch bits (the
    backend writes and reads them: :mod:`iabn.kernels.backend`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        config: LayerConfig,
    ) -> Tensor:
        bits = new_bits(x, config)
        kernels = kernels_for(x, config)
        invstd, scale = kernels.forward_(x, weight, bias, running_mean, running_var, config,
                                         bits)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, invstd, scale, bits)
        ctx.config = config
        ctx.kernels = kernels
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # the common case without a call
            refuse_double_backward("InPlaceABN", "iabn.ABN")
        z, weight, bias, invstd, scale, bits = ctx.saved_tensors
        c = ctx.config
        mask = grad_mask(ctx, weight, bias)
        dx, dgamma, dbeta = ctx.kernels.backward(z, dz, weight, bias, invstd, scale, c, mask,
                                                 bits)
        return (
            dx if mask[0] else None, dgamma if mask[1] else None, dbeta if mask[2] else None,
            None, None, None,
        )
