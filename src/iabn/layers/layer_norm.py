"""Output-only layer norm and RMS norm modules: :class:`InPlaceLayerNorm`,
:class:`InPlaceRMSNorm` and :class:`InPlaceLayerNorm2d` (docs/design.md, "Output-only layer
norm"), and their checks.

``nn.LayerNorm``'s backward keeps its *input*. In a pre-norm transformer that input is the
residual stream, which nothing else saves, while the norm's output is saved anyway by the
Linear that reads it. These layers keep only their output ``y`` and the per-row ``rstd`` (plus,
rarely, a few columns of ``xhat``) and rebuild ``xhat`` from ``y`` in backward, so the input can
be freed. ``overwrite_input=True`` (default) also writes ``y`` into the input's storage and
returns the input tensor (the in-place contract of :class:`iabn.InPlaceABN`);
``overwrite_input=False`` returns a new tensor and leaves the input untouched. The math is
:mod:`iabn.kernels.row_norm`'s, the autograd :mod:`iabn.autograd.row_norm`'s; the functional
forms are :func:`iabn.functional.inplace_layer_norm` and
:func:`iabn.functional.inplace_rms_norm`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

from torch import Tensor, nn

from ..autograd.call import check_per_call, check_tensor_kind
from ..autograd.row_norm import row_norm_call
from ..kernels.common import LAYER_NORM, RMS_NORM, RowConfig
from .checks import (
    SUPPORTED_DTYPES,
    OverwriteInputOption,
    check_param_dtypes,
    check_param_tensor,
)
from .norm_forms import check_form, rms_forward
from .options import check_flag

_NAMES = {LAYER_NORM: "layer normalisation", RMS_NORM: "RMS normalisation"}


def as_shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    """``normalized_shape`` as ``nn.LayerNorm`` takes it (an int or a sequence of ints)."""
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        return (int(normalized_shape),)
    try:
        shape = tuple(normalized_shape)
    except TypeError:
        shape = None
    if not shape or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                            for s in shape):
        raise TypeError(
            f"normalized_shape={normalized_shape!r}: must be an int or a non-empty sequence of "
            f"ints, the trailing dimensions to normalise (e.g. 768 or (8, 8))"
        )
    return tuple(int(s) for s in shape)


def check_norm_inputs(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                      normalized_shape: tuple[int, ...], *, kind: str, channels: bool,
                      in_place: bool) -> None:
    """Validate a call before anything is written (the messages of :mod:`.checks`).
    ``channels``: the normalised dimension is dim 1 of ``(N, C, *)`` (``InPlaceLayerNorm2d``),
    else the trailing ``len(normalized_shape)`` dimensions."""
    check_tensor_kind(input)
    what = _NAMES[kind]
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"input has dtype {input.dtype}; {what} needs float16, bfloat16, float32 or "
            f"float64: convert it first, e.g. input.float()"
        )
    if channels:
        (c,) = normalized_shape
        if input.dim() < 2 or input.shape[1] != c:
            got = f"shape {tuple(input.shape)}"
            raise ValueError(
                f"input must have shape (N, C, *) with C = num_channels = {c}; got {got}: "
                f"check the preceding layer's output channels (this layer normalises dim 1; "
                f"for channels-last (N, H, W, C) tensors use iabn.InPlaceLayerNorm({c}))"
            )
    else:
        nd = len(normalized_shape)
        if tuple(input.shape[input.dim() - nd:]) != normalized_shape or input.dim() < nd:
            raise ValueError(
                f"input of shape {tuple(input.shape)} does not end with normalized_shape="
                f"{normalized_shape}: its last {nd} dimension(s) are the ones normalised; "
                f"build the layer with the input's trailing size(s) or reshape the input"
            )
    for name, t in (("weight", weight), ("bias", bias)):
        if check_param_tensor(name, t, input) and tuple(t.shape) != normalized_shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but normalized_shape is "
                f"{normalized_shape}: {name} must have that shape"
            )
    check_param_dtypes(input, weight, bias)
    check_per_call(input, in_place=in_place)


class InPlaceLayerNorm(OverwriteInputOption, nn.LayerNorm):
    """``nn.LayerNorm`` that keeps only its output (and per-row ``rstd``) for backward.

    Same arguments, parameters, ``state_dict`` keys, ``reset_parameters()`` and outputs as
    ``nn.LayerNorm`` (an instance of it), for any ``normalized_shape``, ``elementwise_affine``
    and ``bias``, and inputs of any strides (a channels-last ``x.permute(0, 2, 3, 1)`` view as
    ConvNeXt normalises it). ``overwrite_input`` (keyword, default ``True``): write the output
    into the input's storage and return the input tensor, which must then not be needed
    elsewhere (the in-place contract of :class:`iabn.InPlaceABN`: the caller's leaf that
    requires grad, an inference tensor or one whose elements share memory is refused;
    ``iabn.debug`` finds later reads; an input autograd or an engine forbids overwriting, a
    ``chunk`` or FSDP2 view, a checkpoint's input, is computed output-only). ``False``: the
    output-only mode, a new output and the input left untouched (and not kept). Features with
    a weight at or near zero keep their normalised values (docstring of
    :mod:`iabn.kernels.row_norm`). Double backward is refused.
    """

    _in_place = True
    _kind = LAYER_NORM
    _channels = False

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, device=None, dtype=None,
                 *, overwrite_input: bool = True) -> None:
        shape = as_shape(normalized_shape)
        check_flag("overwrite_input", overwrite_input)
        super().__init__(shape, eps, elementwise_affine, bias, device=device, dtype=dtype)
        self.overwrite_input = overwrite_input

    def forward(self, input: Tensor) -> Tensor:
        weight, bias = self.weight, getattr(self, "bias", None)
        shape = tuple(self.normalized_shape)
        check_norm_inputs(input, weight, bias, shape, kind=self._kind, channels=self._channels,
                          in_place=self._in_place)
        config = RowConfig(shape, self.eps, self._kind, self._channels)
        return row_norm_call(input, weight, bias, config, self._in_place, type(self).__name__)

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.overwrite_input else ", overwrite_input=False")


class InPlaceLayerNorm2d(InPlaceLayerNorm):
    """Layer norm over dim 1 (the channels) of an ``(N, C, *)`` tensor, keeping only its output
    for backward: timm's ``timm.layers.LayerNorm2d`` (an ``nn.LayerNorm`` over ``C`` of the
    tensor permuted to channels-last), with its parameters ``weight``, ``bias`` of shape
    ``(C,)`` and ``state_dict``. Output in the memory layout timm's has. ``overwrite_input``
    as :class:`InPlaceLayerNorm`."""

    _channels = True

    def __init__(self, num_channels: int, eps: float = 1e-6, affine: bool = True, *,
                 overwrite_input: bool = True) -> None:
        super().__init__(num_channels, eps=eps, elementwise_affine=affine,
                         overwrite_input=overwrite_input)


class InPlaceRMSNorm(OverwriteInputOption, nn.RMSNorm):
    """``nn.RMSNorm`` that keeps only its output (and per-row ``rstd``) for backward.

    Same arguments, parameter, ``state_dict`` keys and outputs as ``nn.RMSNorm`` (an instance
    of it); ``eps=None`` is the machine epsilon ``torch.rms_norm`` uses (float32's for half
    inputs). ``overwrite_input`` as :class:`InPlaceLayerNorm`. Features with a weight below
    ``finfo(dtype).tiny`` keep their normalised values. Double backward is refused.

    ``weight_offset`` (keyword, default ``0.0``): scale by ``weight_offset + weight`` (Gemma's
    ``1 + weight``). ``upcast`` (keyword, default ``None``): compute as Llama's
    (``"normalise"``), Gemma's (``"scale"``) or T5's (``"statistics"``) RMSNorm do in every
    dtype (:mod:`iabn.layers.norm_forms`). Where such a form scales after normalising (Llama's
    and T5's with a half input, Llama's with a float64 one), the row-norm call keeps its
    normalised output and a multiplication by the weight follows: with
    ``overwrite_input=True`` the normalised values are written into the input and the scaled
    output is a new tensor.
    """

    _in_place = True
    _kind = RMS_NORM
    _channels = False

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 overwrite_input: bool = True, weight_offset: float = 0.0,
                 upcast: str | None = None) -> None:
        shape = as_shape(normalized_shape)
        check_flag("overwrite_input", overwrite_input)
        check_form(weight_offset, upcast)
        super().__init__(shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.overwrite_input = overwrite_input
        self.weight_offset = float(weight_offset)
        self.upcast = upcast

    def forward(self, input: Tensor) -> Tensor:
        if not self.weight_offset and self.upcast is None:
            return InPlaceLayerNorm.forward(self, input)
        shape = tuple(self.normalized_shape)
        check_norm_inputs(input, self.weight, None, shape, kind=RMS_NORM, channels=False,
                          in_place=self._in_place)
        config = RowConfig(shape, self.eps, RMS_NORM, False)
        name = type(self).__name__

        def call(x: Tensor, weight: Tensor | None, overwrite: bool | None) -> Tensor:
            return row_norm_call(x, weight, None, config,
                                 self._in_place if overwrite is None else overwrite, name)

        return rms_forward(call, input, self.weight, self.eps, self.weight_offset, self.upcast)

    def extra_repr(self) -> str:
        text = super().extra_repr() + ("" if self.overwrite_input else ", overwrite_input=False")
        if self.weight_offset:
            text += f", weight_offset={self.weight_offset}"
        return text + (f", upcast={self.upcast!r}" if self.upcast else "")


__all__ = ["InPlaceLayerNorm", "InPlaceLayerNorm2d", "InPlaceRMSNorm", "as_shape",
           "check_norm_inputs"]
