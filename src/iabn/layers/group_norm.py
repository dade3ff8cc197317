"""Group normalisation followed by an activation: :class:`GroupNormAct` and its in-place
counterpart :class:`InPlaceGroupNormAct` (docs/design.md, "In-place group norm").

The in-place layer is an ``autograd.Function`` over PyTorch's own group-norm kernels
(``aten::native_group_norm`` forward, ``aten::native_group_norm_backward`` backward). It does
not go through the ``iabn::`` custom operators, the Triton kernels or :mod:`iabn.autograd.compiled`
of
the batch-norm layers: under ``torch.compile`` Dynamo traces the Function as it is (forward and
backward are ATen calls it can trace), on a copy of the input as for
:func:`iabn.autograd.function.overwritable` (so an input from outside the compiled graph is left
unchanged).

The math, for one sample ``n`` and one group ``k`` of ``D = (C / G) * HxW`` values, with
``mean``, ``rstd = 1 / sqrt(var + eps)`` (biased variance) over the group, per channel ``c``
the effective scale ``g_c = scale(weight_c)`` (:mod:`iabn.kernels.common`) and ``beta_c = bias_c``::

    xhat = (x - mean) * rstd,   y = g_c * xhat + beta_c,   z = phi(y)

Forward overwrites ``x`` with ``z`` and keeps ``z`` and ``rstd`` (shape ``(N, G)``; ``mean``
is not needed). Backward recovers ``y = phi^-1(z)``, ``dy = phi'(y) * dz`` (from ``z``, as
:mod:`iabn.kernels.activations` does) and ``xhat = (y - beta_c) / g_c``, then::

    dbeta_c = sum_{n, s} dy                 dg_c = sum_{n, s} dy * xhat
    dx = rstd * (dxhat - mean_D(dxhat) - xhat * mean_D(dxhat * xhat)),   dxhat = g_c * dy

``native_group_norm_backward(dy, input=xhat, mean=0, rstd=1, weight=g)`` computes exactly
``dbeta``, ``dg`` and the bracket (its normalised input ``(xhat - 0) * 1`` is ``xhat``), so
``dx`` is its first output times ``rstd`` of the sample and group (checked against
``nn.GroupNorm`` in float64 by tests/core/test_group_norm.py). ``dweight = dg`` in signed mode,
``dg`` times ``d|weight|/dweight`` in abs mode (:func:`iabn.kernels.common.gamma_grad`).

float16 and bfloat16 inputs are normalised by the same kernel as ``nn.GroupNorm`` (forward
outputs equal its outputs); backward recovers ``xhat`` and runs the backward kernel in
float32 on parts of the activation (:func:`_grads_in_parts`), writing ``dx`` in the input's
dtype. The output always has the input's dtype (it is
the input): under CUDA autocast, whose float32 list holds ``group_norm``, ``nn.GroupNorm``
returns float32 instead (CPU autocast leaves it in the input's dtype, as here).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import debug
from ..autograd.function import needs_grad as layer_needs_grad
from ..autograd.function import overwritable, transformed
from ..kernels import activations as act
from ..kernels.common import ABS, LOW_PRECISION, SIGNED, abs_sign, effective_scale, gamma_grad
from ..kernels.reference import at_most, part_count
from .batch_norm import (
    OverwriteInputOption,
    ValidatedOptions,
    check_loaded_gamma_mode,
    note_gamma_mode,
)
from .checks import (
    SUPPORTED_DTYPES,
    check_channel_tensor,
    check_flag,
    check_options,
    check_param_dtypes,
    check_per_call,
    check_tensor_kind,
)

_NATIVE_GROUP_NORM = torch.ops.aten.native_group_norm.default
_NATIVE_GROUP_NORM_BACKWARD = torch.ops.aten.native_group_norm_backward.default


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be an int >= 1")
    if value < 1:
        raise ValueError(f"{name}={value!r}: must be an int >= 1")


def check_groups(num_groups: int, num_channels: int) -> None:
    """``num_groups`` and ``num_channels`` are positive ints and the groups divide the
    channels (as ``nn.GroupNorm`` requires)."""
    _check_count("num_groups", num_groups)
    _check_count("num_channels", num_channels)
    if num_channels % num_groups:
        divisors = [d for d in range(1, num_channels + 1) if num_channels % d == 0]
        nearest = min(divisors, key=lambda d: (abs(d - num_groups), d))
        raise ValueError(
            f"num_channels={num_channels} is not divisible by num_groups={num_groups}: each "
            f"group takes num_channels / num_groups channels; use a num_groups that divides "
            f"{num_channels} (e.g. {nearest})"
        )


def check_group_norm_inputs(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                            num_groups: int, num_channels: int, *, in_place: bool) -> None:
    """Validate a call before anything is written (the messages of :mod:`iabn.layers.checks`)."""
    check_tensor_kind(input)
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"input has dtype {input.dtype}; group normalisation needs float16, bfloat16, "
            f"float32 or float64: convert it first, e.g. input.float()"
        )
    if input.dim() < 2:
        raise ValueError(
            f"input must have shape (N, C, *) with C = num_channels = {num_channels}; got a "
            f"{input.dim()}-D tensor of shape {tuple(input.shape)}: add the batch dimension, "
            f"e.g. input.unsqueeze(0)"
        )
    channels = input.shape[1]
    if channels != num_channels:
        raise ValueError(
            f"input has {channels} channels (dim 1) but the layer was built with "
            f"num_channels={num_channels}: check the preceding layer's output channels"
        )
    if input.dim() > 2 and math.prod(input.shape[2:]) == 0:
        raise ValueError(
            f"input of shape {tuple(input.shape)} has an empty spatial size: group "
            f"normalisation needs at least one value per channel and sample"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        check_channel_tensor(name, t, input, channels)
    check_param_dtypes(input, weight, bias)
    if in_place:
        check_per_call(input, in_place=True)


def _sizes(x: Tensor) -> tuple[int, int, int]:
    n, c = x.shape[0], x.shape[1]
    return n, c, math.prod(x.shape[2:])


def _layout(x: Tensor) -> torch.memory_format:
    """ATen's ``suggest_memory_format``: channels-last where ``x`` is stored so, else
    contiguous (the group-norm kernels read both)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last):
        return torch.channels_last
    if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(
            memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


def _per_channel(t: Tensor, x: Tensor) -> Tensor:
    """A ``(C,)`` tensor shaped to broadcast over ``x`` of shape ``(N, C, *)``."""
    return t.view((1, -1) + (1,) * (x.dim() - 2))


def _forward_(x: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int,
              eps: float, activation: str, activation_param: float, gamma_mode: str) -> Tensor:
    """Overwrite ``x`` with ``phi(g * xhat + beta)``; return ``rstd``, shape ``(N, G)``.

    ATen's kernel writes a new tensor, which is copied into ``x`` and freed: one
    activation-sized temporary during forward, nothing kept."""
    n, c, hxw = _sizes(x)
    scale = None if weight is None else effective_scale(weight.detach(), eps, gamma_mode)
    source = x.contiguous(memory_format=_layout(x))
    out, _, rstd = _NATIVE_GROUP_NORM(source, scale, bias, n, c, hxw, num_groups, eps)
    act.apply_(out, activation, activation_param)
    x.copy_(out)
    return rstd


class InPlaceGroupNormFunction(torch.autograd.Function):
    """Autograd for :class:`InPlaceGroupNormAct`: the output is ``x`` itself, saved as ``z``,
    with ``rstd`` of shape ``(N, G)``; see the module docstring for the math."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int,
        eps: float, activation: str, activation_param: float, gamma_mode: str,
    ) -> Tensor:
        options = (num_groups, eps, activation, activation_param, gamma_mode)
        rstd = _forward_(x, weight, bias, *options)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, rstd)
        ctx.options = options
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # only under create_graph=True (as iabn.autograd.function.refuse_double_backward,
            # naming the
            # group-norm layer's not-in-place counterpart)
            raise RuntimeError(
                "InPlaceGroupNormAct does not support double backward (create_graph=True); "
                "use iabn.GroupNormAct where second derivatives are needed"
            )
        z, weight, bias, rstd = ctx.saved_tensors
        num_groups, eps, activation, activation_param, gamma_mode = ctx.options
        want_dx, want_dweight, want_dbias = ctx.needs_input_grad[:3]
        mask = [want_dx, want_dweight and weight is not None, want_dbias and bias is not None]
        scale = None if weight is None else effective_scale(weight.detach(), eps, gamma_mode)
        if z.dtype in LOW_PRECISION and not torch.compiler.is_compiling():
            # in float32, a part at a time (Inductor fuses the casts into its kernels)
            dx, dscale, dbias = _grads_in_parts(z, dz, scale, bias, rstd, num_groups,
                                                activation, activation_param, mask)
        else:
            dx, dscale, dbias = _grads(z, dz, scale, bias, rstd, num_groups, activation,
                                       activation_param, mask)
        dweight = None
        if mask[1] and dscale is not None:
            dweight = gamma_grad(dscale, weight.detach(), gamma_mode).to(weight.dtype)
        dbias = dbias.to(bias.dtype) if mask[2] and dbias is not None else None
        return dx, dweight, dbias, None, None, None, None, None


def _composed(input: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int,
              eps: float, activation: str, activation_param: float, gamma_mode: str) -> Tensor:
    """The in-place layer from differentiable operators, for forward-mode AD and
    ``torch.func`` (as :func:`iabn.autograd.function._composed_inplace`): group norm of a copy
    with the in-place layer's scale (signed: clamped, gradient passed straight through), the
    activation, and the result written into ``input``."""
    if weight is not None and gamma_mode != ABS:
        clamped = effective_scale(weight.detach(), eps, gamma_mode)
        weight = weight + (clamped - weight.detach())
    out = group_norm_act(input.clone(), weight, bias, num_groups, eps, activation,
                         activation_param, gamma_mode)
    return input.copy_(out)


def _grads(z: Tensor, dz: Tensor, scale: Tensor | None, bias: Tensor | None, rstd: Tensor,
           num_groups: int, activation: str, activation_param: float, mask: list[bool],
           ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dscale, dbias)`` of the layer from its output ``z`` (``(N, C, *)``, the
    ``num_groups`` groups of its channels) and ``rstd`` ``(N, G)``; computed in float32 for
    half inputs, ``dx`` in ``z``'s dtype. See the module docstring for the math."""
    compute = torch.float32 if z.dtype in LOW_PRECISION else z.dtype
    layout = _layout(z)
    zc = z.to(compute).contiguous(memory_format=layout)
    dzc = dz.to(compute).contiguous(memory_format=layout)
    dy = act.grad_from_output(dzc, zc, activation, activation_param)
    y = act.invert(zc, activation, activation_param)
    # xhat = (y - beta) / g; a new tensor (invert returns z itself for identity)
    xhat = y - _per_channel(bias.to(compute), zc) if bias is not None else y.clone()
    if scale is not None:
        scale = scale.to(compute)
        xhat.div_(_per_channel(scale, zc))
    del y
    n, c, hxw = _sizes(z)
    zeros = rstd.new_zeros(rstd.shape, dtype=compute)
    ones = rstd.new_ones(rstd.shape, dtype=compute)
    dx, dscale, dbias = _NATIVE_GROUP_NORM_BACKWARD(
        dy, xhat, zeros, ones, scale, n, c, hxw, num_groups, mask)
    if dx is not None:
        # the kernel's dx is for rstd = 1: scale each (sample, group) by its own rstd
        # (broadcast per channel, so any memory layout of dx is written in place)
        factor = rstd.to(compute).repeat_interleave(c // num_groups, dim=1)
        dx.mul_(factor.view((n, c) + (1,) * (z.dim() - 2)))
        dx = dx.to(z.dtype)
    return dx, dscale, dbias


def _grads_in_parts(z: Tensor, dz: Tensor, scale: Tensor | None, bias: Tensor | None,
                    rstd: Tensor, num_groups: int, activation: str, activation_param: float,
                    mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_grads` for half inputs without a float32 tensor of the whole activation: each
    (sample, group) is normalised on its own, so the backward splits exactly into parts of
    whole samples (``N >= PIECES``) or of whole groups of one sample; ``dx`` is written part by
    part, the parameter gradients are summed over them. With fewer than ``PIECES`` (sample,
    group) pairs the parts are those pairs. (The float32 temporaries of a part, z, dz, dy, y,
    xhat and dx, hold 6 x 4 bytes an element of it: as in :data:`.kernels.reference.PIECES`.)"""
    n, c = z.shape[:2]
    per = c // num_groups
    count = part_count(z.numel())
    if n >= count:
        parts = [(slice(a, b), 0, num_groups) for a, b in at_most(n, count)]
    else:
        parts = [(slice(i, i + 1), a, b)
                 for i in range(n) for a, b in at_most(num_groups, -(-count // n))]
    dx = torch.empty_like(z) if mask[0] else None
    sums = [torch.zeros(c, dtype=torch.float32, device=z.device) if want else None
            for want in mask[1:]]
    for samples, g0, g1 in parts:
        channels = slice(g0 * per, g1 * per)
        at = (samples, channels)
        part = _grads(z[at], dz[at], None if scale is None else scale[channels],
                      None if bias is None else bias[channels], rstd[samples, g0:g1],
                      g1 - g0, activation, activation_param, mask)
        if dx is not None:
            dx[at].copy_(part[0])
        for total, value in zip(sums, part[1:], strict=True):
            if total is not None and value is not None:
                total[channels] += value
    return dx, *sums


def group_norm_act(input: Tensor, weight: Tensor | None, bias: Tensor | None, num_groups: int,
                   eps: float, activation: str, activation_param: float,
                   gamma_mode: str) -> Tensor:
    """Group norm, then the activation, without overwriting ``input`` (no validation)."""
    if weight is not None and gamma_mode == ABS:
        # |weight| + eps with d/dweight = +1 at 0 (scale.gamma_grad), not autograd's 0
        weight = weight * abs_sign(weight.detach()) + eps
    y = F.group_norm(input, num_groups, weight, bias, eps)
    # group norm's backward reads its input and statistics, not its output: overwrite it
    return act.apply_(y, activation, activation_param)


def inplace_group_norm_act(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                           num_groups: int, eps: float, activation: str,
                           activation_param: float, gamma_mode: str) -> Tensor:
    """Overwrite ``input`` with the layer's output and return it (no validation)."""
    options = (num_groups, eps, activation, activation_param, gamma_mode)
    if debug._ACTIVE and debug.intercepts():
        return debug.poisoned_call(
            lambda copy: inplace_group_norm_act(copy, weight, bias, *options),
            input, "InPlaceGroupNormAct",
        )
    if transformed():
        return _composed(input, weight, bias, *options)
    needs_grad = layer_needs_grad(input, weight, bias)
    if not needs_grad:
        with torch.no_grad():
            _forward_(input, weight, bias, *options)
        return input
    return InPlaceGroupNormFunction.apply(overwritable(input), weight, bias, *options)


class GroupNormAct(ValidatedOptions, nn.Module):
    """Group norm followed by an activation, without the in-place trick.

    Parameters, ``state_dict`` keys (``weight``, ``bias``; no running statistics),
    ``reset_parameters()`` and accepted inputs ``(N, C, *)`` are ``nn.GroupNorm``'s; it keeps
    for backward what ``nn.GroupNorm`` + an in-place activation keep (its input, its output
    and the ``(N, G)`` statistics). Accepts ``relu`` too.

    Args:
        num_groups, num_channels, eps, affine, device, dtype: as ``nn.GroupNorm``.
        activation: ``"leaky_relu"`` (default), ``"elu"``, ``"identity"`` or ``"relu"``.
        activation_param: leaky_relu's negative slope (default 0.01) or elu's alpha.
        gamma_mode: ``"signed"`` (default; ``nn.GroupNorm`` weights load unchanged) or
            ``"abs"`` (``|weight| + eps``).
    """

    _in_place = False
    _needs_inverse = False

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        device=None,
        dtype=None,
        *,
        gamma_mode: str = SIGNED,
        bias: bool = True,
    ) -> None:
        check_groups(num_groups, num_channels)
        check_options(activation, activation_param, gamma_mode, in_place=self._needs_inverse,
                      eps=eps)
        check_flag("bias", bias)
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        if affine:  # bias=False: as nn.GroupNorm(G, C, bias=False), no bias parameter
            self.weight = nn.Parameter(torch.empty(num_channels, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(num_channels, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.activation = activation
        self.activation_param = float(activation_param)
        self.gamma_mode = gamma_mode
        self.reset_parameters()

    #: Options read on every call; assigning one to a built layer validates it
    #: (:class:`~iabn.layers.batch_norm.ValidatedOptions`).
    _OPTIONS = ("num_groups", "num_channels", "eps", "activation", "activation_param",
                "gamma_mode")

    def _check_assigned(self, options: dict[str, Any], name: str) -> None:
        check_groups(options["num_groups"], options["num_channels"])
        check_options(options["activation"], options["activation_param"],
                      options["gamma_mode"], in_place=self._needs_inverse, eps=options["eps"])

    def reset_parameters(self) -> None:
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def _options(self) -> tuple[int, float, str, float, str]:
        return (self.num_groups, self.eps, self.activation, self.activation_param,
                self.gamma_mode)

    def forward(self, input: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        check_group_norm_inputs(input, weight, bias, self.num_groups, self.num_channels,
                                in_place=self._in_place)
        return group_norm_act(input, weight, bias, *self._options())

    def __prepare_scriptable__(self) -> GroupNormAct:
        raise RuntimeError(
            f"iabn.{type(self).__name__} cannot be compiled by TorchScript (torch.jit.script): "
            f"its forward is Python that TorchScript cannot compile. Use torch.compile, or, to "
            f"export for inference, a copy of the model with nn.GroupNorm + the activation in "
            f"its place (a gamma_mode='signed' layer's state_dict loads into it unchanged)"
        )

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        note_gamma_mode(self.gamma_mode, destination, prefix)  # as ABN

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs) -> None:
        check_loaded_gamma_mode(self.gamma_mode, local_metadata, prefix)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def extra_repr(self) -> str:
        text = (f"{self.num_groups}, {self.num_channels}, eps={self.eps}, "
                f"affine={self.affine}, activation={self.activation}")
        if self.activation in act.WITH_PARAMETER:
            text += f", activation_param={self.activation_param}"
        if self.gamma_mode != SIGNED:
            text += f", gamma_mode={self.gamma_mode}"
        if self.affine and self.bias is None:
            text += ", bias=False"
        return text


class InPlaceGroupNormAct(OverwriteInputOption, GroupNormAct):
    """In-place group norm + activation: overwrites its input and keeps only its output and
    ``rstd`` of shape ``(N, G)`` for backward.

    Same arguments as :class:`GroupNormAct`; ``activation`` must be invertible
    (``"leaky_relu"``, ``"elu"`` or ``"identity"``). The returned tensor *is* the input tensor,
    so the input must not be needed elsewhere afterwards: the README's in-place contract, with
    the checks of :class:`iabn.InPlaceABN` (a leaf that requires grad, an inference tensor or
    one whose elements share memory is refused; ``iabn.debug.poison_overwritten`` finds later
    reads). Double backward is refused. ``overwrite_input=False`` (keyword): the output-only
    mode of :class:`iabn.layers.batch_norm.OverwriteInputOption`, for an input that is needed again.
    """

    _in_place = True
    _needs_inverse = True

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        device=None,
        dtype=None,
        *,
        gamma_mode: str = SIGNED,
        overwrite_input: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__(num_groups, num_channels, eps, affine, activation, activation_param,
                         device, dtype, gamma_mode=gamma_mode, bias=bias)
        self.overwrite_input = overwrite_input

    def forward(self, input: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        check_group_norm_inputs(input, weight, bias, self.num_groups, self.num_channels,
                                in_place=self._in_place)
        return inplace_group_norm_act(self._to_overwrite(input), weight, bias,
                                      *self._options())

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.overwrite_input else ", overwrite_input=False")


__all__ = ["GroupNormAct", "InPlaceGroupNormAct", "InPlaceGroupNormFunction"]
