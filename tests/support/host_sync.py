"""A dispatch mode that fails on every ATen call that reads a tensor's values on the host.

On CUDA such a read waits for the device to finish the work queued so far (a host
synchronisation): the host can no longer run ahead, and a CUDA graph cannot capture the step.
On CPU the same calls run without waiting, so the mode finds them where a timing cannot.
"""

from __future__ import annotations

import torch
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Calls that return a Python value computed from tensor data (``item()``, ``float(t)``,
#: ``bool(t)``, ``torch.equal``...) or whose output shape depends on the data (``nonzero``,
#: ``unique``, boolean indexing...), which the host must read before it can go on.
_EXPLICIT = {aten.equal.default, aten.is_nonzero.default, aten.allclose.default}
_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
#: Tagged as dynamic because a boolean index makes them so; integer indices do not read.
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
             aten._unsafe_index_put.default}


class HostSyncError(AssertionError):
    """An ATen call read tensor values on the host."""


def reads_values_on_host(func, args, kwargs) -> bool:
    if func in _INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices)
    return func in _EXPLICIT or any(tag in func.tags for tag in _TAGS)


class NoHostSync(TorchDispatchMode):
    """Raise :class:`HostSyncError` on every call that reads tensor values on the host.

    ``ignore_compile_internals``: code compiled by ``torch.compile`` runs inside the mode (the
    compiler traces outside it), so what the compiled step calls at run time is checked too;
    higher-order operators of its graphs (e.g. a functionalised custom operator) run through,
    and the ATen calls inside them are checked.
    """

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if reads_values_on_host(func, args, kwargs):
            raise HostSyncError(f"{func} reads tensor values on the host")
        return func(*args, **kwargs)
