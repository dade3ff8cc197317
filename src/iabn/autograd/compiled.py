"""The in-place layer under ``torch.compile``: forward and backward as ATen operations that the
compiler traces into its graphs (docs/design.md, "Under torch.compile").

Eager mode calls the kernels directly (:mod:`iabn.autograd.batch_norm`); while Dynamo traces, the
layer runs
:func:`traced_inplace_abn` instead, in which every operation is visible: Inductor fuses the
batch-norm
statistics, the normalisation and the activation with their neighbours, and the backward
(inverse activation, its derivative, batch-norm backward) into a few kernels, with no call
back into Python per layer.

What is kept for backward is decided by AOTAutograd's min-cut partitioner from the joint graph
of forward and backward, not by ``save_for_backward`` (it may save other values of the forward
or recompute them). Per layer it keeps one full-size tensor and ``(C,)`` tensors, because of
the structure here:

- the backward is written from ``z`` alone (``y = phi^-1(z)``): no node of the backward reads
  ``x`` or the forward's ``y`` (the partitioner cannot tell that the inversion gives ``y``
  back), so either would be saved only to recompute ``z`` from it;
- ``z`` is what the next operation reads; where that is a convolution, which keeps its input,
  ``z`` is written to memory anyway and it is the tensor saved;
- the autograd function returns ``z`` itself, not the input it overwrites (below): were the
  caller handed the overwritten input, the graph would hold two nodes with ``z``'s values
  (the function's output and the input's updated value), and a partitioner without Inductor's
  removal of no-op copies (``aot_eager``) saves both.

Where ``z`` feeds only operations Inductor fuses (pooling, a residual addition) the partitioner
may keep the input ``x`` instead and recompute ``z`` from it in backward: the same bytes, and
``z`` then never goes to memory (``x``, a convolution's output, is in memory anyway, which is
also why it is preferred to ``y``, never chosen in the graphs measured). This is deliberately
not forced: the only marking the partitioner honours is selective activation checkpointing
(``MUST_SAVE``), which, tried, also kept ``z`` of every layer inside a user's
``torch.utils.checkpoint`` region (where everything is otherwise recomputed), overrides
``activation_memory_budget`` and writes ``z`` where it would be fused away.
``tests/core/test_compile.py`` checks what the graphs Inductor would compile keep.

**In place.** The function's output is a new tensor; :func:`inplace_abn` then copies it into
the input, so the caller's tensor is overwritten as in eager mode, and returns the output,
which holds the same values. Functionalisation turns that copy into a renaming where the input
is an intermediate of the graph (no pass is added); where it is a graph input (a graph break
just before the layer, a layer compiled alone) AOTAutograd writes it back after the graph, one
pass. Not calling ``ctx.mark_dirty`` also avoids the compiler's loss of it on graph inputs
(torch 2.13-2.14; :func:`iabn.autograd.call.overwritable`), so no defensive copy is needed here.

**No in-place operation makes the output.** The function's forward computes ``z`` with an
out-of-place activation (:func:`iabn.kernels.activations.apply`). Torch 2.11's Dynamo returns every
intermediate tensor of an autograd Function's forward as an extra output of the traced
Function; with the activation written in place into batch norm's output, that output was one
of them and the same tensor as ``z``, so autograd bound ``z`` to the intermediate's output slot,
whose gradient the backward ignores: the layer's input, weight and bias gradients were wrong by
their full size (Dynamo alone shows it, ``backend="eager"``), which is why the compiled
training step of torch 2.11.0 was off. Torch 2.12.0 onwards leave out the intermediates that
alias an output; the out-of-place activation is correct on both, at no cost in the compiled
graph (functionalisation makes every operation out of place there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..kernels import traceable
from ..kernels.common import LayerConfig
from .call import grad_mask

#: Whether the compiler is given the traceable layer (else the opaque ``iabn::`` operators of
#: :mod:`iabn.autograd.operators`). On for every supported torch: tests/core/test_compile.py passes
#: on 2.11.0,
#: 2.12.0, 2.13.0 and 2.14.1 (CPU). It was on from 2.14 only while the forward wrote the
#: activation in place, which gave torch 2.11.0 wrong gradients ("No in-place operation makes
#: the output" above).
TRACEABLE = True


class TracedInPlaceABNFunction(torch.autograd.Function):
    """Autograd of the in-place layer for the compiler: returns ``z`` as a new tensor and saves
    it with ``(C,)`` tensors only."""

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
        z, invstd, scale = traceable.forward(x, weight, bias, running_mean, running_var, config)
        ctx.save_for_backward(z, weight, bias, invstd, scale)
        ctx.config = config
        return z

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        z, weight, bias, invstd, scale = ctx.saved_tensors
        dx, dgamma, dbeta = traceable.backward(
            z, dz, weight, bias, invstd, scale, ctx.config, grad_mask(ctx, weight, bias)
        )
        return dx, dgamma, dbeta, None, None, None


def traced_inplace_abn(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig,
) -> Tensor:
    """The in-place layer while compiling: ``input`` is overwritten with the output, which is
    returned (a tensor with the same values; see the module docstring)."""
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
    if needs_grad:
        z = TracedInPlaceABNFunction.apply(
            input, weight, bias, running_mean, running_var, config
        )
    else:
        z, _, _ = traceable.forward(input, weight, bias, running_mean, running_var, config)
    input.copy_(z)
    return z


__all__ = ["TracedInPlaceABNFunction", "traced_inplace_abn"]
