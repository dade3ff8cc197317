"""Move activations saved for backward to host memory, and bring them back just in time.

The CPU-offloading idea (``papers/cpu_offloading_paper.txt``) done with saved-tensor hooks:

- **what goes**: with :class:`OffloadModel`, the inputs of convolution and pooling layers (the
  big activations backward needs; BN inputs need not travel, InPlace-ABN recovers them by
  inversion). With the bare :func:`offload` context, every saved activation. A ``predicate``
  and ``min_bytes`` narrow the choice; parameters (leaves that require grad) never go, and
  :class:`OffloadModel` also keeps the model's buffers.
- **where to**: host buffers from a pool, allocated in the first iteration (pinned on CUDA) and
  reused by every later one; the pool grows, with a warning, when shapes change. A buffer
  still referenced by a graph that has not run backward yet is never reused.
- **how**: on CUDA, copies run on a dedicated stream; the copy waits for the producer (an
  event on the compute stream) and the allocator is told the tensor is in use on the copy
  stream (``record_stream``), so device memory is released only after the copy finished. In
  backward, unpacking one tensor prefetches the next ``prefetch`` ones (in backward order) on
  the copy stream, and the compute stream waits for a tensor's copy before using it. On a
  machine without CUDA the same code path runs with plain host copies (no streams), which is
  how CI tests the logic.
- **compression** (off by default): ``compress=torch.bfloat16`` or ``torch.float16`` stores
  floating activations at that precision on the host (half the traffic and host memory) and
  restores their dtype on the way back — gradients then differ at that precision's rounding.
  Without compression gradients are bit-identical to training without offloading.
- a tensor saved twice (e.g. InPlace-ABN's output, which the next convolution saves too, or a
  skip connection) is transferred once.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..kernels.common import is_dense_format

Predicate = Callable[[Tensor], bool]

#: Module types whose inputs :class:`OffloadModel` offloads by default.
DEFAULT_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Conv1d, nn.Conv2d, nn.Conv3d,
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
)


def _storage_key(t: Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


@dataclass
class OffloadStats:
    """What the last iteration (one forward) kept on the device and sent to the host, in
    bytes of distinct storages."""

    offloaded_bytes: int = 0
    kept_bytes: int = 0
    transferred_bytes: int = 0  # host bytes written (less than offloaded with compression)
    host_allocations: int = 0   # pool buffers allocated during the iteration


class _HostPool:
    """Host buffers reused from iteration to iteration; slot ``k`` serves the k-th offload."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.buffers: list[Tensor] = []
        self.owners: list[weakref.ref] = []
        self.next_slot = 0
        self.iterations = 0

    def start_iteration(self) -> None:
        self.next_slot = 0
        self.iterations += 1

    def take(self, nbytes: int, owner: Any, stats: OffloadStats) -> Tensor:
        """A uint8 host tensor of ``nbytes`` bytes for ``owner`` (kept until it dies)."""
        slot = self.next_slot
        self.next_slot += 1
        if slot < len(self.buffers):
            free = self.owners[slot]() is None
            if free and self.buffers[slot].numel() >= nbytes:
                self.owners[slot] = weakref.ref(owner)
                return self.buffers[slot][:nbytes]
            if self.iterations > 1:
                reason = ("is still held by a graph that has not run backward"
                          if not free else "is smaller than this iteration needs")
                warnings.warn(
                    f"offload pool: buffer {slot} {reason}; allocating a new "
                    f"{nbytes / 2**20:.1f} MiB host buffer (shapes changed, or several "
                    f"forwards before one backward)", stacklevel=4,
                )
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        stats.host_allocations += 1
        if slot < len(self.buffers):
            self.buffers[slot], self.owners[slot] = buffer, weakref.ref(owner)
        else:
            self.buffers.append(buffer)
            self.owners.append(weakref.ref(owner))
        return buffer


class _Saved:
    """What autograd holds for one saved tensor: the tensor itself, or its host copy."""

    __slots__ = ("index", "is_parameter", "nbytes", "offloaded", "source", "tensor", "view")

    def __init__(self, tensor: Tensor, view: tuple) -> None:
        # A detached alias, not the tensor: holding a node's own saved output would make a
        # reference cycle through the autograd graph that garbage collection cannot free.
        self.tensor: Tensor | None = tensor.detach()
        self.is_parameter = tensor.is_leaf and tensor.requires_grad
        # Whether the saved tensor still exists: while it does, its storage cannot have been
        # freed, so another tensor at the same address is a view of the same data.
        self.source = weakref.ref(tensor)
        self.view = view
        self.nbytes = tensor.untyped_storage().nbytes()
        self.offloaded: _Offloaded | None = None
        self.index = -1

    @property
    def alive(self) -> bool:
        return self.tensor is not None or self.source() is not None


class _Offloaded:
    """One activation on the host; fetches itself back to its device once, on demand.

    Autograd's saved-variable slots own it: when the last node that saved it has run backward
    (or its graph is freed) it dies, and with it the device copy and its claim on the pool
    buffer.
    """

    def __init__(self, like: Tensor, offloader: Offloader) -> None:
        self.dtype, self.device = like.dtype, like.device
        self.offloader = offloader
        self.host: Tensor | None = None
        self.on_device: Tensor | None = None
        self.ready: Any = None  # CUDA event marking the end of the fetch

    def fetch(self) -> None:
        """Start copying back to the device (no-op when already fetched)."""
        if self.on_device is not None:
            return
        host, stream = self.host, self.offloader.copy_stream
        on_copy_stream = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with on_copy_stream:
            restored = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype,
                                           device=self.device)
            restored.copy_(host, non_blocking=stream is not None)
            self.on_device = restored.to(self.dtype)
            if stream is not None:
                self.ready = torch.cuda.Event()
                self.ready.record(stream)

    def get(self) -> Tensor:
        self.fetch()
        if self.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self.ready)
            # the compute stream now uses memory allocated on the copy stream
            self.on_device.record_stream(compute)
            self.ready = None
        return self.on_device


class Offloader:
    """Saved-tensor hooks that offload activations (see the module doc). Use it through
    :func:`offload` or :class:`OffloadModel`; it keeps its host pool between iterations.

    Args:
        predicate: ``predicate(tensor) -> bool`` chooses which saved tensors go (after the
            built-in rules); default: all.
        min_bytes: smaller tensors stay (default 64 KiB: per-channel vectors and the like).
        compress: ``None`` (default), ``torch.float16`` or ``torch.bfloat16``.
        prefetch: how many further offloaded tensors to start fetching when backward needs
            one (default 1; 0 fetches each on demand).
        pin_memory: page-locked host buffers (default: when CUDA is available).
    """

    def __init__(
        self, predicate: Predicate | None = None, min_bytes: int = 64 * 1024,
        compress: torch.dtype | None = None, prefetch: int = 1,
        pin_memory: bool | None = None,
    ) -> None:
        if compress not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"compress={compress!r}: use None, torch.float16 or torch.bfloat16"
            )
        if prefetch < 0:
            raise ValueError(f"prefetch={prefetch}: must be >= 0 (0 fetches on demand)")
        self.predicate = predicate
        self.min_bytes = min_bytes
        self.compress = compress
        self.prefetch = prefetch
        cuda = torch.cuda.is_available()
        self.pool = _HostPool(cuda if pin_memory is None else pin_memory)
        self.copy_stream = torch.cuda.Stream() if cuda else None
        self.keep: set[tuple[str, int]] = set()  # storages that must stay (e.g. buffers)
        self.stats = OffloadStats()
        # weak: a fetched activation must die with its last user, not with the iteration
        self._order: list[weakref.ref[_Offloaded]] = []
        self._seen: dict[tuple[str, int], list[_Saved]] = {}
        self._retired: list[list[_Saved]] = []

    @contextmanager
    def hooks(self) -> Iterator[Offloader]:
        """Install the hooks for one forward pass (one iteration)."""
        self.pool.start_iteration()
        self.stats = OffloadStats()
        self._order, self._seen, self._retired = [], {}, []
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._count_storages()
            self._seen, self._retired = {}, []  # drop this iteration's device tensors

    def _eligible(self, t: Tensor, is_parameter: bool) -> bool:
        if is_parameter:  # a leaf that requires grad: never offloaded
            return False
        if t.untyped_storage().nbytes() < self.min_bytes or _storage_key(t) in self.keep:
            return False
        if t.device.type == "cpu" and self.copy_stream is not None:
            return False  # already in host memory
        return self.predicate is None or bool(self.predicate(t))

    def _same_storage(self, t: Tensor) -> list[_Saved]:
        """The saves of ``t``'s storage this iteration, if that storage is still the same one.

        An offloaded tensor's device memory is freed as soon as the forward drops it, and the
        next tensor of that size often gets the same address: a storage key whose saved
        tensors are all gone belongs to a new tensor, and the old saves are retired.
        """
        key = _storage_key(t)
        saves = self._seen.get(key)
        if saves and not any(saved.alive for saved in saves):
            self._retired.append(saves)
            saves = self._seen[key] = []
        return self._seen.setdefault(key, [])

    def _pack(self, t: Tensor) -> _Saved:
        view = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)
        saves = self._same_storage(t)
        for saved in saves:
            if saved.view == view:  # saved before in this iteration: transfer it once
                return saved
        saved = _Saved(t, view)
        saves.append(saved)
        if self._eligible(t, saved.is_parameter):
            self._offload(saved)
        return saved

    def promote(self, t: Tensor) -> None:
        """Offload the already saved tensors on ``t``'s storage that are now eligible.

        :class:`OffloadModel` learns that a tensor is a convolution's input only when that
        convolution starts, after the layer that produced it may already have saved it.
        """
        for saved in self._same_storage(t):
            if saved.tensor is not None and self._eligible(saved.tensor, saved.is_parameter):
                self._offload(saved)

    def _offload(self, saved: _Saved) -> None:
        handle = self._copy_to_host(saved.tensor)
        self._order.append(weakref.ref(handle))
        saved.offloaded, saved.index, saved.tensor = handle, len(self._order) - 1, None

    def _count_storages(self) -> None:
        """A storage counts as offloaded when every view saved of it went to the host.
        Parameters and kept buffers are not activations and are not counted at all."""
        groups = [(key, views) for key, views in self._seen.items() if views]
        groups += [(None, views) for views in self._retired]
        for key, views in groups:
            first = views[0]
            if key in self.keep or first.is_parameter:
                continue
            if all(v.offloaded is not None for v in views):
                self.stats.offloaded_bytes += first.nbytes
            else:
                self.stats.kept_bytes += first.nbytes

    def _copy_to_host(self, t: Tensor) -> _Offloaded:
        source = t
        if self.compress is not None and t.is_floating_point() and t.element_size() > 2:
            source = t.to(self.compress)
        dense = source if is_dense_format(source) else source.contiguous()
        nbytes = dense.numel() * dense.element_size()
        handle = _Offloaded(t, self)
        raw = self.pool.take(nbytes, handle, self.stats)
        # the host copy keeps the (dense) layout: contiguous or channels-last
        host = raw.view(dense.dtype).as_strided(dense.shape, dense.stride())
        if self.copy_stream is None:
            host.copy_(dense)
        else:
            self.copy_stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.copy_stream):
                host.copy_(dense, non_blocking=True)
            # the caching allocator must not reuse t's memory before the copy has read it
            dense.record_stream(self.copy_stream)
        handle.host = host
        self.stats.transferred_bytes += nbytes
        return handle

    def _unpack(self, saved: _Saved) -> Tensor:
        if saved.offloaded is None:
            return saved.tensor
        tensor = saved.offloaded.get()
        # Backward runs in reverse order of forward: start fetching the next ones now.
        for ahead in range(saved.index - 1, max(saved.index - 1 - self.prefetch, -1), -1):
            upcoming = self._order[ahead]()
            if upcoming is not None:
                upcoming.fetch()
        return tensor


@contextmanager
def offload(
    predicate: Predicate | None = None, min_bytes: int = 64 * 1024,
    compress: torch.dtype | None = None, prefetch: int = 1, pin_memory: bool | None = None,
    offloader: Offloader | None = None,
) -> Iterator[Offloader]:
    """Offload the activations saved during the ``with`` block (one forward pass).

    Pass the same ``offloader`` (as yielded) to later iterations to reuse its host buffers::

        off = Offloader()
        for x, y in data:
            with offload(offloader=off):
                loss = loss_fn(model(x), y)
            loss.backward()
    """
    off = offloader or Offloader(predicate, min_bytes, compress, prefetch, pin_memory)
    with off.hooks():
        yield off


class OffloadModel(nn.Module):
    """Wraps ``model`` so that each forward offloads the inputs of its convolution and pooling
    layers to host memory. ``layers`` is a tuple of module types (default
    :data:`DEFAULT_LAYERS`) or ``select(name, module) -> bool`` to pick layers by name (e.g.
    only the first stages); ``predicate``/``min_bytes`` narrow the choice further.

    The host pool lives in ``self.offloader`` and is reused by every forward.
    """

    def __init__(
        self, model: nn.Module,
        layers: tuple[type[nn.Module], ...] | Callable[[str, nn.Module], bool] = DEFAULT_LAYERS,
        predicate: Predicate | None = None, min_bytes: int = 64 * 1024,
        compress: torch.dtype | None = None, prefetch: int = 1, pin_memory: bool | None = None,
    ) -> None:
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            # Its layers' hooks would be ignored by code compiled before they were added
            # (torch does not guard on module hooks): nothing would be offloaded, silently.
            raise TypeError(
                "OffloadModel(model): model is torch.compile'd; wrap the eager model (layers "
                "inside it may be compiled), or call the compiled model inside iabn.offload(), "
                "which offloads what the compiled graph saves"
            )
        super().__init__()
        self.model = model
        # This forward's conv/pool inputs: storage key -> weak reference to the input. A key
        # whose input is dead names freed memory that a later tensor (a BN input, say) may
        # have been given: only a live input makes its storage a target. The predicate
        # closes over the dict, not over the wrapper, so no reference cycle keeps it alive.
        targets: dict[tuple[str, int], weakref.ref[Tensor]] = {}
        self._targets = targets
        user_predicate = predicate

        def chosen(t: Tensor) -> bool:
            marked = targets.get(_storage_key(t))
            if marked is None or marked() is None:
                return False
            return user_predicate is None or bool(user_predicate(t))

        self.offloader = Offloader(chosen, min_bytes, compress, prefetch, pin_memory)
        # The hooks reach the wrapper through a weak reference: the model must not keep a
        # dead wrapper (and its host pool) alive through a reference cycle.
        wrapper = weakref.ref(self)

        # Outside the compiler: in a compiled layer the hook runs eagerly (a graph break
        # per marked layer) and sees the real input tensor.
        @torch._dynamo.disable
        def mark(module: nn.Module, args: tuple[Any, ...]) -> None:
            alive = wrapper()
            if alive is not None:
                alive._mark_input(module, args)

        self._hook_handles = [
            module.register_forward_pre_hook(mark)
            for name, module in model.named_modules()
            if (layers(name, module) if callable(layers) else isinstance(module, layers))
        ]

    def _mark_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], Tensor):
            self._targets[_storage_key(args[0])] = weakref.ref(args[0])
            self.offloader.promote(args[0])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._targets.clear()
        self.offloader.keep = {_storage_key(t) for t in (*self.model.parameters(),
                                                         *self.model.buffers())}
        with self.offloader.hooks():
            return self.model(*args, **kwargs)

    @property
    def stats(self) -> OffloadStats:
        return self.offloader.stats

    def remove_hooks(self) -> None:
        """Detach from the wrapped model (its layers stop being marked for offloading)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def __del__(self) -> None:
        if "_hook_handles" in self.__dict__:  # not when __init__ refused its arguments
            self.remove_hooks()


__all__ = ["DEFAULT_LAYERS", "OffloadModel", "OffloadStats", "Offloader", "offload"]
