"""The row-norm family's math (layer norm and RMS norm, keeping only the output): the reference
backend's ``row_norm_forward`` and ``row_norm_backward`` (docs/design.md, "Output-only layer
norm").

The math, for one row (the ``D`` values of ``normalized_shape``), weight ``w`` and bias ``b``
per feature::

    layer norm:  mean, rstd = 1 / sqrt(var + eps) (biased),  xhat = (x - mean) * rstd
    RMS norm:    rstd = 1 / sqrt(mean(x^2) + eps),            xhat = x * rstd
    y = w * xhat + b                                          (RMS norm: no b)

Backward rebuilds ``xhat = (y - b) / w`` and, with ``dxhat = w * dy``::

    db = sum_rows dy,   dw = sum_rows dy * xhat
    layer norm:  dx = rstd * (dxhat - mean_D(dxhat) - xhat * mean_D(dxhat * xhat))
    RMS norm:    dx = rstd * (dxhat - xhat * mean_D(dxhat * xhat))

``xhat`` is rebuilt by one operation that reads ``y`` once (:func:`_rebuilt_xhat`), and
``native_layer_norm_backward(dy, input=xhat, mean=0, rstd=1, w, b)`` returns exactly ``dw``,
``db`` and layer norm's bracket (its normalised input ``(xhat - 0) * 1`` is ``xhat``); ``dx``
is that times the row's ``rstd``. RMS norm's bracket is layer norm's plus the row's
``mean_D(dxhat)`` (one ``mv``), added in the same multiply (:func:`_grads` counts the
passes). The
forward is PyTorch's: ``aten::native_layer_norm`` (the kernel ``nn.LayerNorm`` runs, so the
outputs are equal bit for bit) and ``torch.rms_norm`` (``nn.RMSNorm``'s): where the input's
and the weight's dtypes match, the kernel it calls, ``aten._fused_rms_norm``, which returns
``rstd`` too; otherwise ``torch.rms_norm`` with its ``rstd`` computed again beside it (one
more read of the input).

**Weights at or near zero.** Rebuilding divides by ``w``. With ``u`` the unit roundoff of the
stored output's dtype, the rebuilt ``xhat`` of a feature is off by about
``u * (c * |xhat| + c' * |b| / |w|) + s / (2 |w|)`` (``c`` <= 3 roundings of the forward and
rebuild, ``c'`` <= 3: the stored output's, and ``-b/w + y/w`` rounds ``b/w`` and ``y/w``
apart; ``s`` the smallest subnormal, ``finfo.tiny * eps``). So a feature is rebuilt only
where ``|w| >= finfo(stored dtype).tiny`` and ``|b| < K * |w|`` (``K`` = :data:`BIAS_RATIO`),
which bounds its error by ``u * (c * |xhat| + c' * K + 1)``, and where its weight and bias are
finite and its output cannot overflow (:func:`kept_index`); for every other feature ("kept
columns") forward saves ``xhat`` itself, gathered into a ``(rows, k)`` tensor in the compute
dtype (float32 for half inputs) with the ``(k,)`` index of those features, and backward puts
them into the rebuilt ``xhat``. A zero weight therefore never changes anything: the forward
is PyTorch's whatever the weights, and all-zero weights keep all of ``xhat`` (exact, no
saving). Deciding this reads the number of kept features on the host: one synchronisation
per training forward on CUDA.

Half inputs (float16, bfloat16, also with float32 parameters as autocast and FSDP give them):
forward as PyTorch computes it; backward rebuilds ``xhat`` in float32, a part of the rows at a
time in eager mode (rows are independent, so the parts are exact), writing ``dx`` in the
input's dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import cpu_loops
from .common import LAYER_NORM, LOW_PRECISION, RowConfig, at_most, part_count

_NATIVE_LAYER_NORM = torch.ops.aten.native_layer_norm.default
_NATIVE_LAYER_NORM_BACKWARD = torch.ops.aten.native_layer_norm_backward.default
#: ``(out, rstd)`` of an RMS norm: what ``torch.rms_norm`` calls where the input's and the
#: weight's dtypes match (torch 2.8 and later have it).
_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)

#: ``K`` of the near-zero weight rule (module docstring): a feature whose ``|bias| >= K *
#: |weight|`` keeps its ``xhat`` columns instead of rebuilding them from the output.
BIAS_RATIO = 4.0


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
    where every feature is rebuilt. Reads the count on the host (``nonzero``).

    Besides the near-zero weights: a weight or bias that is not finite, where ``(y - b) / w``
    is not ``xhat`` whatever ``y`` is, and a feature whose output may overflow the stored dtype
    (``|w| sqrt(D) + |b| >= finfo.max``: ``|xhat| <= sqrt(D)`` in a row of ``D`` values), whose
    ``y`` may be ``inf`` (a float16 output, a weight of 1e308 in float64); PyTorch's gradients
    are finite there."""
    if weight is None:
        return None
    # Written as the features that are rebuilt, each condition false for a NaN, in few
    # launches (each a kernel launch on a GPU, per layer call): w > b / K + tiny (so w >=
    # tiny, b < K w) and w sqrt(D) + b < max (no overflow: false for an infinite w or b).
    w = weight.detach().reshape(-1).abs()
    info = torch.finfo(stored)
    root = math.sqrt(max(w.numel(), 1))
    if bias is None:
        rebuilt = (w > info.tiny) & (w < info.max / root)
    else:
        b = bias.detach().reshape(-1).abs()
        rebuilt = ((torch.add(b, w, alpha=-BIAS_RATIO) < -BIAS_RATIO * info.tiny)
                   & (torch.add(b, w, alpha=root) < info.max))
    keep = rebuilt.logical_not_()
    index = keep.nonzero().squeeze(1)
    if torch.compiler.is_compiling():
        # the count is a symbol there (an unbacked size): keep the index, maybe empty
        return index
    return index if index.numel() else None


def normalised_last(t: Tensor, channels: bool) -> Tensor:
    """The tensor with the normalised dimension last (``InPlaceLayerNorm2d``'s dim 1)."""
    return t.movedim(1, -1) if channels else t


def _rows(v: Tensor, nd: int) -> tuple[int, int]:
    """``(rows, D)``: the leading dimensions' count and the normalised ones' (either may be
    0: an empty row is normalised to an empty output, as PyTorch's)."""
    return math.prod(v.shape[:v.dim() - nd]), math.prod(v.shape[v.dim() - nd:])


def row_norm_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                     config: RowConfig, keep: bool,
                     ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``(out, rstd, kept, index)`` of the norm of ``x``: ``out`` a new tensor as PyTorch's
    module computes it, laid out as ``x`` is seen by the layer (``channels``: dim 1 normalised),
    ``rstd`` ``(rows, 1)`` in the compute dtype, and with ``keep`` the kept ``xhat`` columns
    ``(rows, k)`` and their index (``None`` where there are none)."""
    shape, eps, kind, channels = config
    v = normalised_last(x, channels)
    compute = _compute_dtype(v.dtype)
    m, d = _rows(v, len(shape))
    dims = tuple(range(v.dim() - len(shape), v.dim()))
    if kind == LAYER_NORM:
        out, mean, rstd = _NATIVE_LAYER_NORM(v, list(shape), weight, bias, eps)
        mean, rstd = mean.reshape(m, 1).to(compute), rstd.reshape(m, 1).to(compute)
    elif _FUSED_RMS_NORM is not None and (weight is None or weight.dtype == v.dtype):
        # the kernel torch.rms_norm runs here (where the dtypes match), which also returns
        # the rstd it normalised with: one read of the input, one launch
        out, rstd = _FUSED_RMS_NORM(v, list(shape), weight, eps)
        rstd, mean = rstd.reshape(m, 1).to(compute), None
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
    return (out.movedim(-1, 1) if channels else out), rstd, kept, index


def row_norm_backward(y: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                      rstd: Tensor, kept: Tensor | None, index: Tensor | None,
                      config: RowConfig, output_mask: list[bool],
                      ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dweight, dbias)`` from the output ``y`` (as the layer returned it), ``rstd`` and
    the kept columns of :func:`row_norm_forward`; ``None`` where ``output_mask`` does not ask
    for it."""
    shape, _, kind, channels = config
    v, dv = normalised_last(y, channels), normalised_last(dz, channels)
    m, d = _rows(v, len(shape))
    y2, dz2 = v.reshape(m, d), dv.reshape(m, d)
    w = None if weight is None else weight.detach().reshape(d)
    b = None if bias is None else bias.detach().reshape(d)
    if (y.dtype == torch.float32 and index is None and d
            and cpu_loops.runs_on(y2, dz2, rstd)):
        dx, dw, db = cpu_loops.row_norm_backward(y2, dz2, w, b, rstd, kind == LAYER_NORM)
    elif y.dtype in LOW_PRECISION and not torch.compiler.is_compiling():
        dx, dw, db = _grads_in_parts(y2, dz2, w, b, rstd, kept, index, kind, output_mask)
    else:
        dx, dw, db = _grads(y2, dz2, w, b, rstd, kept, index, kind, output_mask)
    if dx is not None:
        dx = dx.view(v.shape)
        dx = dx.movedim(-1, 1) if channels else dx
    dw = dw.view(shape).to(weight.dtype) if output_mask[1] and dw is not None else None
    db = db.view(shape).to(bias.dtype) if output_mask[2] and db is not None else None
    return dx if output_mask[0] else None, dw, db


def _rebuilt_xhat(y: Tensor, weight: Tensor | None, bias: Tensor | None,
                  kept: Tensor | None, index: Tensor | None, compute: torch.dtype) -> Tensor:
    """``xhat = (y - b) / w`` as a new ``(rows, D)`` tensor in the compute dtype, written by one
    operation that reads ``y`` once (``addcdiv``: ``-b/w + y/w``; ``div`` without a bias; a
    copy without a weight), the kept columns put back (``(rows, k)``, a small part)."""
    m, d = y.shape
    xhat = torch.empty((m, d), dtype=compute, device=y.device)
    if weight is None:
        return xhat.copy_(y)
    w = weight.to(compute)
    if index is not None:  # no division by a zero weight, even in columns replaced below
        w = w.index_fill(0, index, 1.0)
    if bias is None:
        torch.div(y, w, out=xhat)
    else:
        b = bias.to(compute)
        if index is not None:  # nor an infinite or NaN bias there
            b = b.index_fill(0, index, 0.0)
        torch.addcdiv(-b / w, y, w, out=xhat)
    if index is not None:
        xhat.index_copy_(1, index, kept.to(compute))
    return xhat


def _grads(y: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None, rstd: Tensor,
           kept: Tensor | None, index: Tensor | None, kind: str, mask: list[bool],
           out: Tensor | None = None,
           ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dx, dw, db)`` from the output ``y`` and ``dz``, both ``(rows, D)``; ``rstd``
    ``(rows, 1)``, ``kept`` ``(rows, k)``; ``weight``/``bias`` flat ``(D,)``. Computed in
    float32 for half inputs, ``dx`` (``(rows, D)``) in ``y``'s dtype (written into ``out``
    where given), the parameter gradients in the compute dtype. See the module docstring for
    the math.

    Four operations touch whole activations: the rebuild of ``xhat`` (reads ``y``, writes
    ``xhat``), ``native_layer_norm_backward(dy, xhat, mean=0, rstd=1)`` (reads ``dy`` and
    ``xhat``, writes the bracket, returns ``dw`` and ``db``), for RMS norm ``dy @ w`` (reads
    ``dy``: the row's ``mean_D(dxhat)``, which layer norm's bracket subtracts and RMS norm's
    does not), and the bracket times ``rstd`` (plus that mean for RMS norm) written as ``dx``:
    7 activation-sized passes of bytes for layer norm, 8 for RMS norm (float32)."""
    compute = _compute_dtype(y.dtype)
    m, d = y.shape
    xhat = _rebuilt_xhat(y, weight, bias, kept, index, compute)
    w = None if weight is None else weight.to(compute)
    b = None if bias is None else bias.to(compute)
    dy = dz.to(compute)
    zeros = rstd.new_zeros((m, 1), dtype=compute)
    ones = rstd.new_ones((m, 1), dtype=compute)
    want = [mask[0], mask[1] and w is not None, mask[2] and b is not None]
    bracket, dw, db = _NATIVE_LAYER_NORM_BACKWARD(dy, xhat, [d], zeros, ones, w, b, want)
    del xhat
    dx = None
    if mask[0]:
        if out is None:
            out = (bracket if bracket.dtype == y.dtype
                   else torch.empty((m, d), dtype=y.dtype, device=y.device))
        if kind == LAYER_NORM:
            torch.mul(bracket, rstd, out=out)
        else:
            # the bracket minus layer norm's mean_D(w dy), times rstd: one pass
            mean_dxhat = (dy.mean(1, keepdim=True) if w is None
                          else torch.mv(dy, w).unsqueeze(1).div_(d))
            torch.addcmul(mean_dxhat.mul_(rstd), bracket, rstd, out=out)
        dx = out
    return dx, dw, db


def _grads_in_parts(y: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                    rstd: Tensor, kept: Tensor | None, index: Tensor | None, kind: str,
                    mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`_grads` for half inputs without a float32 tensor of the whole activation: rows
    are normalised independently, so parts of whole rows are exact (the parts of
    :func:`.common.part_count`); ``dx`` is written part by part, the parameter
    gradients summed over them in float32."""
    m, d = y.shape
    dx = torch.empty((m, d), dtype=y.dtype, device=y.device) if mask[0] else None
    sums = [torch.zeros(d, dtype=torch.float32, device=y.device) if want else None
            for want in mask[1:]]
    for a, b in at_most(m, part_count(y.numel())):
        part = _grads(y[a:b], dz[a:b], weight, bias, rstd[a:b],
                      None if kept is None else kept[a:b], index, kind, mask,
                      None if dx is None else dx[a:b])
        for total, value in zip(sums, part[1:], strict=True):
            if total is not None and value is not None:
                total += value
    return dx, *sums


__all__ = ["BIAS_RATIO", "kept_index", "resolved_eps", "row_norm_backward", "row_norm_forward"]
