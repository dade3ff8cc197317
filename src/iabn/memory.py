"""Activation-memory accounting (DESIGN §3).

"Activation memory" is the bytes of the distinct storages that autograd keeps for backward.
It is counted with ``torch.autograd.graph.saved_tensors_hooks`` while the forward runs and
de-duplicated by storage, so a tensor saved by two consecutive layers (InPlace-ABN's output and
the next convolution's input) counts once. The figure is exact and the same on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class SavedStorage:
    """One distinct storage kept for backward: the first tensor seen on it, and its size."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def _storage_key(t: Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def saved_storages(
    fn: Callable[..., Any], *args: Any, exclude: Iterable[Tensor] = (), **kwargs: Any
) -> list[SavedStorage]:
    """Run ``fn(*args, **kwargs)`` and list the distinct storages autograd saves for backward.

    Storages of ``exclude`` are not listed; when ``fn`` is an ``nn.Module`` its parameters and
    buffers are excluded too (they are not activations). The result of ``fn`` is kept alive
    until counting ends, so no storage is freed and reused while it is being counted.
    """
    excluded = {_storage_key(t) for t in exclude}
    if isinstance(fn, nn.Module):
        excluded.update(_storage_key(t) for t in (*fn.parameters(), *fn.buffers()))
    seen: dict[tuple[str, int], SavedStorage] = {}
    kept: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key not in excluded and key not in seen:
            seen[key] = SavedStorage(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
            kept.append(t)
        # Not t itself: a node that saves its own output would then hold, through the packed
        # value, the tensor that holds the node — a cycle through C++ that no garbage
        # collection frees. A detached alias shares storage and version counter, not grad_fn.
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args, **kwargs)
    storages = list(seen.values())
    del result
    kept.clear()
    return storages


def saved_tensor_bytes(
    fn: Callable[..., Any], *args: Any, exclude: Iterable[Tensor] = (), **kwargs: Any
) -> int:
    """Bytes of activation memory ``fn(*args, **kwargs)`` keeps for backward (see module doc)."""
    return sum(s.nbytes for s in saved_storages(fn, *args, exclude=exclude, **kwargs))


__all__ = ["SavedStorage", "saved_storages", "saved_tensor_bytes"]
