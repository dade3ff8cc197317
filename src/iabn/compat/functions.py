"""``inplace_abn.functions`` of the original package, computed by iabn.

Same names, positional order and defaults as the original 1.1.0:
``inplace_abn(x, weight, bias, running_mean, running_var, training=True, momentum=0.1,
eps=1e-5, activation="leaky_relu", activation_param=0.01)`` (``inplace_abn_sync`` adds
``group``), with the original's scale ``|weight| + eps`` (``gamma_mode="abs"``). ``x`` is
overwritten with the result, which is returned.
"""

# No `from __future__ import annotations`: TorchScript reads these signatures (below) and
# needs the annotations as objects, not strings.
from typing import Any

import torch
from torch import Tensor

from .. import functional
from ..kernels.common import ABS
from .abn import is_zero_slope, relu_keeping_mask_, warn_zero_slope


# TorchScript cannot compile iabn's layer (an autograd Function with Python-side checks), so
# a scripted module that calls these functions (timm's norm-act layers with jit=True) calls
# them as Python: it scripts and runs in Python; torch.jit.save refuses it, naming the call.
@torch.jit.ignore
def inplace_abn(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
) -> Tensor:
    """``x <- act((|weight| + eps) * xhat + bias)``; see :func:`iabn.functional.inplace_abn`.

    ``activation="leaky_relu", activation_param=0.0`` is ReLU, which cannot be inverted: it
    is computed exactly as :func:`iabn.functional.abn` computes batch norm, then ReLU by
    :func:`~iabn.compat.abn.relu_keeping_mask_`, and returns a new tensor (``x`` is kept for
    backward, so it is not overwritten; so is a bool mask, not the result, which the caller
    may overwrite), with one warning."""
    if is_zero_slope(activation, activation_param):
        warn_zero_slope("inplace_abn")
        return relu_keeping_mask_(functional.abn(
            x, running_mean, running_var, weight, bias, training, momentum, eps, "identity",
            0.0, gamma_mode=ABS))
    return functional.inplace_abn(
        x, running_mean, running_var, weight, bias, training, momentum, eps, activation,
        activation_param, gamma_mode=ABS,
    )


@torch.jit.ignore
def inplace_abn_sync(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-05,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    group: Any = None,
) -> Tensor:
    """:func:`inplace_abn` with batch statistics over the ranks of ``group`` (``None``: the
    whole world); see :func:`iabn.distributed.inplace_abn_sync`."""
    from ..distributed import inplace_abn_sync as synchronised

    return synchronised(
        x, running_mean, running_var, weight, bias, training, momentum, eps, activation,
        activation_param, gamma_mode=ABS, group=group,
    )


__all__ = ["inplace_abn", "inplace_abn_sync"]
