"""The layer computations without validation: what the functionals run after their checks and
the modules after theirs (``checks.py``; docs/design.md, "The in-place contract").

Kept apart from ``functional.py`` so that the synchronised functional (``sync.py``) and the
modules can use them without importing each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad

from . import branch_activation, compiled, debug
from .checks import functorch_active
from .kernels import activations as act
from .layer_config import LayerConfig
from .ops import InPlaceABNFunction, forward_, overwritable
from .scale import ABS, abs_sign, effective_scale


def inplace_abn_unchecked(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, config: LayerConfig,
) -> Tensor:
    """Overwrite ``input`` with the layer's output and return it (autograd node when needed)."""
    # Every in-place call but the synchronised one passes here; the debug mode
    # (iabn.debug.poison_overwritten) reruns this function on a copy of the input.
    if debug._ACTIVE and debug.intercepts():
        return debug.poisoned_call(
            lambda copy: inplace_abn_unchecked(
                copy, running_mean, running_var, weight, bias, config
            ),
            input, "iabn.functional.inplace_abn",
        )
    if _transformed():
        return _inplace_abn_composed(input, running_mean, running_var, weight, bias, config)
    if config.activation in act.BRANCH_ACTIVATIONS:
        # silu, gelu: their own autograd Function, with a branch bit per element
        return branch_activation.inplace_abn(
            input, running_mean, running_var, weight, bias, config
        )
    if torch.compiler.is_compiling() and compiled.TRACEABLE:
        # ATen operations the compiler sees (iabn.compiled)
        return compiled.inplace_abn(input, running_mean, running_var, weight, bias, config)
    # Spelled out: a generator over the three tensors costs a microsecond per layer call.
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
    if not needs_grad:
        forward_(input, weight, bias, running_mean, running_var, config)
        return input
    # overwritable: a copy where the compiler is given the opaque iabn:: operators instead
    # (compiled.TRACEABLE off)
    return InPlaceABNFunction.apply(
        overwritable(input), weight, bias, running_mean, running_var, config
    )


def _transformed() -> bool:
    """Whether forward-mode AD (a ``forward_ad.dual_level``) or a ``torch.func`` transform
    (``jvp``, ``vmap``, ``grad``, ``jacfwd``...) is active. The in-place autograd Function
    has a backward only, and ``torch.func`` cannot run a Function that sets up its context in
    ``forward``; under these the layer is computed by composition (about 0.2 µs a call to
    ask, measured on CPU)."""
    return (
        forward_ad._current_level >= 0 or functorch_active()
    ) and not torch.compiler.is_compiling()


def _inplace_abn_composed(
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
    out = abn_unchecked(input.clone(), running_mean, running_var, weight, bias, config)
    return input.copy_(out)


def abn_unchecked(
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


__all__ = ["abn_unchecked", "inplace_abn_unchecked"]
