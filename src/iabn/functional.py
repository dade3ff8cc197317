"""Functional forms: the arguments of ``torch.nn.functional.batch_norm`` plus the activation.

``inplace_abn`` overwrites ``input`` with its result and returns it; ``abn`` is the standard,
non-in-place composition (batch norm, then activation) with the same parametrisation.

Argument order follows ``F.batch_norm`` — ``(input, running_mean, running_var, weight, bias,
training, momentum, eps)`` — not the original ``inplace_abn`` package, whose functional put
``weight, bias`` before the running statistics. Pass them by keyword when porting, or use
:mod:`iabn.compat.functions`, which keeps the original's order and defaults. A running statistic
that requires grad (a parameter passed where a buffer belongs, the usual sign of the original's
order) is rejected with a ``ValueError``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import activation as act
from . import debug
from .checks import check_inputs, check_options
from .ops import InPlaceABNFunction, LayerConfig, forward_, overwritable
from .scale import ABS, abs_sign


def inplace_abn(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    *,
    variant: int = 2,
    gamma_mode: str = "signed",
) -> Tensor:
    """In-place activated batch norm: ``input <- phi(scale(weight) * xhat + bias)``.

    Args:
        input: ``(N, C, *spatial)`` with 0–3 spatial dims, float16/bfloat16/float32/float64,
            any memory format. Overwritten with the result, which is returned. It must not be a
            leaf that requires grad (use :func:`abn`).
        running_mean, running_var: ``(C,)`` buffers, updated in place when ``training=True``
            (unbiased variance, like ``nn.BatchNorm``); used for normalisation when
            ``training=False``. May be ``None`` when ``training=True``.
        weight, bias: ``(C,)`` gamma and beta, or ``None`` for 1 and 0.
        training: normalise with batch statistics (``True``) or running statistics.
        momentum: running-statistics update factor.
        eps: added to the variance; also the smallest ``|scale(weight)|``.
        activation: ``"leaky_relu"``, ``"elu"`` or ``"identity"`` (must be invertible).
        activation_param: leaky_relu's negative slope or elu's alpha (> 0).
        variant: backward variant of the paper, 2 (default) or 1.
        gamma_mode: ``"signed"`` (default, portable to ``nn.BatchNorm``) or ``"abs"``
            (``|gamma| + eps``, the original package); see :mod:`iabn.scale`.
    """
    check_options(activation, activation_param, gamma_mode, in_place=True, variant=variant)
    _check_argument_order("inplace_abn", running_mean, running_var)
    check_inputs(input, running_mean, running_var, weight, bias, training, in_place=True)
    return _inplace_abn_unchecked(
        input, running_mean, running_var, weight, bias, training, momentum, eps,
        activation, activation_param, variant, gamma_mode,
    )


def abn(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    *,
    gamma_mode: str = "signed",
) -> Tensor:
    """Activated batch norm without the in-place trick (stores ``input`` and the output).

    Same arguments as :func:`inplace_abn`; ``activation`` may also be ``"relu"``. ``input``
    is not modified. In ``"signed"`` mode the weight is used as it is, without the
    ``|weight| >= eps`` clamp that the in-place backward needs: ``abn`` is exactly
    ``F.batch_norm`` followed by the activation.
    """
    check_options(activation, activation_param, gamma_mode, in_place=False)
    _check_argument_order("abn", running_mean, running_var)
    check_inputs(input, running_mean, running_var, weight, bias, training, in_place=False)
    return _abn_unchecked(
        input, running_mean, running_var, weight, bias, training, momentum, eps,
        activation, activation_param, gamma_mode,
    )


def _check_argument_order(function: str, running_mean: Tensor | None,
                          running_var: Tensor | None) -> None:
    """Running statistics are buffers; one that requires grad is almost always a ``weight`` or
    ``bias`` passed in the original package's order ``(x, weight, bias, running_mean, ...)``,
    which would otherwise give NaN or an obscure ATen error."""
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if isinstance(t, Tensor) and t.requires_grad:
            raise ValueError(
                f"iabn.functional.{function}: {name} requires grad, so it looks like a weight or "
                f"bias: iabn's order is (input, running_mean, running_var, weight, bias, "
                f"training, ...) like F.batch_norm, not the original inplace_abn's (x, weight, "
                f"bias, running_mean, running_var, ...). Pass the tensors by keyword, or use "
                f"iabn.compat.functions.{function if function != 'abn' else 'inplace_abn'}, "
                f"which keeps the original order and defaults (training=True, |weight| + eps)"
            )


def _inplace_abn_unchecked(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, training: bool, momentum: float, eps: float,
    activation: str, activation_param: float, variant: int, gamma_mode: str,
) -> Tensor:
    # Every in-place call but the synchronised one passes here; the debug mode
    # (iabn.debug.poison_overwritten) reruns this function on a copy of the input.
    if debug._ACTIVE and debug.intercepts():
        return debug.poisoned_call(
            lambda copy: _inplace_abn_unchecked(
                copy, running_mean, running_var, weight, bias, training, momentum, eps,
                activation, activation_param, variant, gamma_mode,
            ),
            input, "iabn.functional.inplace_abn",
        )
    config = LayerConfig(
        training, momentum, eps, activation, activation_param, gamma_mode, variant
    )
    # Spelled out: a generator over the three tensors costs a microsecond per layer call.
    needs_grad = torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
    if not needs_grad:
        forward_(input, weight, bias, running_mean, running_var, config)
        return input
    return InPlaceABNFunction.apply(
        overwritable(input), weight, bias, running_mean, running_var, config
    )


def _abn_unchecked(
    input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, training: bool, momentum: float, eps: float,
    activation: str, activation_param: float, gamma_mode: str,
) -> Tensor:
    if weight is not None and gamma_mode == ABS:
        # Signed mode uses the weight as it is: nothing is inverted here, so |weight| < eps
        # needs no clamp and ABN computes exactly nn.BatchNorm + activation.
        # |weight| + eps with d/dweight = +1 at 0 (scale.gamma_grad), not autograd's 0
        weight = weight * abs_sign(weight.detach()) + eps
    y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    # The batch-norm output is a fresh tensor that batch norm's backward does not need, so the
    # activation may overwrite it.
    return act.apply_(y, activation, activation_param)


def inplace_abn_sync(*args, **kwargs) -> Tensor:
    """:func:`inplace_abn` with batch statistics synchronised over ``torch.distributed``
    (extra keyword ``group``); see :func:`iabn.distributed.inplace_abn_sync`."""
    from .distributed import inplace_abn_sync as synchronised  # distributed imports this module

    return synchronised(*args, **kwargs)


__all__ = ["abn", "inplace_abn", "inplace_abn_sync"]
