"""The in-place layer's one autograd ``Function`` and the routing of a layer call after its
checks (docs/design.md, "The in-place contract").

:func:`inplace_abn` is what every single-process in-place call runs after validation (the
modules, the functional form, compat, and the synchronised layers without a process group):
the debug mode's poisoned call, the composed layer under forward-mode AD and ``torch.func``,
the traceable layer while compiling (:mod:`.compiled`), the kernels alone without autograd,
or :class:`InPlaceABNFunction`. :func:`abn` is the not-in-place layer.

:class:`InPlaceABNFunction` calls the kernels (:func:`iabn.kernels.dispatch.backend_for`)
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
from torch.autograd import forward_ad

from .. import debug
from ..kernels import activations as act
from ..kernels.common import ABS, LayerConfig, abs_sign, effective_scale, new_bits
from ..kernels.dispatch import backend_for
from ..kernels.traceable import traces
from . import compiled
from .operators import RegisteredOperators

_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack


def compute_inplace(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig,
) -> Tensor:
    """Overwrite ``input`` with the layer's output and return it (autograd node when needed)."""
    # Every in-place call but the synchronised one passes here; the debug mode
    # (iabn.debug.poison_overwritten) reruns this function on a copy of the input.
    if debug._ACTIVE and debug.intercepts():
        return debug.poisoned_call(
            lambda copy: compute_inplace(
                copy, running_mean, running_var, weight, bias, config
            ),
            input, "iabn.functional.inplace_abn",
        )
    if transformed():
        return _composed_inplace(input, running_mean, running_var, weight, bias, config)
    if torch.compiler.is_compiling() and compiled.TRACEABLE and traces(config):
        # ATen operations the compiler sees (iabn.autograd.compiled); an activation with a
        # branch bit is traced through the Function below
        return compiled.traced_inplace_abn(input, running_mean, running_var, weight, bias, config)
    # Spelled out: a generator over the three tensors costs a microsecond per layer call.
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
    if not needs_grad:
        kernels_for(input, config).forward_(input, weight, bias, running_mean, running_var,
                                            config)
        return input
    # overwritable: a copy where the compiler is given the opaque iabn:: operators instead
    # (compiled.TRACEABLE off)
    return InPlaceABNFunction.apply(
        overwritable(input), weight, bias, running_mean, running_var, config
    )


def transformed() -> bool:
    """Whether forward-mode AD (a ``forward_ad.dual_level``) or a ``torch.func`` transform
    (``jvp``, ``vmap``, ``grad``, ``jacfwd``...) is active. The in-place autograd Function
    has a backward only, and ``torch.func`` cannot run a Function that sets up its context in
    ``forward``; under these the layer is computed by composition (about 0.2 µs a call to
    ask, measured on CPU)."""
    return (
        forward_ad._current_level >= 0 or _peek_interpreter_stack() is not None
    ) and not torch.compiler.is_compiling()


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
    :func:`~iabn.kernels.dispatch.backend_for` picks, called directly; while compiling, the
    registered operators for an invertible activation (they carry no branch bits: with bits
    the compiler traces the backend's own ATen operations). Resolved once per layer call;
    backward reuses the forward's choice."""
    if torch.compiler.is_compiling() and traces(config):
        return RegisteredOperators
    return backend_for(x)


def overwritable(x: Tensor) -> Tensor:
    """The tensor to hand to an autograd function that overwrites its input and calls
    ``ctx.mark_dirty``: ``x`` itself in eager mode, a copy under ``torch.compile``.

    The compiler (torch 2.13, and still 2.14.1: input-gradient error 7.3 on the test's data)
    loses ``ctx.mark_dirty`` when the overwritten tensor is an input of the compiled graph (a
    graph break before the layer, a compiled block that starts with its norm): backward then
    passed ``dz`` through as ``dx`` (pytorch/pytorch#184113). On a copy the overwritten tensor
    is an intermediate of the graph, which compiles correctly, and Inductor drops the copy
    where ``x`` already is one. Used by the synchronised layers and by direct callers of
    :class:`InPlaceABNFunction`; the single-process layers compile through
    :mod:`iabn.autograd.compiled`, which does not mark anything dirty.
    """
    return x.clone() if torch.compiler.is_compiling() else x


def needs_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether a group-norm layer call must record an autograd node (the batch-norm path
    spells it out inline: its host cost is measured)."""
    return torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )


def refuse_double_backward(layer: str) -> None:
    """Raise under ``create_graph=True``, the only case in which backward runs with grad mode
    on. (A check instead of ``@once_differentiable``: its wrapper adds ~2.5 µs per layer and
    step, measured on the 2-core CPU machine, and its error names no fix.)"""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"{layer} does not support double backward (create_graph=True); use iabn.ABN "
            f"where second derivatives are needed"
        )


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
            refuse_double_backward("InPlaceABN")
        z, weight, bias, invstd, scale, bits = ctx.saved_tensors
        c = ctx.config
        want_dx, want_dweight, want_dbias, _, _, _ = ctx.needs_input_grad
        mask = [want_dx, want_dweight and weight is not None, want_dbias and bias is not None]
        dx, dgamma, dbeta = ctx.kernels.backward(z, dz, weight, bias, invstd, scale, c, mask,
                                                 bits)
        return (
            dx if mask[0] else None, dgamma if mask[1] else None, dbeta if mask[2] else None,
            None, None, None,
        )
