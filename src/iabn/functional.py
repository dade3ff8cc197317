"""Functional forms: the arguments of ``torch.nn.functional.batch_norm`` plus the activation.

``inplace_abn`` overwrites ``input`` with its result and returns it; ``abn`` is the standard,
non-in-place composition (batch norm, then activation) with the same parametrisation.
``inplace_layer_norm`` and ``inplace_rms_norm`` take ``F.layer_norm``'s and ``F.rms_norm``'s
arguments (the modules: :mod:`iabn.layers.layer_norm`); ``inplace_activation`` and its named
forms (``inplace_gelu``...) the activations' (:mod:`iabn.layers.activation`).

Argument order follows ``F.batch_norm`` — ``(input, running_mean, running_var, weight, bias,
training, momentum, eps)`` — not the original ``inplace_abn`` package, whose functional put
``weight, bias`` before the running statistics. Pass them by keyword when porting, or use
:mod:`iabn.compat.functions`, which keeps the original's order and defaults. A running statistic
that requires grad (a parameter passed where a buffer belongs, the usual sign of the original's
order) is rejected with a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .autograd.activation import activation_call
from .autograd.batch_norm import compute_abn, compute_inplace
from .autograd.row_norm import row_norm_call
from .distributed.function import inplace_abn_sync
from .kernels.common import LAYER_NORM, RMS_NORM, RowConfig
from .layers.activation import check_activation_input, gelu_activation, standalone_activations
from .layers.checks import check_overwrite_input
from .layers.layer_norm import as_shape, check_norm_inputs
from .layers.options import check_flag, checked_call


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
        activation: invertible (``INVERTIBLE_ACTIVATIONS`` of
            :mod:`iabn.kernels.activations`: ``"leaky_relu"``, ``"elu"``, ``"identity"``), or
            with one minimum (``BRANCH_ACTIVATIONS``, e.g. ``"silu"``: a saved branch bit per
            element; docs/design.md).
        activation_param: leaky_relu's negative slope or elu's alpha (> 0).
        variant: backward variant of the paper, 2 (default) or 1.
        gamma_mode: ``"signed"`` (default, portable to ``nn.BatchNorm``) or ``"abs"``
            (``|gamma| + eps``, the original package); see :mod:`iabn.kernels.common`.
    """
    config, _ = checked_call("inplace_abn", input, running_mean, running_var, weight, bias,
                             training, momentum, eps, activation, activation_param, gamma_mode,
                             variant, in_place=True, branch=True)
    return compute_inplace(input, running_mean, running_var, weight, bias, config)


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

    Same arguments as :func:`inplace_abn`; ``activation`` may also be ``"relu"`` (each is
    computed as its ``torch.nn`` module computes it: ``"gelu"`` is exact ``F.gelu``). ``input``
    is not modified. In ``"signed"`` mode the weight is used as it is, without the
    ``|weight| >= eps`` clamp that the in-place backward needs: ``abn`` is exactly
    ``F.batch_norm`` followed by the activation.
    """
    config, _ = checked_call("abn", input, running_mean, running_var, weight, bias, training,
                             momentum, eps, activation, activation_param, gamma_mode,
                             in_place=False)
    return compute_abn(input, running_mean, running_var, weight, bias, config)


def inplace_layer_norm(input: Tensor, normalized_shape: int | Sequence[int],
                       weight: Tensor | None = None, bias: Tensor | None = None,
                       eps: float = 1e-5, *, overwrite_input: bool = True) -> Tensor:
    """:class:`iabn.InPlaceLayerNorm` as a function, with ``F.layer_norm``'s arguments."""
    check_flag("overwrite_input", overwrite_input)
    shape = as_shape(normalized_shape)
    check_norm_inputs(input, weight, bias, shape, kind=LAYER_NORM, channels=False,
                      in_place=overwrite_input)
    return row_norm_call(input, weight, bias, RowConfig(shape, eps, LAYER_NORM, False),
                         overwrite_input, "iabn.functional.inplace_layer_norm")


def inplace_rms_norm(input: Tensor, normalized_shape: int | Sequence[int],
                     weight: Tensor | None = None, eps: float | None = None, *,
                     overwrite_input: bool = True) -> Tensor:
    """:class:`iabn.InPlaceRMSNorm` as a function, with ``F.rms_norm``'s arguments."""
    check_flag("overwrite_input", overwrite_input)
    shape = as_shape(normalized_shape)
    check_norm_inputs(input, weight, None, shape, kind=RMS_NORM, channels=False,
                      in_place=overwrite_input)
    return row_norm_call(input, weight, None, RowConfig(shape, eps, RMS_NORM, False),
                         overwrite_input, "iabn.functional.inplace_rms_norm")


def inplace_activation(input: Tensor, activation: str, *, overwrite_input: bool = True,
                       activation_param: Any = 0.0, layer: str | None = None) -> Tensor:
    """``phi(input)`` of an activation that has an in-place layer of its own (one with one
    minimum, ``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"mish"``: one bit per element kept; an
    invertible one: nothing more), keeping only its output for backward; overwrites ``input``
    and returns it, or with ``overwrite_input=False`` returns a new tensor and leaves
    ``input`` as it is. ``activation_param``: the registry functions' parameter.
    ``layer`` names the caller in messages."""
    layer = layer or f"iabn.functional.inplace_activation({activation!r})"
    names = standalone_activations()
    if activation not in names:
        raise ValueError(
            f"{layer}: activation={activation!r}: use one of {', '.join(map(repr, names))} "
            f"(the activations with an in-place layer of their own)"
        )
    check_overwrite_input(overwrite_input)
    check_activation_input(input, layer, overwrite=overwrite_input)
    return activation_call(input, activation, activation_param, overwrite_input, layer)


def inplace_gelu(input: Tensor, approximate: str = "none", *,
                 overwrite_input: bool = True) -> Tensor:
    """``F.gelu(input, approximate=approximate)`` that keeps only its output and one bit per
    element for backward (:class:`iabn.InPlaceGELU`): written into ``input``, which is
    returned, or with ``overwrite_input=False`` into a new tensor."""
    return inplace_activation(input, gelu_activation(approximate),
                              overwrite_input=overwrite_input,
                              layer="iabn.functional.inplace_gelu")


def inplace_silu(input: Tensor, *, overwrite_input: bool = True) -> Tensor:
    """``F.silu(input)`` that keeps only its output and one bit per element for backward
    (:class:`iabn.InPlaceSiLU`); ``overwrite_input`` as :func:`inplace_gelu`."""
    return inplace_activation(input, "silu", overwrite_input=overwrite_input,
                              layer="iabn.functional.inplace_silu")


def inplace_mish(input: Tensor, *, overwrite_input: bool = True) -> Tensor:
    """``F.mish(input)`` that keeps only its output and one bit per element for backward
    (:class:`iabn.InPlaceMish`); ``overwrite_input`` as :func:`inplace_gelu`."""
    return inplace_activation(input, "mish", overwrite_input=overwrite_input,
                              layer="iabn.functional.inplace_mish")


__all__ = ["abn", "inplace_abn", "inplace_abn_sync", "inplace_activation", "inplace_gelu",
           "inplace_layer_norm", "inplace_mish", "inplace_rms_norm", "inplace_silu"]
