"""Group normalisation followed by an activation: :class:`GroupNormAct` and its in-place
counterpart :class:`InPlaceGroupNormAct` (docs/design.md, "In-place group norm"), and their
checks.

The in-place layer overwrites its input and keeps its output and ``rstd`` ``(N, G)``; backward
recovers the normalised values from the output (:mod:`iabn.kernels.group_norm`, the autograd
in :mod:`iabn.autograd.group_norm`). It does not go through the ``iabn::`` custom operators or
:mod:`iabn.autograd.compiled` of the batch-norm layers: under ``torch.compile`` Dynamo traces
its ``Function`` as it is, on a copy of the input (so an input from outside the compiled graph
is left unchanged). The output always has the input's dtype (it is the input): under CUDA
autocast, whose float32 list holds ``group_norm``, ``nn.GroupNorm`` returns float32 instead
(CPU autocast leaves it in the input's dtype, as here).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor, nn

from ..autograd.call import check_per_call, check_tensor_kind, input_signature
from ..autograd.group_norm import group_norm_act, inplace_group_norm_act
from ..kernels import activations as act
from ..kernels.common import SIGNED, GroupConfig
from .checks import (
    SUPPORTED_DTYPES,
    OverwriteInputOption,
    check_channel_tensor,
    check_param_dtypes,
)
from .options import (
    ValidatedOptions,
    check_flag,
    check_loaded_gamma_mode,
    check_options,
    note_gamma_mode,
)


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
        # the in-place layer keeps the branch bit an activation with one minimum needs
        check_options(activation, activation_param, gamma_mode, in_place=self._needs_inverse,
                      eps=eps, branch=True)
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
    #: (:class:`~iabn.layers.options.ValidatedOptions`).
    _OPTIONS = ("num_groups", "num_channels", "eps", "activation", "activation_param",
                "gamma_mode")

    def _check_assigned(self, options: dict[str, Any], name: str) -> None:
        check_groups(options["num_groups"], options["num_channels"])
        check_options(options["activation"], options["activation_param"],
                      options["gamma_mode"], in_place=self._needs_inverse, eps=options["eps"],
                      branch=True)

    def reset_parameters(self) -> None:
        if self.affine:
            nn.init.ones_(self.weight)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    def _config(self) -> GroupConfig:
        return GroupConfig(self.num_groups, self.eps, self.activation, self.activation_param,
                           self.gamma_mode)

    def forward(self, input: Tensor) -> Tensor:
        weight, bias = self.weight, self.bias
        check_group_norm_inputs(input, weight, bias, self.num_groups, self.num_channels,
                                in_place=self._in_place)
        return group_norm_act(input, weight, bias, self._config())

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
    (``"leaky_relu"``, ``"elu"``, ``"softplus"`` or ``"identity"``) or have one minimum
    (``"silu"``, ``"gelu"``, ``"gelu_tanh"``, ``"mish"``: the layer then also keeps one bit
    per element, which side of the minimum the pre-activation was on, as
    :class:`iabn.InPlaceABN` does). The returned tensor *is* the input tensor,
    so the input must not be needed elsewhere afterwards: the README's in-place contract, with
    the checks of :class:`iabn.InPlaceABN` (a leaf that requires grad, an inference tensor or
    one whose elements share memory is refused; ``iabn.debug.poison_overwritten`` finds later
    reads). Double backward is refused. ``overwrite_input=False`` (keyword): the output-only
    mode of :class:`iabn.layers.checks.OverwriteInputOption`, for an input that is needed again;
    an input autograd or an engine forbids overwriting (a ``chunk`` view, FSDP2's, a
    checkpoint's input) is computed that way too (the run-time rule, docs/design.md).
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
        # as InPlaceABN: the full checks when the call's signature changes, else the
        # per-tensor ones
        check_per_call(input, in_place=self._in_place)
        signature = input_signature(input, True, weight, bias, None, None)
        if signature != self.__dict__.get("_valid_signature"):
            check_group_norm_inputs(input, weight, bias, self.num_groups, self.num_channels,
                                    in_place=self._in_place)
            if not torch.compiler.is_compiling():  # (InPlaceABN._check says why)
                self.__dict__["_valid_signature"] = signature
        return inplace_group_norm_act(input, weight, bias, self._config(),
                                      overwrite=self._in_place)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.overwrite_input else ", overwrite_input=False")


__all__ = ["GroupNormAct", "InPlaceGroupNormAct", "check_group_norm_inputs", "check_groups"]
