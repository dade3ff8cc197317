"""Output-only layer norm and RMS norm: :class:`InPlaceLayerNorm`, :class:`InPlaceRMSNorm` and
:class:`InPlaceLayerNorm2d` (docs/design.md, "Output-only layer norm").

``nn.LayerNorm``'s backward keeps its *input*. In a pre-norm transformer that input is the
residual stream, which nothing else saves, while the norm's output is saved anyway by the
Linear that reads it. These layers keep only their output ``y`` and the per-row ``rstd`` (plus,
rarely, a few columns of ``xhat``: below) and rebuild ``xhat`` from ``y`` in backward, so the
input can be freed. ``overwrite_input=True`` (default) also writes ``y`` into the input's
storage and returns the input tensor (the in-place contract of :class:`iabn.InPlaceABN`);
``overwrite_input=False`` returns a new tensor and leaves the input untouched.

The math, for one row (the ``D`` values of ``normalized_shape``), weight ``w`` and bias ``b``
per feature::

    layer norm:  mean, rstd = 1 / sqrt(var + eps) (biased),  xhat = (x - mean) * rstd
    RMS norm:    rstd = 1 / sqrt(mean(x^2) + eps),            xhat = x * rstd
    y = w * xhat + b                                          (RMS norm: no b)

Backward rebuilds ``xhat = (y - b) / w`` and, with ``dxhat = w * dy``::

    db = sum_rows dy,   dw = sum_rows dy * xhat
    layer norm:  dx = rstd * (dxhat - mean_D(dxhat) - xhat * mean_D(dxhat * xhat))
    RMS norm:    dx = rstd * (dxhat - xhat * mean_D(dxhat * xhat))

For layer norm, ``native_layer_norm_backward(dy, input=xhat, mean=0, rstd=1, w, b)`` returns
exactly ``dw``, ``db`` and the bracket (its normalised input ``(xhat - 0) * 1`` is ``xhat``);
``dx`` is that times the row's ``rstd``. RMS norm's is written with ATen operations. The
forward is PyTorch's: ``aten::native_layer_norm`` (the kernel ``nn.LayerNorm`` runs, so the
outputs are equal bit for bit) and ``torch.rms_norm`` (``nn.RMSNorm``'s), the latter with its
``rstd`` computed again beside it (one more read of the input).

**Weights at or near zero.** Rebuilding divides by ``w``. With ``u`` the unit roundoff of the
stored output's dtype, the rebuilt ``xhat`` of a feature is off by about
``u * (c * |xhat| + |b| / |w|) + s / (2 |w|)`` (``c`` <= 3 roundings of the forward and
rebuild, ``s`` the smallest subnormal, ``finfo.tiny * eps``). So a feature is rebuilt only
where ``|w| >= finfo(stored dtype).tiny`` and ``|b| < K * |w|`` (``K`` = :data:`BIAS_RATIO`),
which bounds its error by ``u * (c * |xhat| + K + 1)``; for every other feature ("kept
columns") forward saves ``xhat`` itself, gathered into a ``(rows, k)`` tensor in the compute
dtype (float32 for half inputs) with the ``(k,)`` index of those features, and backward puts
them into the rebuilt ``xhat``. A zero weight therefore never changes anything: the forward
is PyTorch's whatever the weights, and all-zero weights keep all of ``xhat`` (exact, no
saving). Deciding this reads the number of kept features on the host: one synchronisation
per training forward on CUDA.

Half inputs (float16, bfloat16, also with float32 parameters as autocast and FSDP give them):
forward as PyTorch computes it; backward rebuilds ``xhat`` in float32, a part of the rows at a
time in eager mode (rows are independent, so the parts are exact), writing ``dx`` in the
input's dtype. Double backward is refused; forward-mode AD and ``torch.func`` compute the
layer by composition. Under ``torch.compile`` Dynamo traces the
``autograd.Function`` as it is (ATen calls), on a copy of an input to be overwritten
(:func:`iabn.autograd.function.overwritable`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import debug
from ..autograd.function import needs_grad as layer_needs_grad
from ..autograd.function import overwritable, transformed
from ..kernels.common import LOW_PRECISION
from ..kernels.reference import at_most, part_count
from .batch_norm import OverwriteInputOption
from .checks import (
    SUPPORTED_DTYPES,
    check_flag,
    check_param_dtypes,
    check_param_tensor,
    check_per_call,
    check_tensor_kind,
)

_NATIVE_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_NATIVE_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default

#: ``K`` of the near-zero weight rule (module docstring): a feature whose ``|bias| >= K *
#: |weight|`` keeps its ``xhat`` columns instead of rebuilding them from the output.
BIAS_RATIO = 4.0

LAYER, RMS = "layer", "rms"
_NAMES = {LAYER: "layer normalisation", RMS: "RMS normalisation"}


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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in LOW_PRECISION else dtype


def resolved_eps(eps: float | None, dtype: torch.dtype) -> float:
    """RMS norm's ``eps``; ``None`` is the machine epsilon of the dtype ATen computes in
    (float32 for half inputs: measured, ``torch.rms_norm`` on bfloat16 with ``eps=None`` equals
    it with float32's epsilon, not bfloat16's)."""
    return torch.finfo(_compute_dtype(dtype)).eps if eps is None else float(eps)


def kept_index(weight: Tensor | None, bias: Tensor | None, stored: torch.dtype
               ) -> Tensor | None:
    """The flat indices of the features whose ``xhat`` is kept (module docstring), or ``None``
    where every feature is rebuilt. Reads the count on the host (``nonzero``)."""
    if weight is None:
        return None
    w = weight.detach().reshape(-1).abs()
    keep = w < torch.finfo(stored).tiny
    if bias is not None:
        keep |= bias.detach().reshape(-1).abs() >= BIAS_RATIO * w
    index = keep.nonzero().squeeze(1)
    if torch.compiler.is_compiling():
        # the count is a symbol there (an unbacked size): keep the index, maybe empty
        return index
    return index if index.numel() else None


def _rows(v: Tensor, nd: int) -> tuple[int, int]:
    d = math.prod(v.shape[v.dim() - nd:])
    return (v.numel() // d if d else 0), d


def _forward(v: Tensor, weight: Tensor | None, bias: Tensor | None, shape: tuple[int, ...],
             eps: float | None, kind: str, keep: bool) -> tuple[Tensor, Tensor, Tensor | None,
                                                               Tensor | None]:
    """``(out, rstd, kept, index)`` of the norm of ``v`` (normalised over its trailing
    ``shape``): ``out`` a new tensor as PyTorch's module computes it, ``rstd`` ``(rows, 1)`` in
    the compute dtype, and with ``keep`` the kept ``xhat`` columns ``(rows, k)`` and their
    index (``None`` where there are none)."""
    compute = _compute_dtype(v.dtype)
    m, d = _rows(v, len(shape))
    dims = tuple(range(v.dim() - len(shape), v.dim()))
    if kind == LAYER:
        out, mean, rstd = _NATIVE_LAYER_NORM(v, list(shape), weight, bias, eps)
        mean, rstd = mean.reshape(m, 1).to(compute), rstd.reshape(m, 1).to(compute)
    else:
        out = torch.rms_norm(v, list(shape), weight, eps)
        # the same rstd again, in the compute dtype (vector_norm accumulates in it)
        norm = torch.linalg.vector_norm(v, 2, dims, keepdim=False, dtype=compute)
        rstd = torch.rsqrt(norm.reshape(m, 1).square() / d + resolved_eps(eps, v.dtype))
        mean = None
    index = kept_index(weight, bias, v.dtype) if keep else None
    kept = None
    if index is not None:
        # xhat of those features from the input itself, as the forward computed it
        columns = v.flatten(v.dim() - len(shape)).index_select(-1, index)
        kept = columns.reshape(m, -1).to(compute)
        if mean is not None:
            kept = kept - mean
        kept = kept * rstd
    return out, rstd, kept, index


def _grads(y: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None, rstd: Tensor,
           kept: Tensor | None, index: Tensor | None, kind: str, mask: list[bool],
           ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dw, db)`` from the output ``y`` and ``dz``, both ``(rows, D)``; ``rstd``
    ``(rows, 1)``, ``kept`` ``(rows, k)``; ``weight``/``bias`` flat ``(D,)``. Computed in
    float32 for half inputs, ``dx`` (``(rows, D)``) in ``y``'s dtype, the parameter gradients
    in the compute dtype. See the module docstring for the math."""
    compute = _compute_dtype(y.dtype)
    m, d = y.shape
    # xhat = (y - b) / w into a new tensor (out=: one pass over any strides of y)
    xhat = torch.empty((m, d), dtype=compute, device=y.device)
    if bias is not None:
        torch.sub(y, bias.to(compute), out=xhat)
    else:
        xhat.copy_(y)
    if weight is not None:
        w = weight.to(compute)
        if index is not None:  # no division by a zero weight, even in columns replaced below
            xhat.div_(w.index_fill(0, index, 1.0))
            xhat.index_copy_(1, index, kept.to(compute))
        else:
            xhat.div_(w)
    else:
        w = None
    dy = dz.to(compute)
    if kind == LAYER:
        zeros = rstd.new_zeros((m, 1), dtype=compute)
        ones = rstd.new_ones((m, 1), dtype=compute)
        b = None if bias is None else bias.to(compute)
        dx, dw, db = _NATIVE_LAYER_NORM_BACKWARD(dy, xhat, [d], zeros, ones, w, b, mask)
        if dx is not None:
            dx.mul_(rstd)
    else:
        dxhat = dy if w is None else dy * w
        dw = (dy * xhat).sum(0) if mask[1] and w is not None else None
        db = None
        dx = None
        if mask[0]:
            dot = (dxhat * xhat).mean(1, keepdim=True)
            dx = torch.addcmul(dxhat, xhat, dot, value=-1).mul_(rstd)
    if dx is not None:
        dx = dx.to(y.dtype)
    return dx, dw, db


def _grads_in_parts(y: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                    rstd: Tensor, kept: Tensor | None, index: Tensor | None, kind: str,
                    mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_grads` for half inputs without a float32 tensor of the whole activation: rows
    are normalised independently, so parts of whole rows are exact (the parts of
    :func:`iabn.kernels.reference.part_count`); ``dx`` is written part by part, the parameter
    gradients summed over them in float32."""
    m, d = y.shape
    dx = torch.empty((m, d), dtype=y.dtype, device=y.device) if mask[0] else None
    sums = [torch.zeros(d, dtype=torch.float32, device=y.device) if want else None
            for want in mask[1:]]
    for a, b in at_most(m, part_count(y.numel())):
        part = _grads(y[a:b], dz[a:b], weight, bias, rstd[a:b],
                      None if kept is None else kept[a:b], index, kind, mask)
        if dx is not None:
            dx[a:b].copy_(part[0])
        for total, value in zip(sums, part[1:], strict=True):
            if total is not None and value is not None:
                total += value
    return dx, *sums


def _view(t: Tensor, channels: bool) -> Tensor:
    """The tensor with the normalised dimension last (``InPlaceLayerNorm2d``'s dim 1)."""
    return t.movedim(1, -1) if channels else t


class OutputOnlyNormFunction(torch.autograd.Function):
    """Autograd for the layers of this module: keeps the output, ``rstd`` ``(rows, 1)`` and
    the kept ``xhat`` columns with their index (module docstring). With ``overwrite`` the
    output is written into ``x`` (marked dirty) and ``x`` is returned."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None,
        shape: tuple[int, ...], eps: float | None, kind: str, channels: bool, overwrite: bool,
    ) -> Tensor:
        v = _view(x, channels)
        out, rstd, kept, index = _forward(v, weight, bias, shape, eps, kind, keep=True)
        if overwrite:
            v.copy_(out)
            del out
            ctx.mark_dirty(x)
            result = x
        else:
            result = out.movedim(-1, 1) if channels else out
        ctx.save_for_backward(result, weight, bias, rstd, kept, index)
        ctx.options = (shape, kind, channels)
        if torch.compiler.is_compiling():
            # there the number of kept features is a symbol (an unbacked size), which Dynamo
            # accepts only in a returned tensor: kept and index are outputs too (not
            # differentiable; norm_call drops them). Not in eager mode, where autograd refuses
            # more than one output of a Function that overwrites a view.
            ctx.mark_non_differentiable(kept, index)
            return result, kept, index
        return result

    @staticmethod
    def backward(ctx: Any, dz: Tensor, *unused: Any) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            # only under create_graph=True (as iabn.autograd.function.refuse_double_backward)
            raise RuntimeError(
                "iabn's InPlaceLayerNorm/InPlaceRMSNorm/InPlaceLayerNorm2d do not support "
                "double backward (create_graph=True); use nn.LayerNorm or nn.RMSNorm where "
                "second derivatives are needed"
            )
        y, weight, bias, rstd, kept, index = ctx.saved_tensors
        shape, kind, channels = ctx.options
        want_dx, want_dweight, want_dbias = ctx.needs_input_grad[:3]
        mask = [want_dx, want_dweight and weight is not None, want_dbias and bias is not None]
        v, dv = _view(y, channels), _view(dz, channels)
        m, d = _rows(v, len(shape))
        y2, dz2 = v.reshape(m, d), dv.reshape(m, d)
        w = None if weight is None else weight.detach().reshape(d)
        b = None if bias is None else bias.detach().reshape(d)
        if y.dtype in LOW_PRECISION and not torch.compiler.is_compiling():
            dx, dw, db = _grads_in_parts(y2, dz2, w, b, rstd, kept, index, kind, mask)
        else:
            dx, dw, db = _grads(y2, dz2, w, b, rstd, kept, index, kind, mask)
        if dx is not None:
            dx = dx.view(v.shape)
            dx = dx.movedim(-1, 1) if channels else dx
        dw = dw.view(shape).to(weight.dtype) if mask[1] and dw is not None else None
        db = db.view(shape).to(bias.dtype) if mask[2] and db is not None else None
        return dx if want_dx else None, dw, db, None, None, None, None, None


def norm_call(input: Tensor, weight: Tensor | None, bias: Tensor | None,
              shape: tuple[int, ...], eps: float | None, kind: str, channels: bool,
              overwrite: bool, layer: str) -> Tensor:
    """The layer's output after its checks (no validation here): the debug mode's poisoned
    call, the norm without autograd, or :class:`OutputOnlyNormFunction`."""
    options = (shape, eps, kind, channels, overwrite)
    if overwrite and debug._ACTIVE and debug.intercepts():
        return debug.poisoned_call(
            lambda copy: norm_call(copy, weight, bias, *options, layer), input, layer)
    if transformed():
        # forward-mode AD and torch.func, which cannot run the Function: PyTorch's own norm
        # of a copy (its backward keeps that copy), written into the input
        v = _view(input, channels)
        source = v.clone() if overwrite else v
        if kind == LAYER:
            out = torch.nn.functional.layer_norm(source, shape, weight, bias, eps)
        else:
            out = torch.nn.functional.rms_norm(source, shape, weight, eps)
        if not overwrite:
            return out.movedim(-1, 1) if channels else out
        v.copy_(out)
        return input
    if not layer_needs_grad(input, weight, bias):
        v = _view(input, channels)
        with torch.no_grad():
            out = _forward(v, weight, bias, shape, eps, kind, keep=False)[0]
            if not overwrite:
                return out.movedim(-1, 1) if channels else out
            v.copy_(out)
        return input
    x = overwritable(input) if overwrite else input
    out = OutputOnlyNormFunction.apply(x, weight, bias, shape, eps, kind, channels, overwrite)
    return out[0] if isinstance(out, tuple) else out


class InPlaceLayerNorm(OverwriteInputOption, nn.LayerNorm):
    """``nn.LayerNorm`` that keeps only its output (and per-row ``rstd``) for backward.

    Same arguments, parameters, ``state_dict`` keys, ``reset_parameters()`` and outputs as
    ``nn.LayerNorm`` (an instance of it), for any ``normalized_shape``, ``elementwise_affine``
    and ``bias``, and inputs of any strides (a channels-last ``x.permute(0, 2, 3, 1)`` view as
    ConvNeXt normalises it). ``overwrite_input`` (keyword, default ``True``): write the output
    into the input's storage and return the input tensor, which must then not be needed
    elsewhere (the in-place contract of :class:`iabn.InPlaceABN`: a leaf that requires grad, an
    inference tensor or one whose elements share memory is refused; ``iabn.debug`` finds later
    reads). ``False``: the output-only mode, a new output and the input left untouched (and not
    kept). Features with a weight at or near zero keep their normalised values (module
    docstring of :mod:`iabn.layers.layer_norm`). Double backward is refused.
    """

    _in_place = True
    _kind = LAYER
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
        return norm_call(input, weight, bias, shape, self.eps, self._kind, self._channels,
                         self._in_place, type(self).__name__)

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
    """

    _in_place = True
    _kind = RMS
    _channels = False

    def __init__(self, normalized_shape: int | Sequence[int], eps: float | None = None,
                 elementwise_affine: bool = True, device=None, dtype=None, *,
                 overwrite_input: bool = True) -> None:
        shape = as_shape(normalized_shape)
        check_flag("overwrite_input", overwrite_input)
        super().__init__(shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.overwrite_input = overwrite_input

    forward = InPlaceLayerNorm.forward

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.overwrite_input else ", overwrite_input=False")


def inplace_layer_norm(input: Tensor, normalized_shape: int | Sequence[int],
                       weight: Tensor | None = None, bias: Tensor | None = None,
                       eps: float = 1e-5, *, overwrite_input: bool = True) -> Tensor:
    """:class:`InPlaceLayerNorm` as a function, with ``F.layer_norm``'s arguments."""
    check_flag("overwrite_input", overwrite_input)
    shape = as_shape(normalized_shape)
    check_norm_inputs(input, weight, bias, shape, kind=LAYER, channels=False,
                      in_place=overwrite_input)
    return norm_call(input, weight, bias, shape, eps, LAYER, False, overwrite_input,
                     "iabn.functional.inplace_layer_norm")


def inplace_rms_norm(input: Tensor, normalized_shape: int | Sequence[int],
                     weight: Tensor | None = None, eps: float | None = None, *,
                     overwrite_input: bool = True) -> Tensor:
    """:class:`InPlaceRMSNorm` as a function, with ``F.rms_norm``'s arguments."""
    check_flag("overwrite_input", overwrite_input)
    shape = as_shape(normalized_shape)
    check_norm_inputs(input, weight, None, shape, kind=RMS, channels=False,
                      in_place=overwrite_input)
    return norm_call(input, weight, None, shape, eps, RMS, False, overwrite_input,
                     "iabn.functional.inplace_rms_norm")


__all__ = [
    "InPlaceLayerNorm",
    "InPlaceLayerNorm2d",
    "InPlaceRMSNorm",
    "OutputOnlyNormFunction",
    "inplace_layer_norm",
    "inplace_rms_norm",
]
