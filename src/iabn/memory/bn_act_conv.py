"""``BNActConv``: norm -> activation -> convolution with the memory strategies of the paper's
Figure 2 (§3.2), all computing the same outputs, gradients and running statistics.

==================  =====================================================  ==================
strategy            kept for backward (besides parameters)                 recomputed
==================  =====================================================  ==================
``standard``        ``x`` (BN input) and ``z`` (conv input)                nothing
``checkpoint``      ``x``, ``mean``, ``invstd``                            ``z`` from ``x`` by one
                                                                           fused scale-and-shift
``checkpoint_opt``  ``xhat`` (normalised ``x``), ``invstd``                ``z = act(g*xhat+beta)``;
                                                                           BN backward uses ``xhat``
``inplace_I``       ``z`` (InPlace-ABN, variant I)                         ``xhat`` by inversion
``inplace_II``      ``z`` (InPlace-ABN, variant II, the default)           ``y`` by inversion
==================  =====================================================  ==================

Every strategy updates the running statistics exactly once per forward (``torch.utils.checkpoint``
around a BN layer updates them twice: it re-runs the forward). The checkpoint strategies use
batch statistics only in training; in eval mode every strategy computes like ``standard``.
The in-place strategies overwrite the block's input (see the README's in-place contract).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..autograd.call import grad_mask
from ..kernels import activations as act
from ..kernels.common import SIGNED, channel_view, gamma_grad, scale_and_shift, stat_dtype
from ..layers.batch_norm import ABN, InPlaceABN
from ..layers.checks import check_inputs
from ..layers.options import check_options

STRATEGIES = ("standard", "checkpoint", "checkpoint_opt", "inplace_I", "inplace_II")


class _ConvConfig(NamedTuple):
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int


class _CheckpointConfig(NamedTuple):
    momentum: float
    eps: float
    activation: str
    activation_param: float
    gamma_mode: str
    optimized: bool  # Fig. 2c: keep xhat instead of x
    conv: _ConvConfig


class _CheckpointBNActConv(torch.autograd.Function):
    """BN (batch statistics) -> activation -> conv2d, keeping ``x`` or ``xhat`` only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, conv_weight: Tensor,
        conv_bias: Tensor | None, running_mean: Tensor | None, running_var: Tensor | None,
        cfg: _CheckpointConfig,
    ) -> Tensor:
        g, beta = _scale_shift(weight, bias, cfg, x)
        if cfg.optimized:
            xhat, _, invstd = torch.ops.aten.native_batch_norm(
                x, None, None, running_mean, running_var, True, cfg.momentum, cfg.eps
            )
            ctx.save_for_backward(xhat, invstd, weight, bias, conv_weight, conv_bias)
            z = torch.addcmul(channel_view(beta, x.dim()), xhat, channel_view(g, x.dim()))
        else:
            z, mean, invstd = torch.ops.aten.native_batch_norm(
                x, g, beta, running_mean, running_var, True, cfg.momentum, cfg.eps
            )
            ctx.save_for_backward(x, mean, invstd, weight, bias, conv_weight, conv_bias)
        act.apply_(z, cfg.activation, cfg.activation_param)
        ctx.cfg = cfg
        c = cfg.conv
        return F.conv2d(z, conv_weight, conv_bias, c.stride, c.padding, c.dilation, c.groups)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        cfg = ctx.cfg
        if cfg.optimized:
            xhat, invstd, weight, bias, conv_weight, conv_bias = ctx.saved_tensors
            g, beta = _scale_shift(weight, bias, cfg, xhat)
            # Fig. 2c: z = act(g * xhat + beta), no normalisation to redo.
            z = torch.addcmul(channel_view(beta, xhat.dim()), xhat, channel_view(g, xhat.dim()))
        else:
            x, mean, invstd, weight, bias, conv_weight, conv_bias = ctx.saved_tensors
            g, beta = _scale_shift(weight, bias, cfg, x)
            # Fig. 2b with the paper's saving: normalisation and affine fused into one
            # scale-and-shift from the saved statistics.
            scale = g * invstd
            z = torch.addcmul(channel_view(beta - mean * scale, x.dim()), x,
                              channel_view(scale, x.dim()))
        act.apply_(z, cfg.activation, cfg.activation_param)
        c = cfg.conv
        needs = ctx.needs_input_grad
        dz, d_conv_weight, d_conv_bias = torch.ops.aten.convolution_backward(
            grad_out, z, conv_weight, None if conv_bias is None else [conv_bias.shape[0]],
            c.stride, c.padding, c.dilation, False, [0] * len(c.stride), c.groups,
            [True, needs[3], conv_bias is not None and needs[4]],
        )
        dy = act.grad_from_output(dz, z, cfg.activation, cfg.activation_param)
        mask = grad_mask(ctx, weight, bias)
        if cfg.optimized:
            # BN backward on xhat directly (center 0, scale 1, weight g * invstd).
            dx, dg, dbeta = torch.ops.aten.native_batch_norm_backward(
                dy, xhat, g * invstd, None, None, torch.zeros_like(g), torch.ones_like(g), True,
                cfg.eps, mask,
            )
        else:
            dx, dg, dbeta = torch.ops.aten.native_batch_norm_backward(
                dy, x, g, None, None, mean, invstd, True, cfg.eps, mask
            )
        dgamma = gamma_grad(dg, weight, cfg.gamma_mode) if mask[1] else None
        return dx, dgamma, dbeta if mask[2] else None, d_conv_weight, d_conv_bias, None, None, None


def _scale_shift(weight, bias, cfg, like: Tensor) -> tuple[Tensor, Tensor]:
    return scale_and_shift(weight, bias, cfg.eps, cfg.gamma_mode, like.shape[1],
                           stat_dtype(like, weight, None), like.device)


class BNActConv(nn.Module):
    """Norm -> activation -> ``Conv2d``, with a selectable memory ``strategy`` (module doc).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias: as
            ``nn.Conv2d`` (numeric padding; ``padding_mode="zeros"``).
        strategy: one of :data:`STRATEGIES` (default ``"inplace_II"``).
        eps, momentum, affine, track_running_stats, activation, activation_param, gamma_mode:
            of the norm layer, as :class:`iabn.InPlaceABN` (``relu`` only with the
            ``standard`` and checkpoint strategies).

    The parameters are ``norm.*`` (the keys of ``nn.BatchNorm2d``) and ``conv.*``, the same for
    every strategy, so a ``state_dict`` moves freely between them.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0,
        dilation: int | tuple[int, int] = 1, groups: int = 1, bias: bool = False, *,
        strategy: str = "inplace_II", eps: float = 1e-5, momentum: float | None = 0.1,
        affine: bool = True, track_running_stats: bool = True, activation: str = "leaky_relu",
        activation_param: float = 0.01, gamma_mode: str = SIGNED, device=None, dtype=None,
    ) -> None:
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy={strategy!r}: use one of {', '.join(map(repr, STRATEGIES))}"
            )
        if isinstance(padding, str):
            raise ValueError(
                f"padding={padding!r}: BNActConv takes numeric padding (e.g. padding=1 for a "
                f"3x3 'same' convolution)"
            )
        in_place = strategy.startswith("inplace")
        check_options(activation, activation_param, gamma_mode, in_place=in_place, eps=eps,
                      momentum=momentum)
        self.strategy = strategy
        factory = {"device": device, "dtype": dtype}
        norm_args = (in_channels, eps, momentum, affine, track_running_stats, activation,
                     activation_param)
        if in_place:
            self.norm: ABN = InPlaceABN(*norm_args, **factory, gamma_mode=gamma_mode,
                                        variant=1 if strategy == "inplace_I" else 2)
        else:
            self.norm = ABN(*norm_args, **factory, gamma_mode=gamma_mode)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation,
                              groups, bias, **factory)

    def forward(self, input: Tensor) -> Tensor:
        if self.strategy in ("checkpoint", "checkpoint_opt") and self.training:
            return self._checkpointed(input)
        return self.conv(self.norm(input))

    def _checkpointed(self, input: Tensor) -> Tensor:
        norm = self.norm
        use_batch_stats, running_mean, running_var = norm._normalisation()
        check_inputs(input, running_mean, running_var, norm.weight, norm.bias, use_batch_stats,
                     in_place=False, num_features=norm.num_features)
        if input.dim() != 4:
            raise ValueError(f"BNActConv expects (N, C, H, W) input, got {input.dim()}-D")
        conv = self.conv
        momentum = norm._count_batch()  # after the checks: a rejected call counts nothing
        cfg = _CheckpointConfig(
            momentum, norm.eps, norm.activation, norm.activation_param,
            norm.gamma_mode, self.strategy == "checkpoint_opt",
            _ConvConfig(conv.stride, conv.padding, conv.dilation, conv.groups),
        )
        return _CheckpointBNActConv.apply(input, norm.weight, norm.bias, conv.weight, conv.bias,
                                          running_mean, running_var, cfg)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}"
