"""The In-Place ABN forward and backward as ATen operations the compiler can see through.

What the layer runs under ``torch.compile`` (and ``torch.export``): the interface of the
kernel modules (``forward_``, ``backward``; :mod:`.reference`), written only with functional
ATen operations so that Dynamo traces them into the graph and Inductor fuses them with their
neighbours (a convolution's epilogue, the next layer's reads) instead of calling back into
Python for an opaque operator per layer.

- ``forward_``: ``native_batch_norm`` (which Inductor decomposes into one reduction and a
  pointwise pass; it also updates the running statistics, once: functionalisation turns the
  update into graph outputs written back after the graph), the activation out of place, and
  ``x.copy_(z)``. Functionalisation turns that copy into a rename where ``x`` is an
  intermediate of the graph, so no pass is added there.
- ``backward``: ``y = phi^-1(z)`` and ``dy = phi'(y) dz`` from the saved output, then ATen's
  batch-norm backward under the identity of :mod:`.reference` (``input = y``,
  ``mean = beta``, ``invstd = 1/g``, ``weight = g^2 invstd``); Inductor decomposes it into two
  reductions and one pointwise pass, fused with the inversion.

Unlike :mod:`.reference` nothing here writes into an ``out=`` buffer or a reused scratch
buffer: a trace records tensors, and a buffer kept between calls in Python would be a
constant of the graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import activations as act
from .common import (
    BATCH_NORM_BACKWARD,
    LayerConfig,
    cast,
    channel_view,
    compute_dtype,
    effective_g,
    empty_grads,
    empty_invstd,
    finish_grads,
    running_invstd,
    stat_dtype,
)


def traces(config: LayerConfig) -> bool:
    """Whether these operations compute the layer: its activation is invertible (one with a
    branch bit is traced through the backends' own operations)."""
    return act.ACTIVATIONS[config.activation].invertible


def forward(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    config: LayerConfig,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(z, invstd, g)``: the layer's output ``z = phi(g * (x - mu) * invstd + beta)`` as a new
    tensor (``x`` is only read) and the per-channel tensors backward needs, as
    :func:`.reference.forward_` returns them. Updates the running statistics when
    ``config.training`` and they are given."""
    training, momentum, eps, activation, activation_param, gamma_mode, _ = config
    channels = x.shape[1]
    sdtype = stat_dtype(x, weight, running_mean)
    g = effective_g(weight, eps, gamma_mode, channels, sdtype, x.device)
    if x.numel() == 0:
        invstd = empty_invstd(training, running_var, eps, channels, sdtype, x.device)
        return torch.empty_like(x), invstd, g
    beta = cast(bias, sdtype) if bias is not None else None
    y, _, invstd = torch.native_batch_norm(
        x, g, beta, running_mean, running_var, training, momentum, eps
    )
    if not training:
        invstd = running_invstd(running_var, eps, sdtype)
    # Out of place, though nothing else reads y: inside the autograd Function, torch 2.11's
    # Dynamo also returns every intermediate of the forward, and an in-place activation made y
    # the same tensor as z, whose gradient then went to y's unused slot (iabn.autograd.compiled).
    # In the
    # compiled graph functionalisation makes every operation out of place anyway.
    return act.apply(y, activation, activation_param), invstd, g


def forward_(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    config: LayerConfig,
) -> tuple[Tensor, Tensor]:
    """Overwrite ``x`` with the output; return ``(invstd, g)`` (the interface of
    :func:`.reference.forward_`)."""
    z, invstd, g = forward(x, weight, bias, running_mean, running_var, config)
    x.copy_(z)
    return invstd, g


def backward(
    z: Tensor,
    dz: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    invstd: Tensor,
    scale: Tensor,
    config: LayerConfig,
    output_mask: list[bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Gradients ``(dx, dgamma, dbeta)`` from the stored output ``z`` (as
    :func:`.reference.backward`, the same math)."""
    if z.numel() == 0:
        return empty_grads(z, weight, bias, output_mask)
    training, _, eps, activation, activation_param, gamma_mode, variant = config
    want_dx, want_dgamma, want_dbeta = output_mask
    cdtype = compute_dtype(z.dtype)
    zc, dzc = cast(z, cdtype), cast(dz, cdtype)
    y = act.invert(zc, activation, activation_param)
    dy = act.grad_from_output(dzc, zc, activation, activation_param)
    g = cast(scale, cdtype)
    beta = cast(bias, cdtype) if bias is not None else torch.zeros_like(g)
    invstd = cast(invstd, cdtype)
    inv_g = g.reciprocal()
    ndim = z.dim()
    if variant == 1:
        bn_input = torch.addcmul(channel_view(-beta * inv_g, ndim), y, channel_view(inv_g, ndim))
        center, inv_scale = torch.zeros_like(g), torch.ones_like(g)
        dx_weight = g * invstd
    else:
        bn_input, center, inv_scale = y, beta, inv_g
        dx_weight = g * g * invstd
    dx, dg, dbeta = BATCH_NORM_BACKWARD(
        dy, bn_input, dx_weight, None, None, center, inv_scale, True, eps,
        [want_dx and training, want_dgamma, want_dbeta],
    )
    if want_dx and not training:
        dx = dy * channel_view(g * invstd, ndim)
    return finish_grads(dx, dg, dbeta, z, weight, bias, gamma_mode, output_mask)
