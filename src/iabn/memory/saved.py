"""The one saved-tensor hook that counts activation memory (:func:`counting_saves`), and the
figures built on it: the storages and bytes a call keeps for backward, the same per owner
(:func:`attributing_saves`), and the bytes a compiled model keeps (docs/design.md, "Memory
accounting"; what is counted: :mod:`iabn.memory`).

The converter's per-layer figures, the planner's runs and ``iabn bench``'s pixel counts count
with :func:`counting_saves` too, so they key storages, leave out parameters and buffers and keep
counted tensors alive the same way, and agree with :func:`saved_tensor_bytes`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class SavedStorage:
    """One distinct storage kept for backward: the first tensor seen on it, and its size."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


StorageKey = tuple[str, int]


def storage_key(t: Tensor) -> StorageKey:
    # The storage object's address, not its data pointer: every tensor on the ``meta`` device
    # has data pointer 0, and counting at real sizes without memory is what meta is for.
    # (Counted tensors are held alive, so no address is reused while counting.)
    return str(t.device), t.untyped_storage()._cdata


def state_keys(*modules: nn.Module) -> set[StorageKey]:
    """The storage keys of ``modules``' parameters and buffers: what a count of activations
    leaves out (they are the model itself, kept whether or not backward runs)."""
    return {storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}


SavedCallback = Callable[[StorageKey, Tensor, bool], None]


@contextlib.contextmanager
def counting_saves(
    excluded: Collection[StorageKey] = (), on_saved: SavedCallback | None = None
) -> Iterator[dict[StorageKey, int]]:
    """Count what autograd saves for backward inside the block: yields ``{storage key: bytes}``
    of the distinct storages saved (keys by :func:`storage_key`, in first-save order), the
    storages in ``excluded`` (parameters, buffers) left out. ``on_saved(key, tensor, first)``
    is called for each of those saves, ``first`` when its storage is saved for the first time.

    Every counted tensor is held until the block ends, so no storage is freed and its address
    reused for another while counting (the new one would pass for the one already seen).
    Autograd gets a detached alias back, not the tensor: a node that saves its own output would
    otherwise hold, through the packed value, the tensor that holds the node, a cycle through
    C++ that no garbage collection frees (the alias shares storage and version counter, not
    grad_fn)."""
    sizes: dict[StorageKey, int] = {}
    held: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        key = storage_key(t)
        if key not in excluded:
            first = key not in sizes
            if first:
                sizes[key] = t.untyped_storage().nbytes()
                held.append(t)
            if on_saved is not None:
                on_saved(key, t, first)
        return t.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield sizes
    finally:
        held.clear()


@dataclass
class AttributedSaves:
    """What :func:`attributing_saves` counted, by owner (what ``owner()`` returned at the save:
    a graph node's name, say)."""

    #: owner -> bytes of the storages it was the first to save (their sum is the block's total)
    first_bytes: dict[Hashable, int] = field(default_factory=dict)
    #: storage key -> every owner that saved (part of) that storage
    savers: dict[StorageKey, set[Hashable]] = field(default_factory=dict)
    #: storage key -> its bytes
    sizes: dict[StorageKey, int] = field(default_factory=dict)

    def alone_bytes(self) -> dict[Hashable, int]:
        """Owner -> bytes of the storages it alone saved: what it keeps that nothing else
        keeps (the figure of a layer whose output the next layer saves anyway)."""
        alone: dict[Hashable, int] = {}
        for key, owners in self.savers.items():
            if len(owners) == 1:
                (owner,) = owners
                alone[owner] = alone.get(owner, 0) + self.sizes[key]
        return alone


@contextlib.contextmanager
def attributing_saves(
    owner: Callable[[], Hashable], excluded: Collection[StorageKey] = ()
) -> Iterator[AttributedSaves]:
    """:func:`counting_saves` with each save attributed to ``owner()``, called as the save
    happens (the code running then: a node of an ``fx.Interpreter``). A storage's bytes go to
    its first saver, so the owners' bytes add up to the block's count, and every saver is
    listed, to tell who else keeps a storage alive."""
    saves = AttributedSaves()

    def attribute(key: StorageKey, t: Tensor, first: bool) -> None:
        current = owner()
        saves.savers.setdefault(key, set()).add(current)
        if first:
            saves.sizes[key] = t.untyped_storage().nbytes()
            saves.first_bytes[current] = saves.first_bytes.get(current, 0) + saves.sizes[key]

    with counting_saves(excluded, attribute):
        yield saves


def saved_storages(
    fn: Callable[..., Any], *args: Any, exclude: Iterable[Tensor] = (), **kwargs: Any
) -> list[SavedStorage]:
    """Run ``fn(*args, **kwargs)`` and list the distinct storages autograd saves for backward.

    Storages of ``exclude`` are not listed; when ``fn`` is an ``nn.Module`` its parameters and
    buffers are excluded too (they are not activations).
    """
    excluded = {storage_key(t) for t in exclude}
    if isinstance(fn, nn.Module):
        excluded |= state_keys(fn)
    storages: list[SavedStorage] = []

    def describe(key: StorageKey, t: Tensor, first: bool) -> None:
        if first:
            storages.append(SavedStorage(tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))

    with counting_saves(excluded, describe):
        result = fn(*args, **kwargs)
        del result
    return storages


def saved_tensor_bytes(
    fn: Callable[..., Any], *args: Any, exclude: Iterable[Tensor] = (), **kwargs: Any
) -> int:
    """Bytes of activation memory ``fn(*args, **kwargs)`` keeps for backward (see the doc of
    ``iabn.memory``)."""
    return sum(s.nbytes for s in saved_storages(fn, *args, exclude=exclude, **kwargs))


def compiled_saved_bytes(
    model: nn.Module, *args: Tensor, activation_memory_budget: float = 1.0
) -> int:
    """Bytes of activations ``torch.compile(model)`` keeps for backward, parameters and buffers
    excluded: the values AOTAutograd's min-cut partitioner (PyTorch's default for training
    graphs) passes from the forward graph to the backward graph, under
    ``torch._functorch.config.activation_memory_budget`` (1.0: save whatever is fastest; lower
    values make it recompute instead of save).

    Saved-tensor hooks do not see inside compiled graphs, so this reads the graphs themselves:
    the model is compiled with a recording backend (AOTAutograd with pass-through compilers),
    run forward once on ``args`` and differentiated with ``torch.autograd.grad`` (no ``.grad``
    is written; running statistics are updated, as by :func:`saved_tensor_bytes`). Each saved
    value counts by its own size. This resets ``torch.compile``'s caches.
    """
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if not 0.0 <= activation_memory_budget <= 1.0:
        raise ValueError(
            f"activation_memory_budget={activation_memory_budget} must be in [0, 1] "
            f"(1.0 is torch.compile's default)"
        )
    graphs: dict[str, Any] = {}

    def keep(name: str):
        def compiler(gm: torch.fx.GraphModule, _example_inputs: Any):
            graphs[name] = gm
            return make_boxed_func(gm.forward)
        return compiler

    # Running-statistics updates stay inside the graph; replayed outside it, they would bump
    # the version of buffers the partitioner chose to save, and backward would refuse them.
    aot = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                       partition_fn=min_cut_rematerialization_partition,
                       keep_inference_input_mutations=True)

    def backend(gm: torch.fx.GraphModule, example_inputs: Any):
        # Dynamo's graph inputs, in the order of AOTAutograd's primals_1, primals_2, ...
        graphs["inputs"] = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        return aot(gm, example_inputs)

    torch._dynamo.reset()
    try:
        with functorch_config.patch(activation_memory_budget=activation_memory_budget):
            out = torch.compile(model, backend=backend, fullgraph=True)(*args)
            wrt = [t for t in (*args, *model.parameters()) if t.requires_grad]
            torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
    finally:
        torch._dynamo.reset()
    state = {f"primals_{i + 1}" for i, name in enumerate(graphs["inputs"])
             if "_parameters_" in name or "_buffers_" in name}
    total = 0
    for node in graphs["backward"].graph.nodes:
        if node.op != "placeholder" or node.name.startswith("tangents") or node.name in state:
            continue
        value = node.meta.get("val")
        if isinstance(value, Tensor):
            total += value.numel() * value.element_size()
    return total


__all__ = ["AttributedSaves", "SavedCallback", "SavedStorage", "StorageKey", "attributing_saves",
           "compiled_saved_bytes", "counting_saves", "saved_storages", "saved_tensor_bytes",
           "state_keys"]
