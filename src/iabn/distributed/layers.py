"""The synchronised layers (``InPlaceABNSync``, ``ABNSync``) and the converters between them
and the local layers (docs/design.md, "Synchronised layers"). The computation and its
collectives are in :mod:`.function`.

Parameter gradients stay each rank's local sums; ``DistributedDataParallel`` averages them
across ranks, as with ``nn.SyncBatchNorm``. Eval mode communicates nothing. The process group
is looked up when the layer runs, never at import or construction, so a layer built before
``init_process_group`` synchronises once the group exists.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..kernels.common import SIGNED, LayerConfig
from ..layers.batch_norm import ABN, InPlaceABN
from ..layers.checks import check_inputs
from ..layers.options import check_options
from ..layers.rebuild import rebuilt_as
from .function import check_across_ranks, synchronised_call
from .groups import group_to_sync


class _Synchronised:
    """What :class:`InPlaceABNSync` and :class:`ABNSync` share: in training with a multi-rank
    group, :meth:`_synchronised_step` on the input (:class:`InPlaceABNSync` with
    ``overwrite_input=True``) or on a copy of it; otherwise the local layer's own ``forward``."""

    group: Any

    def forward(self, input: Tensor) -> Tensor:
        group = group_to_sync(self.group, self.training)
        if group is None:
            return super().forward(input)
        # the synchronised step overwrites what it is given: a copy unless in place
        return self._synchronised_step(input if self._in_place else input.clone(), group)

    def _synchronised_step(self: Any, input: Tensor, group: Any) -> Tensor:
        """One training step with statistics over ``group``: overwrites ``input`` and returns
        it. The batch is counted in ``num_batches_tracked`` once the step has succeeded on
        every rank, as the local layer counts it."""
        _, running_mean, running_var = self._normalisation()
        check_inputs(input, running_mean, running_var, self.weight, self.bias, True,
                     in_place=True, num_features=self.num_features, synchronised=True)
        if not self._ranks_checked:
            check_across_ranks(input, group)
            self._ranks_checked = True
        tracking = self.track_running_stats and running_mean is not None
        momentum = self._running_factor(self.num_batches_tracked) if tracking else 0.0
        config = LayerConfig(True, momentum, self.eps, self.activation, self.activation_param,
                             self.gamma_mode)
        # ABNSync hands in its own copy, which nobody else can read: nothing to poison there.
        out = synchronised_call(input, self.weight, self.bias, running_mean, running_var, config,
                                group, "iabn.InPlaceABNSync", poison=self._in_place)
        if tracking:  # counted only once the step succeeded on every rank
            self.num_batches_tracked.add_(1)
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.group is None else f", group={self.group}")


class InPlaceABNSync(_Synchronised, InPlaceABN):
    """:class:`iabn.InPlaceABN` whose training-mode statistics span all ranks of ``group``.

    Same arguments as :class:`iabn.InPlaceABN` (backward variant II; ``overwrite_input``
    included) plus ``group``: a
    ``torch.distributed`` process group, ``None`` for the whole world, looked up at every
    training step. Eval mode uses the running statistics (or, without them, this rank's batch)
    and communicates nothing, like ``nn.SyncBatchNorm``. The first synchronised step checks
    once that all ranks agree on channel count, rank and dtype. ``silu`` and ``gelu`` keep one
    branch bit per element, as in :class:`iabn.InPlaceABN`.
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
        overwrite_input: bool = True,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, device, dtype, gamma_mode=gamma_mode,
            overwrite_input=overwrite_input, bias=bias,
        )
        self.group = group
        self._ranks_checked = False


class ABNSync(_Synchronised, ABN):
    """:class:`iabn.ABN` whose training-mode statistics span all ranks of ``group``: it leaves
    its input untouched, so it may follow a tensor that is needed again.

    Same arguments as :class:`InPlaceABNSync`. Not ``relu``: the synchronised step runs the
    in-place computation on a copy of the input, whose backward inverts the activation (so
    it also keeps ``|scale| >= eps``; ``silu`` and ``gelu`` with their branch bits). Without a
    multi-rank process group, and in eval mode, it is :class:`iabn.ABN` exactly.
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
        bias: bool = True,
    ) -> None:
        if activation == "relu":
            raise ValueError(
                "activation='relu': ABNSync's synchronised backward recovers its input by "
                "inverting the activation, and relu is not invertible; use "
                "activation='leaky_relu' (e.g. activation_param=0.01)"
            )
        check_options(activation, activation_param, gamma_mode, in_place=True, eps=eps,
                      momentum=momentum, branch=True)
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, device, dtype, gamma_mode=gamma_mode, bias=bias,
        )
        self.group = group
        self._ranks_checked = False

    # the synchronised step inverts the activation, as the in-place layer's backward does
    # (silu and gelu with their branch bits)
    _needs_inverse = True
    _branch_bit = True


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
        if isinstance(module, (InPlaceABNSync, ABNSync)):
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
    return rebuilt_as(old, cls, old.activation, old.activation_param, **kwargs)


__all__ = [
    "ABNSync",
    "InPlaceABNSync",
    "convert_local",
    "convert_sync",
]
