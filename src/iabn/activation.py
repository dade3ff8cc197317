"""Activations that can follow the normalisation, and the pieces the in-place layer needs.

An in-place layer stores only its output ``z = phi(y)``; backward recovers ``y`` by inverting
``phi``. So the in-place layer accepts only invertible activations. ``relu`` is not invertible
(every negative ``y`` maps to 0) and is available only in the non-in-place :class:`iabn.ABN`.

All functions here run PyTorch's own vectorised kernels (``leaky_relu``, ``elu`` and their
``*_backward`` ops evaluated from the output), never per-element Python.

``silu`` and ``gelu`` are not invertible (each has one minimum, so an output above it comes
from two inputs); the in-place batch-norm layers (``InPlaceABN``, ``InPlaceABNSync``) take them
with one saved bit per element that names the branch (:mod:`iabn.branch_activation`). The
in-place group-norm layer does not.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

LEAKY_RELU = "leaky_relu"
ELU = "elu"
IDENTITY = "identity"
RELU = "relu"
SILU = "silu"
GELU = "gelu"

# Resolved overloads: calling an OpOverload skips the packet's overload resolution (~0.3 µs).
_LEAKY_RELU_BACKWARD = torch.ops.aten.leaky_relu_backward.default
_LEAKY_RELU_BACKWARD_OUT = torch.ops.aten.leaky_relu_backward.grad_input

#: Activations the in-place layer can invert.
INVERTIBLE_ACTIVATIONS = (LEAKY_RELU, ELU, IDENTITY)
#: Activations the in-place layer inverts with a saved branch bit (iabn.branch_activation).
BRANCH_ACTIVATIONS = (SILU, GELU)
#: Activations of the in-place layer.
IN_PLACE_ACTIVATIONS = INVERTIBLE_ACTIVATIONS + BRANCH_ACTIVATIONS
#: Activations of the non-in-place :class:`iabn.ABN`.
ALL_ACTIVATIONS = (LEAKY_RELU, ELU, IDENTITY, RELU, SILU, GELU)


def check_activation(activation: str, activation_param: float, *, in_place: bool,
                     branch: bool = False) -> None:
    """Raise a ``ValueError`` naming the fix when ``activation`` cannot be used.

    ``branch``: the in-place layer keeps a branch bit (``iabn.InPlaceABN``,
    ``iabn.InPlaceABNSync``, ``iabn.ABNSync`` and their functionals), so it takes ``silu`` and
    ``gelu``; the other in-place layers (group norm, BNActConv's in-place strategies) invert
    from the output alone and refuse them.

    ``activation_param`` is the negative slope of ``leaky_relu`` and ``alpha`` of ``elu``; both
    must be positive so that the function is invertible. It is ignored by ``identity`` and
    ``relu``.
    """
    if not in_place:
        allowed = ALL_ACTIVATIONS
    else:
        allowed = IN_PLACE_ACTIVATIONS if branch else INVERTIBLE_ACTIVATIONS
    if in_place and not branch and activation in BRANCH_ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not invertible, and this layer recovers its input "
            f"from its output alone: only the batch-norm layers (iabn.InPlaceABN, "
            f"iabn.InPlaceABNSync, iabn.ABNSync and their functionals) keep the branch bit "
            f"{activation} needs; "
            f"use the not-in-place layer (iabn.ABN, iabn.GroupNormAct) or an invertible "
            f"activation ('leaky_relu', 'elu', 'identity')"
        )
    if activation == RELU and in_place:
        raise ValueError(
            "activation='relu' is not invertible, so the in-place layer cannot recover its "
            "input in backward: use activation='leaky_relu' (e.g. activation_param=0.01) "
            "or the non-in-place ABN for relu"
        )
    if activation not in allowed:
        raise ValueError(
            f"unknown activation={activation!r}: use one of {', '.join(map(repr, allowed))}"
        )
    if not isinstance(activation_param, numbers.Real) or isinstance(activation_param, bool):
        raise TypeError(
            f"activation_param={activation_param!r}: must be a number (leaky_relu's negative "
            f"slope or elu's alpha, e.g. 0.01)"
        )
    if activation in (LEAKY_RELU, ELU):
        name = "negative slope" if activation == LEAKY_RELU else "alpha"
        param = float(activation_param)
        if not param > 0 or param == float("inf"):
            raise ValueError(
                f"activation_param={activation_param!r} is the {name} of {activation} and must "
                f"be a finite number > 0 (e.g. 0.01 for leaky_relu, 1.0 for elu)"
                + (
                    "; a zero slope is relu, which only the non-in-place ABN accepts"
                    if activation == LEAKY_RELU and param == 0
                    else ""
                )
            )


def apply_(x: Tensor, activation: str, activation_param: float) -> Tensor:
    """Apply the activation to ``x`` in place and return ``x``; ``gelu`` of a tensor that
    autograd records returns a new tensor (callers use the returned one)."""
    if activation == LEAKY_RELU:
        return F.leaky_relu_(x, activation_param)
    if activation == ELU:
        return F.elu_(x, activation_param)
    if activation == RELU:
        return F.relu_(x)
    if activation == IDENTITY:
        return x
    if activation == SILU:
        return F.silu(x, inplace=True)
    if activation == GELU:
        # torch's own exact GELU (the not-in-place layers compute what nn.GELU computes).
        # Its backward reads its input: where autograd records x, x must stay as it is.
        if x.requires_grad and torch.is_grad_enabled():
            return F.gelu(x)
        return x.copy_(F.gelu(x))
    raise ValueError(f"unknown activation={activation!r}: use one of {ALL_ACTIVATIONS}")


def apply(x: Tensor, activation: str, activation_param: float) -> Tensor:
    """Return the activation of ``x`` as a new tensor (``x`` is only read); for ``identity``
    the result *is* ``x``."""
    if activation == LEAKY_RELU:
        return F.leaky_relu(x, activation_param)
    if activation == ELU:
        return F.elu(x, activation_param)
    if activation == RELU:
        return F.relu(x)
    if activation == IDENTITY:
        return x
    if activation == SILU:
        return F.silu(x)
    if activation == GELU:
        return F.gelu(x)
    raise ValueError(f"unknown activation={activation!r}: use one of {ALL_ACTIVATIONS}")


def invert(
    z: Tensor, activation: str, activation_param: float, out: Tensor | None = None
) -> Tensor:
    """Return ``y = phi^-1(z)``; ``z`` is left untouched (never write through the result).

    ``z`` may still be needed by another backward (``retain_graph=True``), so it is never
    overwritten here. For ``identity`` the result *is* ``z``. ``out``, a tensor shaped like
    ``z``, receives the result where the kernel can write into it (``leaky_relu``).
    """
    if activation == LEAKY_RELU:
        # The inverse of a leaky ReLU with slope a is a leaky ReLU with slope 1/a.
        # torch._C._nn.leaky_relu is F.leaky_relu's own binding; it takes out= directly, at
        # half the host cost of the torch.ops.aten overload (0.9 vs 1.7 µs per call, measured).
        return torch._C._nn.leaky_relu(z, 1.0 / activation_param, out=out)
    if activation == ELU:
        # y = log1p(z / alpha) for z <= 0. Where exp(y) underflowed in forward, z == -alpha
        # and log1p(-1) = -inf; clamping keeps y finite. Its gradient there is
        # dz * (z + alpha) = 0, so the clamp does not change any gradient.
        alpha = activation_param
        tiny = torch.finfo(z.dtype).eps
        negative = torch.log1p((z.clamp(max=0) / alpha).clamp(min=-1 + tiny))
        return negative.add_(z.clamp(min=0))
    return z


def grad_from_output(
    dz: Tensor, z: Tensor, activation: str, activation_param: float, out: Tensor | None = None
) -> Tensor:
    """Return ``dy = phi'(y) * dz`` from the output ``z`` (for ``identity`` it is ``dz``).

    ``out`` as in :func:`invert`.
    """
    if activation == LEAKY_RELU:
        if out is not None:
            return _LEAKY_RELU_BACKWARD_OUT(dz, z, activation_param, True, grad_input=out)
        return _LEAKY_RELU_BACKWARD(dz, z, activation_param, True)
    if activation == ELU:
        return torch.ops.aten.elu_backward(dz, activation_param, 1, 1, True, z)
    if activation == RELU:
        # relu's output tells where its input was positive, so its derivative needs no inverse
        return torch.ops.aten.threshold_backward(dz, z, 0)
    return dz
