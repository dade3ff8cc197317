"""In-Place ABN with batch statistics synchronised over ``torch.distributed`` (docs/design.md,
"Synchronised layers").

Per layer and training step there are exactly two collectives:

- forward: one ``all_gather`` of each rank's ``(count, mean, var)`` (float64), merged with
  Chan's formula, so ranks with different batch sizes — even zero — are exact;
- backward: one ``all_reduce`` (sum) of the stacked ``(sum(dy * xhat), sum(dy))``.

Parameter gradients stay each rank's local sums; ``DistributedDataParallel`` averages them
across ranks, as with ``nn.SyncBatchNorm``. Eval mode communicates nothing. The process group
is looked up when the layer runs, never at import or construction, so a layer built before
``init_process_group`` synchronises once the group exists.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import debug
from .checks import check_inputs, check_options
from .functional import _check_argument_order, _inplace_abn_unchecked
from .kernels import reference
from .kernels import sync_reference as sync
from .kernels.dispatch import sync_backend_for
from .modules import ABN, InPlaceABN
from .ops import LayerConfig, overwritable, refuse_double_backward
from .scale import SIGNED

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
    """Autograd of the synchronised layer: saves ``z`` only, like the single-process one."""

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
        moments = sync.local_moments(x)
        gathered = [torch.empty_like(moments) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, moments, group=group)
        total, mean, var = sync.merge_moments(torch.stack(gathered))
        if total < 2:
            raise ValueError(
                f"expected more than 1 value per channel when training, got {total} over all "
                f"ranks: use larger batches or eval mode"
            )
        invstd, scale = sync.normalize_(
            x, weight, bias, mean, var, config.eps, config.activation, config.activation_param,
            config.gamma_mode,
        )
        if running_mean is not None and running_var is not None:
            sync.update_running_stats_(running_mean, running_var, mean, var, total,
                                       config.momentum)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, invstd, scale)
        ctx.config, ctx.group, ctx.total = config, group, total
        return x

    @staticmethod
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor | None, ...]:
        refuse_double_backward("InPlaceABNSync")
        z, weight, bias, invstd, scale = ctx.saved_tensors
        c = ctx.config
        kernels = sync_backend_for(z)
        saved, sums = kernels.local_sums(z, dz, bias, scale, c.activation, c.activation_param)
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
    check_options(activation, activation_param, gamma_mode, in_place=True)
    _check_argument_order("inplace_abn_sync", running_mean, running_var)
    synced_group = _group_to_sync(group, training)
    check_inputs(input, running_mean, running_var, weight, bias, training, in_place=True,
                 synchronised=synced_group is not None)
    if synced_group is None:
        return _inplace_abn_unchecked(
            input, running_mean, running_var, weight, bias, training, momentum, eps,
            activation, activation_param, 2, gamma_mode,
        )
    config = LayerConfig(True, momentum, eps, activation, activation_param, gamma_mode, 2)
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


class InPlaceABNSync(InPlaceABN):
    """:class:`iabn.InPlaceABN` whose training-mode statistics span all ranks of ``group``.

    Same arguments as :class:`iabn.InPlaceABN` (backward variant II) plus ``group``: a
    ``torch.distributed`` process group, ``None`` for the whole world, looked up at every
    training step. Eval mode uses the running statistics (or, without them, this rank's batch)
    and communicates nothing, like ``nn.SyncBatchNorm``. The first synchronised step checks
    once that all ranks agree on channel count, rank and dtype.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        device=None,
        dtype=None,
        *,
        gamma_mode: str = SIGNED,
        group: Any = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, device, dtype, gamma_mode=gamma_mode,
        )
        self.group = group
        self._ranks_checked = False

    def forward(self, input: Tensor) -> Tensor:
        group = _group_to_sync(self.group, self.training)
        if group is None:
            return super().forward(input)
        _, running_mean, running_var = self._normalisation()
        check_inputs(input, running_mean, running_var, self.weight, self.bias, True,
                     in_place=True, num_features=self.num_features, synchronised=True)
        if not self._ranks_checked:
            check_across_ranks(input, group)
            self._ranks_checked = True
        tracking = self.track_running_stats and running_mean is not None
        momentum = self.momentum
        if momentum is None:  # cumulative average over the batches seen, counting this one
            momentum = 1.0 / (float(self.num_batches_tracked) + 1) if tracking else 0.0
        config = LayerConfig(True, momentum, self.eps, self.activation, self.activation_param,
                             self.gamma_mode, 2)
        if debug._ACTIVE and debug.intercepts():  # iabn.debug.poison_overwritten
            out = debug.poisoned_call(
                lambda copy: InPlaceABNSyncFunction.apply(
                    copy, self.weight, self.bias, running_mean, running_var, config, group
                ),
                input, "iabn.InPlaceABNSync",
            )
        else:
            out = InPlaceABNSyncFunction.apply(
                overwritable(input), self.weight, self.bias, running_mean, running_var, config,
                group,
            )
        if tracking:  # counted only once the step succeeded on every rank
            self.num_batches_tracked.add_(1)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.group is None else f", group={self.group}")


class ABNSync(InPlaceABNSync):
    """The synchronised form of :class:`iabn.ABN`: leaves its input untouched (it works on a
    copy), so it may follow a tensor that is needed again. Invertible activations only."""

    def forward(self, input: Tensor) -> Tensor:
        return super().forward(input.clone())


def convert_sync(module: nn.Module, group: Any = None) -> nn.Module:
    """Return ``module`` with every :class:`~iabn.InPlaceABN` replaced by
    :class:`InPlaceABNSync` and every :class:`~iabn.ABN` by :class:`ABNSync`, recursively.

    The new layers reuse the old ones' parameter and buffer tensors (so an optimizer built
    before the conversion keeps working), training mode and device. Call it before wrapping
    the model in ``DistributedDataParallel``.
    """
    return _convert(module, sync=True, group=group)


def convert_local(module: nn.Module) -> nn.Module:
    """The reverse of :func:`convert_sync`, for export and single-device inference."""
    return _convert(module, sync=False, group=None)


def _convert(module: nn.Module, sync: bool, group: Any) -> nn.Module:
    target = _target_class(module, sync)
    result = module
    if target is not None:
        result = _rebuild(module, target, group)
    for name, child in module.named_children():
        result.add_module(name, _convert(child, sync, group))
    return result


def _target_class(module: nn.Module, sync: bool) -> type[ABN] | None:
    if sync:
        if isinstance(module, InPlaceABNSync):
            return None
        if isinstance(module, InPlaceABN):
            return InPlaceABNSync
        if isinstance(module, ABN):
            if module.activation == "relu":
                raise ValueError(
                    "an ABN with activation='relu' has no synchronised form (its backward "
                    "needs an invertible activation): use activation='leaky_relu'"
                )
            return ABNSync
        return None
    if isinstance(module, ABNSync):
        return ABN
    if isinstance(module, InPlaceABNSync):
        return InPlaceABN
    return None


def _rebuild(old: ABN, cls: type[ABN], group: Any) -> ABN:
    kwargs = {"gamma_mode": old.gamma_mode}
    if cls in (InPlaceABNSync, ABNSync):
        kwargs["group"] = group
    new = cls(
        old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats,
        old.activation, old.activation_param, device="meta", **kwargs,
    )
    # Reuse the very tensors: optimizers and DDP hold references to them.
    for name in ("weight", "bias"):
        setattr(new, name, getattr(old, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(new, name, getattr(old, name))
    new.train(old.training)
    return new


def active_ranks_group(active: bool) -> Any:
    """A process group of the ranks that pass ``active=True`` (e.g. those that have data).

    Every rank of the world must call it, with its own flag (``torch.distributed.new_group``
    requires that all ranks call it with the same member list, which the all-gather of the
    flags provides). Inactive ranks get ``GroupMember.NON_GROUP_MEMBER`` back and must not run
    the synchronised layers with it.
    """
    # NCCL only moves CUDA tensors; gloo moves CPU ones.
    device = torch.device("cuda", torch.cuda.current_device()) if (
        dist.get_backend() == "nccl") else torch.device("cpu")
    flag = torch.tensor([1 if active else 0], dtype=torch.int64, device=device)
    flags = [torch.empty_like(flag) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, flag)
    return dist.new_group(ranks=[r for r, f in enumerate(flags) if int(f.item())])


__all__ = [
    "ABNSync",
    "InPlaceABNSync",
    "active_ranks_group",
    "check_across_ranks",
    "convert_local",
    "convert_sync",
    "inplace_abn_sync",
    "resolve_group",
]
