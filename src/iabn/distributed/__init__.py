"""Synchronised In-Place ABN: batch statistics over the ranks of a ``torch.distributed``
process group, in one package (docs/design.md, "Synchronised layers").

- :mod:`.groups`: which ranks a step normalises over; :func:`active_group`, the group of the
  ranks that have data;
- :mod:`.moments`: each rank's moments, their merge over the ranks, the running update (math,
  no communication);
- :mod:`.function`: the autograd ``Function`` with the layer's two collectives, and the
  functional :func:`inplace_abn_sync`;
- :mod:`.layers`: the modules :class:`InPlaceABNSync`, :class:`ABNSync` and the converters
  :func:`convert_sync`, :func:`convert_local`.

Parameter gradients stay each rank's local sums; ``DistributedDataParallel`` averages them
across ranks, as with ``nn.SyncBatchNorm``. Eval mode communicates nothing.
"""

from .function import InPlaceABNSyncFunction, check_across_ranks, inplace_abn_sync
from .groups import active_group, resolve_group
from .layers import ABNSync, InPlaceABNSync, convert_local, convert_sync

__all__ = [
    "ABNSync",
    "InPlaceABNSync",
    "InPlaceABNSyncFunction",
    "active_group",
    "check_across_ranks",
    "convert_local",
    "convert_sync",
    "inplace_abn_sync",
    "resolve_group",
]
