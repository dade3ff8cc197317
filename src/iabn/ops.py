"""The In-Place ABN autograd function for eager mode, and the ``torch.library`` operators.

In eager mode :class:`InPlaceABNFunction` calls the kernels
(:func:`iabn.kernels.dispatch.backend_for`) directly: going through the Python custom-op
dispatcher costs about 60 µs per layer and step (measured on CPU, float32, tiny tensors), as
much as a whole small batch-norm layer. It marks ``x`` dirty (the output *is* the input's
storage) and saves only ``z`` and per-channel tensors.

Under ``torch.compile`` (and ``torch.export``) the layers run :mod:`iabn.compiled` instead:
ATen operations the compiler traces, fuses and differentiates through the backward from ``z``,
with no call back into Python per layer (docs/design.md, "Under torch.compile").

Two operators remain registered, each with a fake implementation and checked by
``torch.library.opcheck`` (``tests/core/test_compile.py``), for code that calls
:class:`InPlaceABNFunction` itself while compiling, where :func:`kernels_for` gives them:

``iabn::inplace_abn_forward_``
    overwrites ``x`` (and, in training, the running statistics) and returns the per-channel
    ``(invstd, scale)`` backward needs; declared with ``mutates_args`` so the compiler orders
    it correctly, and tagged ``flexible_layout``: the kernels take ``x`` in any strides (a
    layout they cannot read directly goes through a dense copy that is written back), so
    Inductor need not copy ``x`` to the traced strides. Under the default constraint it did so
    for 1x1 feature maps, whose strides differ only in size-1 dimensions, and its scheduler
    then failed on that copy of a mutated buffer (torch 2.13).
``iabn::inplace_abn_backward``
    pure: ``(z, dz, ...) -> (dx, dgamma, dbeta)``.

Scalar options travel as one :class:`~iabn.layer_config.LayerConfig` from the layer to the
kernels, so that ``Function.apply`` handles six arguments rather than thirteen (its
per-argument overhead is measurable on small layers); only the registered operators take them
one by one, as their schema requires.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .kernels.common import stat_dtype
from .kernels.dispatch import backend_for
from .layer_config import LayerConfig

_EMPTY_SHAPE = (0,)


@torch.library.custom_op(
    "iabn::inplace_abn_forward_", mutates_args=("x", "running_mean", "running_var"),
    tags=(torch.Tag.flexible_layout,),
)
def inplace_abn_forward_(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    activation: str,
    activation_param: float,
    gamma_mode: str,
) -> tuple[Tensor, Tensor]:
    # An operator's schema takes scalars, not a LayerConfig: the fields travel one by one.
    config = LayerConfig(training, momentum, eps, activation, activation_param, gamma_mode)
    return backend_for(x).forward_(x, weight, bias, running_mean, running_var, config)


@inplace_abn_forward_.register_fake
def _(x, weight, bias, running_mean, running_var, training, momentum, eps, activation,
      activation_param, gamma_mode):
    dtype = stat_dtype(x, weight, running_mean)
    channels = x.shape[1]
    return x.new_empty((channels,), dtype=dtype), x.new_empty((channels,), dtype=dtype)


@torch.library.custom_op("iabn::inplace_abn_backward", mutates_args=())
def inplace_abn_backward(
    z: Tensor,
    dz: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    invstd: Tensor,
    scale: Tensor,
    training: bool,
    eps: float,
    activation: str,
    activation_param: float,
    gamma_mode: str,
    variant: int,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    config = LayerConfig(training, 0.0, eps, activation, activation_param, gamma_mode, variant)
    dx, dgamma, dbeta = backend_for(z).backward(
        z, dz, weight, bias, invstd, scale, config, output_mask
    )
    # An operator returns tensors, never None: gradients not asked for come back empty.
    empty = z.new_empty(_EMPTY_SHAPE)
    return (
        dx if dx is not None else empty,
        dgamma if dgamma is not None else empty.clone(),
        dbeta if dbeta is not None else empty.clone(),
    )


@inplace_abn_backward.register_fake
def _(z, dz, weight, bias, invstd, scale, training, eps, activation, activation_param,
      gamma_mode, variant, output_mask):
    want_dx, want_dgamma, want_dbeta = output_mask
    empty = z.new_empty(_EMPTY_SHAPE)
    return (
        torch.empty_like(z) if want_dx else empty,
        torch.empty_like(weight) if want_dgamma and weight is not None else empty.clone(),
        torch.empty_like(bias) if want_dbeta and bias is not None else empty.clone(),
    )


class _RegisteredOperators:
    """The registered operators behind the kernel modules' ``forward_``/``backward``
    interface: what the layer calls under ``torch.compile``, which needs operators, not
    Python. The config's fields become the operators' scalar arguments."""

    @staticmethod
    def forward_(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                 running_mean: Tensor | None, running_var: Tensor | None,
                 config: LayerConfig) -> tuple[Tensor, Tensor]:
        return inplace_abn_forward_(
            x, weight, bias, running_mean, running_var, config.training, config.momentum,
            config.eps, config.activation, config.activation_param, config.gamma_mode,
        )

    @staticmethod
    def backward(z: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                 invstd: Tensor, scale: Tensor, config: LayerConfig,
                 output_mask: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
        return inplace_abn_backward(
            z, dz, weight, bias, invstd, scale, config.training, config.eps, config.activation,
            config.activation_param, config.gamma_mode, config.variant, output_mask,
        )


def kernels_for(x: Tensor) -> Any:
    """What runs a layer on ``x``: the registered operators when compiling, else the kernel
    module :func:`~iabn.kernels.dispatch.backend_for` picks, called directly. Resolved once per
    layer call; backward reuses the forward's choice."""
    return _RegisteredOperators if torch.compiler.is_compiling() else backend_for(x)


def forward_(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, config: LayerConfig, kernels: Any = None,
) -> tuple[Tensor, Tensor]:
    """Run the forward kernel in place (``kernels`` as :func:`kernels_for` gives them)."""
    if kernels is None:
        kernels = kernels_for(x)
    return kernels.forward_(x, weight, bias, running_mean, running_var, config)


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
    :mod:`iabn.compiled`, which does not mark anything dirty.
    """
    return x.clone() if torch.compiler.is_compiling() else x


def needs_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    """Whether a group-norm or branch-bit layer call (the batch-norm path spells it out inline:
    its host cost is measured) must record an autograd node."""
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
    """Autograd for the in-place layer: the output is ``x`` itself, saved as ``z``."""

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
        kernels = kernels_for(x)
        invstd, scale = kernels.forward_(x, weight, bias, running_mean, running_var, config)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, invstd, scale)
        ctx.config = config
        ctx.kernels = kernels
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # the common case without a call
            refuse_double_backward("InPlaceABN")
        z, weight, bias, invstd, scale = ctx.saved_tensors
        c = ctx.config
        want_dx, want_dweight, want_dbias, _, _, _ = ctx.needs_input_grad
        mask = [want_dx, want_dweight and weight is not None, want_dbias and bias is not None]
        dx, dgamma, dbeta = ctx.kernels.backward(z, dz, weight, bias, invstd, scale, c, mask)
        return (
            dx if mask[0] else None, dgamma if mask[1] else None, dbeta if mask[2] else None,
            None, None, None,
        )
