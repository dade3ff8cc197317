"""The ``torch.library`` operators of the in-place layer, for code that calls
:class:`~iabn.autograd.batch_norm.InPlaceABNFunction` itself while compiling (the layers compile
through :mod:`iabn.autograd.compiled` instead, and eager mode calls the kernels directly:
the Python custom-op dispatcher costs about 60 µs per layer and step, measured on CPU, float32,
tiny tensors). Each has a fake implementation and is checked by ``torch.library.opcheck``
(``tests/core/test_compile.py``). A thin layer over the kernel backend
(:func:`iabn.kernels.backends.backend_for`):

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

An operator's schema admits no Python object: the :class:`~iabn.kernels.common.LayerConfig`'s
fields travel one by one (:class:`RegisteredOperators` converts at that boundary), and the
operators carry no branch bits (with bits, the compiler traces the backend's own operations).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.backends import backend_for
from ..kernels.common import LayerConfig, stat_dtype

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
    return backend_for(x, activation).forward_(x, weight, bias, running_mean, running_var, config)


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
    dx, dgamma, dbeta = backend_for(z, activation).backward(
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


class RegisteredOperators:
    """The registered operators behind the kernel modules' ``forward_``/``backward``
    interface: what the layer calls under ``torch.compile``, which needs operators, not
    Python. The config's fields become the operators' scalar arguments."""

    @staticmethod
    def forward_(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                 running_mean: Tensor | None, running_var: Tensor | None,
                 config: LayerConfig, bits: None = None) -> tuple[Tensor, Tensor]:
        return inplace_abn_forward_(
            x, weight, bias, running_mean, running_var, config.training, config.momentum,
            config.eps, config.activation, config.activation_param, config.gamma_mode,
        )

    @staticmethod
    def backward(z: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                 invstd: Tensor, scale: Tensor, config: LayerConfig,
                 output_mask: list[bool], bits: None = None) -> tuple[Tensor, Tensor, Tensor]:
        return inplace_abn_backward(
            z, dz, weight, bias, invstd, scale, config.training, config.eps, config.activation,
            config.activation_param, config.gamma_mode, config.variant, output_mask,
        )
