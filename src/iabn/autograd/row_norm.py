"""The row-norm family's autograd (layer norm and RMS norm that keep only their output):
:class:`OutputOnlyNormFunction` and the call after the checks (:func:`row_norm_call`). The
math is the backend's (:mod:`iabn.kernels.row_norm` for the reference). Double backward is
refused; forward-mode AD and ``torch.func`` compute the layer by composition. Under
``torch.compile`` Dynamo traces the ``Function`` as it is (the reference's ATen calls), on a
copy of an input to be overwritten (:func:`~.call.overwritable`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.backends import backend_or_reference
from ..kernels.common import LAYER_NORM, RowConfig
from ..kernels.row_norm import normalised_last
from .call import grad_mask, layer_call, overwritable, refuse_double_backward


class OutputOnlyNormFunction(torch.autograd.Function):
    """Keeps the output, ``rstd`` ``(rows, 1)`` and the kept ``xhat`` columns with their index
    (:mod:`iabn.kernels.row_norm`). With ``overwrite`` the output is written into ``x`` (marked
    dirty) and ``x`` is returned."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None,  # type: ignore[override]
                config: RowConfig, overwrite: bool) -> Tensor:
        kernels = backend_or_reference(x)
        out, rstd, kept, index = kernels.row_norm_forward(x, weight, bias, config, True)
        if overwrite:
            x.copy_(out)
            del out
            ctx.mark_dirty(x)
            result = x
        else:
            result = out
        ctx.save_for_backward(result, weight, bias, rstd, kept, index)
        ctx.config, ctx.kernels = config, kernels
        if torch.compiler.is_compiling():
            # there the number of kept features is a symbol (an unbacked size), which Dynamo
            # accepts only in a returned tensor: kept and index are outputs too (not
            # differentiable; the family drops them). Not in eager mode, where autograd refuses
            # more than one output of a Function that overwrites a view.
            ctx.mark_non_differentiable(kept, index)
            return result, kept, index
        return result

    @staticmethod
    def backward(ctx: Any, dz: Tensor, *unused: Any) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            refuse_double_backward("iabn's InPlaceLayerNorm/InPlaceRMSNorm/InPlaceLayerNorm2d",
                                   "nn.LayerNorm or nn.RMSNorm", plural=True)
        y, weight, bias, rstd, kept, index = ctx.saved_tensors
        dx, dw, db = ctx.kernels.row_norm_backward(y, dz, weight, bias, rstd, kept, index,
                                                   ctx.config, grad_mask(ctx, weight, bias))
        return dx, dw, db, None, None


class RowNormFamily:
    """The row-norm family's computations for :func:`~.call.layer_call`; ``options`` is the
    call's :class:`~iabn.kernels.common.RowConfig`."""

    @staticmethod
    def composed(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                 config: RowConfig, overwrite: bool) -> Tensor:
        """PyTorch's own norm of a copy (its backward keeps that copy), written into the
        input where ``overwrite``."""
        shape, eps, kind, channels = config
        v = normalised_last(input, channels)
        source = v.clone() if overwrite else v
        if kind == LAYER_NORM:
            out = F.layer_norm(source, shape, weight, bias, eps)
        else:
            out = F.rms_norm(source, shape, weight, eps)
        if not overwrite:
            return out.movedim(-1, 1) if channels else out
        v.copy_(out)
        return input

    @staticmethod
    def without_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                     config: RowConfig, overwrite: bool) -> Tensor:
        with torch.no_grad():
            out = backend_or_reference(input).row_norm_forward(input, weight, bias, config,
                                                               False)[0]
            if not overwrite:
                return out
            input.copy_(out)
        return input

    @staticmethod
    def with_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                  config: RowConfig, overwrite: bool) -> Tensor:
        x = overwritable(input) if overwrite else input
        out = OutputOnlyNormFunction.apply(x, weight, bias, config, overwrite)
        return out[0] if isinstance(out, tuple) else out


def row_norm_call(input: Tensor, weight: Tensor | None, bias: Tensor | None,
                  config: RowConfig, overwrite: bool, layer: str) -> Tensor:
    """The layer's output after its checks (no validation here)."""
    return layer_call(RowNormFamily, input, weight, bias, config, overwrite, layer)


__all__ = ["OutputOnlyNormFunction", "row_norm_call"]
