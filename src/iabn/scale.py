"""The effective BatchNorm scale ``g = scale(gamma)`` of the in-place layers (docs/design.md,
"The math").

The in-place layer divides by ``g`` in backward, so ``g`` must stay away from zero. Two ways:

``"signed"`` (default)
    ``g = sign(gamma) * max(|gamma|, eps)`` with ``sign(+0.0) = +1``. Wherever ``|gamma| >= eps``,
    ``g == gamma``: a ``state_dict`` trained with ``nn.BatchNorm`` loads and gives the same
    outputs. The gradient passes straight through (``dgamma = dg``), so a gamma inside the
    clamp can still move out of it.
``"abs"``
    ``g = |gamma| + eps``, the parametrisation of the original ``inplace_abn`` package; use it to
    load that package's checkpoints. ``dgamma = -dg`` where ``gamma < 0``, else ``+dg``: the
    derivative of ``|gamma|`` taken as +1 at 0, as that package did, so a zero-initialised
    gamma (e.g. TResNet's last BN of each residual branch) still trains.
"""

from __future__ import annotations

import torch
from torch import Tensor

SIGNED = "signed"
ABS = "abs"
GAMMA_MODES = (SIGNED, ABS)


def check_gamma_mode(gamma_mode: str) -> None:
    if gamma_mode not in GAMMA_MODES:
        raise ValueError(
            f"unknown gamma_mode={gamma_mode!r}: use 'signed' (weights portable to and from "
            f"nn.BatchNorm) or 'abs' (|gamma| + eps, as the original inplace_abn package)"
        )


def effective_scale(gamma: Tensor, eps: float, gamma_mode: str) -> Tensor:
    """Return ``g = scale(gamma)`` as a new tensor (no autograd through it)."""
    if gamma_mode == ABS:
        return gamma.abs() + eps
    # copysign keeps the sign bit, so sign(+0.0) = +1 (and a stored -0.0 gives -eps)
    return gamma.abs().clamp_(min=eps).copysign_(gamma)


def gamma_grad(dg: Tensor, gamma: Tensor, gamma_mode: str) -> Tensor:
    """Chain ``dL/dg`` back to ``dL/dgamma``."""
    if gamma_mode == ABS:
        return torch.where(gamma < 0, -dg, dg)
    return dg


def abs_sign(gamma: Tensor) -> Tensor:
    """The factor ``d|gamma|/dgamma`` of abs mode: -1 where ``gamma < 0``, else +1 (also at
    ``+0.0`` and ``-0.0``)."""
    return torch.where(gamma < 0, -1.0, 1.0).to(gamma.dtype)
