"""The RMS norms of other libraries that :class:`~iabn.layers.layer_norm.InPlaceRMSNorm`
reproduces with its ``weight_offset`` and ``upcast`` options (docs/design.md, "Output-only
layer norm"), each as its original computes it in every dtype:

- ``weight_offset=1.0``: the scale is ``1 + weight`` (Gemma's RMSNorm, whose weight starts at
  zero). The layer passes the effective weight ``1 + weight`` to the row-norm call, which
  autograd differentiates back to ``weight``: one addition of ``D`` values per call.
- ``upcast``: how a half (or float64) input is computed, read from Hugging Face's classes
  (transformers 5.23):

  - ``None``: ``nn.RMSNorm``'s computation (``torch.rms_norm``);
  - ``"normalise"``: Llama's ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``:
    normalised in float32 (float64 inputs too: they are rounded to float32), cast to the
    input's dtype, then scaled;
  - ``"scale"``: Gemma's ``(x.float() * rsqrt(...) * (1 + weight.float())).type_as(x)``:
    normalised and scaled in float32, then cast;
  - ``"statistics"``: T5's ``weight * (x * rsqrt(mean(x.float()^2) + eps))`` with the mean of
    squares in float32, the product in the promoted dtype and cast to the weight's dtype
    where that is a half one.

:func:`rms_reference` is each computation written as its original writes it (the recogniser
compares modules with it, :mod:`iabn.conversion.recognise`). :func:`rms_forward` runs the
layer: the row-norm call wherever it computes what the original does (measured bit for bit
on CPU, torch 2.14: ``torch.rms_norm`` of a float32 input equals the Python formula, of a
half input without weight equals ``(x.float() * rsqrt(...)).to(x.dtype)``, and of a half
input with a float32 weight equals Gemma's single rounding), and the reference's operations
where it does not or where the original's float32 rounding would make the gradients differ
(the upcasting forms' float64 inputs; T5's form for half inputs with float32 weights): no
memory is saved there.
"""

from __future__ import annotations

import torch
from torch import Tensor

UPCASTS = (None, "normalise", "scale", "statistics")
_HALF = (torch.float16, torch.bfloat16)


def check_form(weight_offset: float, upcast: str | None) -> None:
    """The options' values, before anything is built."""
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)):
        raise TypeError(f"weight_offset={weight_offset!r}: must be a number, the constant "
                        f"added to the weight (0.0: scale by weight; 1.0: by 1 + weight, "
                        f"as Gemma's RMSNorm)")
    if upcast not in UPCASTS:
        raise ValueError(f"upcast={upcast!r}: must be one of {UPCASTS} (None: nn.RMSNorm; "
                         f"'normalise': Llama's, 'scale': Gemma's, 'statistics': T5's "
                         f"float32 computation)")


def _scale(weight: Tensor | None, weight_offset: float) -> Tensor | None:
    """What the normalised input is multiplied by: ``weight_offset + weight`` (``weight``
    itself without an offset; ``None`` without a weight)."""
    if weight is None:
        return None
    return weight_offset + weight if weight_offset else weight


def _rstd(x32: Tensor, eps: float | None) -> Tensor:
    eps = torch.finfo(x32.dtype).eps if eps is None else eps
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_reference(x: Tensor, weight: Tensor | None, eps: float | None,
                  weight_offset: float = 0.0, upcast: str | None = None) -> Tensor:
    """The RMS norm over the last dimension as the original module writes it."""
    scale = _scale(weight, weight_offset)
    if upcast is None:
        return torch.rms_norm(x, (x.shape[-1],), scale, eps)
    if upcast == "normalise":
        h = x.to(torch.float32)
        h = (h * _rstd(h, eps)).to(x.dtype)
        return h if scale is None else scale * h
    if upcast == "scale":
        h = x.float()
        h = h * _rstd(h, eps)
        if scale is not None:
            h = h * _scale(weight.float(), weight_offset)
        return h.type_as(x)
    # "statistics"
    h = x * _rstd(x.to(torch.float32), eps)
    if weight is not None and weight.dtype in _HALF:
        h = h.to(weight.dtype)
    return h if scale is None else scale * h


def _on_float32(call, input: Tensor, weight: Tensor | None) -> Tensor:
    """The call on ``input`` in float32: on the layer's own cast copy (overwritten), or on
    ``input`` itself in the layer's mode where it is float32 already."""
    x = input.to(torch.float32)
    return call(x, weight, True if x is not input else None)


def rms_forward(call, input: Tensor, weight: Tensor | None, eps: float | None,
                weight_offset: float, upcast: str | None) -> Tensor:
    """The layer's output: ``call(x, weight, overwrite)`` is the row-norm call on ``x``
    (``overwrite=None``: the layer's own mode; ``True``: ``x`` is the layer's own cast copy,
    which it may overwrite); the rest of the form is computed around it."""
    scale = _scale(weight, weight_offset)
    dtype = input.dtype
    f32 = torch.float32
    if upcast is None or (dtype == f32 and (scale is None or scale.dtype == f32)):
        return call(input, scale, None)
    if dtype == torch.float64:
        # the original rounds to float32 inside: its own operations (and their backward)
        # give the same gradients, where the row-norm call's backward would differ by
        # float32's rounding (1.4e-7 of a small Llama's largest gradient); float64 is for
        # checking, not for saving memory
        return rms_reference(input, weight, eps, weight_offset, upcast)
    if upcast == "normalise" or (upcast == "statistics" and dtype in _HALF and (
            weight is None or weight.dtype == dtype)):
        # a float32 input with a half weight: normalised in float32, then scaled
        h = (call(input, None, None) if dtype in _HALF
             else _on_float32(call, input, None).to(dtype))
        return h if scale is None else scale * h
    if upcast == "scale":
        # Gemma adds the offset in float32: 1 + w may not be a half value
        scale32 = None if weight is None else _scale(weight.float(), weight_offset)
        if dtype in _HALF:  # one rounding of the float32 product, as Gemma's .type_as
            return call(input, scale32, None)
        return _on_float32(call, input, scale32).to(dtype)
    return rms_reference(input, weight, eps, weight_offset, upcast)


__all__ = ["UPCASTS", "check_form", "rms_forward", "rms_reference"]
