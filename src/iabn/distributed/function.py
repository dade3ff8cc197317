"""The synchronised In-Place ABN computation: batch statistics over the ranks of a
``torch.distributed`` process group (docs/design.md, "Synchronised layers"), as the autograd
``Function`` the layers run and as the functional :func:`inplace_abn_sync`.

Per layer and training step there are exactly two collectives:

- forward: one ``all_gather`` of each rank's ``(count, mean, var)`` (float64), merged with
  Chan's formula, so ranks with different batch sizes — even zero — are exact;
- backward: one ``all_reduce`` (sum) of the stacked ``(sum(dy * xhat), sum(dy))``.

The modules (``InPlaceABNSync``, ``ABNSync``) and the converters are in :mod:`.layers`, the
statistics' math in :mod:`.moments`, the groups in :mod:`.groups`; the kernels are those of
the backend :func:`iabn.kernels.backends.backend_for` picks, as for the single-process layer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import debug
from ..autograd.batch_norm import compute_inplace
from ..autograd.call import grad_mask, overwritable, overwrite_refused, refuse_double_backward
from ..kernels.backends import backend_for
from ..kernels.common import SIGNED, LayerConfig, finish_grads, new_bits, stat_dtype
from ..layers.options import checked_call
from .groups import group_to_sync
from .moments import local_moments, merge_moments, update_running_stats_

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def check_across_ranks(x: Tensor, group: Any) -> None:
    """Fail clearly, on every rank, when ranks disagree on channel count, rank or dtype.

    One small all-gather; the modules run it once, on their first synchronised step, because
    a mismatch would otherwise surface as a hang or an opaque error inside the collectives.
    """
    meta = torch.tensor(
        [x.shape[1], x.dim(), _DTYPE_CODES[x.dtype]], dtype=torch.int64, device=x.device
    )
    gathered = [torch.empty_like(meta) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, meta, group=group)
    table = torch.stack(gathered)
    if not bool((table == meta).all()):
        names = {code: str(dtype) for dtype, code in _DTYPE_CODES.items()}
        rows = ", ".join(
            f"rank {r}: {c} channels, {d}-D, {names.get(t, t)}"
            for r, (c, d, t) in enumerate(table.tolist())
        )
        raise ValueError(
            f"InPlaceABNSync inputs differ across ranks ({rows}): every rank must run the same "
            f"layer on inputs with the same channel count, rank and dtype"
        )


class InPlaceABNSyncFunction(torch.autograd.Function):
    """Autograd of the synchronised layer: saves ``z`` only, like the single-process one
    (and, for an activation with one minimum, the packed branch bits its backend writes)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        config: LayerConfig,
        group: Any,
    ) -> Tensor:
        # before the all-gather or any write: every rank raises alike
        kernels = backend_for(x, config.activation)
        moments = local_moments(x)
        gathered = [torch.empty_like(moments) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, moments, group=group)
        total, mean, var = merge_moments(torch.stack(gathered))
        # The total stays on the device (reading it waits for the device). A rank with 2 or
        # more values knows the total is at least that; only ranks with fewer read it, and
        # where the total is below 2 every rank has fewer, so all of them raise.
        if x.numel() // max(x.shape[1], 1) < 2 and bool(total < 2):
            raise ValueError(
                f"expected more than 1 value per channel when training, got {int(total)} over "
                f"all ranks: use larger batches or eval mode"
            )
        # the single-process forward in eval mode, the merged statistics standing in for the
        # running ones
        sdtype = stat_dtype(x, weight, None)
        merged = (x, weight, bias, mean.to(sdtype), var.to(sdtype), config.for_eval())
        bits = new_bits(x, config)
        invstd, scale = kernels.forward_(*merged, bits)
        if running_mean is not None and running_var is not None:
            update_running_stats_(running_mean, running_var, mean, var, total, config.momentum)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, bits, weight, bias, invstd, scale)
        ctx.config, ctx.group, ctx.total, ctx.kernels = config, group, total, kernels
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            refuse_double_backward("InPlaceABNSync", "iabn.ABNSync")
        z, bits, weight, bias, invstd, scale = ctx.saved_tensors
        c = ctx.config
        kernels = ctx.kernels
        mask = grad_mask(ctx, weight, bias)
        saved, sums = kernels.local_sums(z, dz, bias, scale, c, bits)
        global_sums = sums.clone()
        dist.all_reduce(global_sums, group=ctx.group)
        dx = None
        if mask[0]:
            dx = kernels.input_grad(saved, bias, scale, invstd, global_sums, ctx.total, z.dtype)
        # Parameter gradients are this rank's own sums: DDP averages them across ranks.
        dx, dgamma, dbeta = finish_grads(
            dx, sums[0], sums[1], z, weight, bias, c.gamma_mode, mask
        )
        return dx, dgamma, dbeta, None, None, None, None


def inplace_abn_sync(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "leaky_relu",
    activation_param: float = 0.01,
    *,
    gamma_mode: str = SIGNED,
    group: Any = None,
) -> Tensor:
    """:func:`iabn.functional.inplace_abn` with batch statistics over all ranks of ``group``
    (default: the whole world) when ``training=True``.

    Every rank of the group must call it for the same layer in the same order (it runs
    collectives). Without a multi-rank process group it is :func:`inplace_abn` (and warns
    once). It does not compare channel counts across ranks; :class:`InPlaceABNSync` does, and
    :func:`check_across_ranks` can be called once beforehand.
    """
    config, synced_group = checked_call(
        "inplace_abn_sync", input, running_mean, running_var, weight, bias, training, momentum,
        eps, activation, activation_param, gamma_mode, in_place=True, branch=True,
        group_of=lambda training: group_to_sync(group, training),
    )
    if synced_group is None:
        return compute_inplace(input, running_mean, running_var, weight, bias, config)
    return synchronised_call(input, weight, bias, running_mean, running_var, config,
                             synced_group, "iabn.distributed.inplace_abn_sync")


def synchronised_call(
    input: Tensor, weight: Tensor | None, bias: Tensor | None, running_mean: Tensor | None,
    running_var: Tensor | None, config: LayerConfig, group: Any, name: str,
    poison: bool = True,
) -> Tensor:
    """:class:`InPlaceABNSyncFunction` on ``input`` after the checks, the one path of the
    functional form and the modules: with :func:`iabn.debug.poison_overwritten` active (and
    ``poison``: not for a copy nobody else can read) through the debug mode's poisoned call,
    which names the call ``name``."""

    def step(x: Tensor) -> Tensor:
        return InPlaceABNSyncFunction.apply(x, weight, bias, running_mean, running_var, config,
                                            group)

    grad = torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
    if overwrite_refused(input, grad):  # the run-time rule of autograd/call.layer_call
        return step(input.clone())
    if poison and debug._ACTIVE and debug.intercepts():
        return debug.poisoned_call(step, input, name)
    return step(overwritable(input))


__all__ = ["InPlaceABNSyncFunction", "check_across_ranks", "inplace_abn_sync", "synchronised_call"]
