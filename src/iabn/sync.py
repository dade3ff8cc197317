"""The synchronised In-Place ABN computation: batch statistics over the ranks of a
``torch.distributed`` process group (docs/design.md, "Synchronised layers").

Per layer and training step there are exactly two collectives:

- forward: one ``all_gather`` of each rank's ``(count, mean, var)`` (float64), merged with
  Chan's formula, so ranks with different batch sizes — even zero — are exact;
- backward: one ``all_reduce`` (sum) of the stacked ``(sum(dy * xhat), sum(dy))``.

The modules (``InPlaceABNSync``, ``ABNSync``) and the converters are in ``distributed.py``;
this module is what both they and :mod:`iabn.functional` use, so neither imports the other.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import branch_activation, debug
from .activation import BRANCH_ACTIVATIONS
from .checks import check_argument_order, check_inputs, check_options
from .kernels import reference
from .kernels import sync_reference as sync
from .kernels.dispatch import backend_for, sync_backend_for
from .layer_config import LayerConfig
from .ops import overwritable, refuse_double_backward
from .scale import SIGNED
from .unchecked import inplace_abn_unchecked

_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_warned_single_process = False


def resolve_group(group: Any = None) -> Any | None:
    """The process group to synchronise over now, or ``None`` when there is nothing to sync
    with (``torch.distributed`` unavailable or not initialised, or a group of one rank)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if group is None else group
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        raise RuntimeError(
            "this rank is not a member of the process group given to InPlaceABNSync: create "
            "the layer with a group that contains every rank that runs it"
        )
    return group if dist.get_world_size(group) > 1 else None


def _warn_single_process() -> None:
    global _warned_single_process
    if not _warned_single_process:
        _warned_single_process = True
        warnings.warn(
            "InPlaceABNSync runs without a torch.distributed process group of more than one "
            "rank, so it normalises with this process's batch only (like InPlaceABN). Call "
            "torch.distributed.init_process_group first (e.g. under torchrun) to synchronise.",
            stacklevel=3,
        )


def _group_to_sync(group: Any, training: bool) -> Any | None:
    """The group a step synchronises over: none in eval mode; in training, none (with the
    one-time warning) when there is no multi-rank process group."""
    if not training:
        return None
    resolved = resolve_group(group)
    if resolved is None:
        _warn_single_process()
    return resolved


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
    (and, with ``silu``/``gelu``, its packed branch bits: :mod:`iabn.branch_activation`)."""

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
        branch = config.activation in BRANCH_ACTIVATIONS
        kernels = backend_for(x)  # before the all-gather or any write: every rank raises alike
        moments = sync.local_moments(x)
        gathered = [torch.empty_like(moments) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, moments, group=group)
        total, mean, var = sync.merge_moments(torch.stack(gathered))
        # The total stays on the device (reading it waits for the device). A rank with 2 or
        # more values knows the total is at least that; only ranks with fewer read it, and
        # where the total is below 2 every rank has fewer, so all of them raise.
        if x.numel() // max(x.shape[1], 1) < 2 and bool(total < 2):
            raise ValueError(
                f"expected more than 1 value per channel when training, got {int(total)} over "
                f"all ranks: use larger batches or eval mode"
            )
        packed = None
        if branch:
            invstd, scale, packed = branch_activation.sync_forward_(x, weight, bias, mean, var,
                                                                    config, kernels)
        else:
            invstd, scale = sync.normalize_(kernels, x, weight, bias, mean, var, config)
        if running_mean is not None and running_var is not None:
            sync.update_running_stats_(running_mean, running_var, mean, var, total,
                                       config.momentum)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, packed, weight, bias, invstd, scale)
        ctx.config, ctx.group, ctx.total, ctx.kernels = config, group, total, kernels
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward("InPlaceABNSync")
        z, packed, weight, bias, invstd, scale = ctx.saved_tensors
        c = ctx.config
        if packed is not None:  # silu, gelu: y from z and the branch bits
            kernels, saved, sums = branch_activation.sync_local_sums(z, packed, dz, bias, scale,
                                                                     c, ctx.kernels)
        else:
            kernels = sync_backend_for(z)
            saved, sums = kernels.local_sums(z, dz, bias, scale, c)
        global_sums = sums.clone()
        dist.all_reduce(global_sums, group=ctx.group)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = kernels.input_grad(saved, bias, scale, invstd, global_sums, ctx.total, z.dtype)
        mask = [dx is not None, ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        # Parameter gradients are this rank's own sums: DDP averages them across ranks.
        dx, dgamma, dbeta = reference.finish_grads(
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
    check_options(activation, activation_param, gamma_mode, in_place=True, eps=eps,
                  momentum=momentum, branch=True)
    check_argument_order("inplace_abn_sync", running_mean, running_var)
    synced_group = _group_to_sync(group, training)
    check_inputs(input, running_mean, running_var, weight, bias, training, in_place=True,
                 synchronised=synced_group is not None)
    if synced_group is None:
        config = LayerConfig(training, momentum, eps, activation, activation_param, gamma_mode)
        return inplace_abn_unchecked(input, running_mean, running_var, weight, bias, config)
    config = LayerConfig(True, momentum, eps, activation, activation_param, gamma_mode)
    if debug._ACTIVE and debug.intercepts():  # iabn.debug.poison_overwritten
        return debug.poisoned_call(
            lambda copy: InPlaceABNSyncFunction.apply(
                copy, weight, bias, running_mean, running_var, config, synced_group
            ),
            input, "iabn.distributed.inplace_abn_sync",
        )
    return InPlaceABNSyncFunction.apply(
        overwritable(input), weight, bias, running_mean, running_var, config, synced_group
    )


__all__ = ["InPlaceABNSyncFunction", "check_across_ranks", "inplace_abn_sync", "resolve_group"]
