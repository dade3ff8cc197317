"""Launches and memory traffic of one forward and backward of a layer, counted exactly on CPU.

A batch-norm layer on a GPU is memory-bound: its time is the bytes its kernels move over the
device's bandwidth plus the host time of its launches. Both are properties of the operators
a step calls, not of the device, so they are counted here on any device (the CPU included):

**Launches.** ATen operators are seen through a ``TorchDispatchMode``; each operator that
computes is one launch (a host dispatch; on CUDA an operator such as ``native_batch_norm``
issues two or three kernels from C++, counted as one). Operators that compute nothing are not
launches: views (``OpOverload.is_view``: ``view``, ``as_strided``, ``detach``, ...),
allocations (``empty``, ``empty_like``, ``empty_strided``, ``new_empty``,
``new_empty_strided``) and metadata changes (``set_``, ``resize_``, ``lift_fresh``,
``_unsafe_view``). Every other operator counts, per-channel ones included (``abs`` of a
``(C,)`` weight is a kernel on a GPU too). Triton kernels are seen by wrapping each kernel's
``run`` (its launch) while a counter is active; each launch is one, and the ATen operators
Triton's CPU interpreter runs inside a launch to emulate it are not counted. The CPU loops
compiled by Numba (:mod:`iabn.kernels.cpu_loops`) report each loop they run, one launch that
reads and writes the tensors it names.

**Bytes.** Only *full-size* tensors count: those with as many elements as the activation
(``numel``). Per-channel tensors (``(C,)`` statistics, partial sums of ``(P, C)``) are
ignored: at the benchmark's shape (64 channels) they are under 0.2 % of the traffic. A read
or a write of a full-size tensor moves its bytes (``numel * element_size``); a tensor passed
twice to one operator is counted once. Caches are not modelled: a second pass over a tensor
counts again. (At shapes where a per-channel tensor has ``numel`` elements too, ``N * H * W
== 1``, it would count as full-size: the counts are meant for layer-sized activations.)

* An ATen operator reads each full-size tensor argument once and writes each full-size result
  once. An argument it writes (schema ``Tensor(a!)``) is written once; it is also read when
  the operator works in place (``leaky_relu_``), not when it is an ``out=`` argument or the
  destination of ``copy_``, ``fill_`` or ``zero_``.
* ATen's batch-norm operators make more than one pass, counted as their CUDA kernels make
  them (aten/src/ATen/native/cuda/Normalization.cu; the CPU kernels make as many or more):
  ``native_batch_norm`` in training reads its input twice (statistics, then normalise);
  ``native_batch_norm_backward`` reads ``grad_out`` and ``input`` once for its reduction
  (in training, or when a weight or bias gradient is wanted) and again for the input gradient,
  which in eval mode reads ``grad_out`` only. Any other operator whose name contains
  ``batch_norm`` is refused rather than guessed.
* A Triton kernel reads and writes the pointer arguments declared next to it
  (:data:`iabn.kernels.triton_kernels.TRAFFIC`, by argument name); each full-size one is read
  (loaded from) or written (stored to) once per launch. A full-size argument it does not
  declare is an error.

**Memory.** Every full-size tensor an operator allocates (a result on a storage that none of
its arguments has) is recorded with its dtype, and the bytes of those still alive are tracked
(a storage's bytes are released when it is freed): :attr:`TrafficCounter.peak_bytes` is the
most that was alive at once among those allocated inside the counter.
:attr:`TrafficCounter.peak_all_bytes` is the same over every tensor allocated, of any size (a
backward that works on slices of the activation, ``kernels/reference.pieces``, allocates no
full-size tensor but its slices still take memory). Allocations inside ATen
kernels (a CPU kernel's private buffers) are not seen.

:func:`count_step` counts ``layer(leaf.clone()).backward(grad)`` with one counter for the
forward and one for the backward (the clone is made outside both). It first frees the
reference backward's CPU scratch buffers (``kernels/scratch.py``), so that its temporaries are
allocated inside the counted backward as on a GPU, which does not keep them.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels import cpu_loops

_aten = torch.ops.aten

#: ATen operators that launch nothing besides views: allocations and metadata changes.
NO_LAUNCH = frozenset({
    _aten.empty, _aten.empty_like, _aten.empty_strided, _aten.new_empty,
    _aten.new_empty_strided, _aten.set_, _aten.resize_, _aten.lift_fresh, _aten._unsafe_view,
})
#: In-place operators that overwrite their ``self`` without reading it.
WRITE_ONLY_SELF = frozenset({_aten.copy_, _aten.fill_, _aten.zero_})


@dataclass(frozen=True)
class Launch:
    """One launch: its name (``aten.leaky_relu_`` or ``triton.normalize_act_kernel``) and the
    bytes of full-size tensors it reads and writes."""

    name: str
    read: int
    written: int


@dataclass(frozen=True)
class Allocation:
    """A full-size tensor allocated by an operator: the operator, its dtype and bytes."""

    op: str
    dtype: torch.dtype
    nbytes: int


@dataclass(eq=False)
class TrafficCounter(TorchDispatchMode):
    """Counts launches, full-size bytes and full-size allocations while active (``with``).

    ``numel`` is the activation's number of elements: the size that makes a tensor full-size.
    (Compared by identity: two counters with the same figures are still two counters.)
    """

    numel: int
    launches: list[Launch] = field(default_factory=list)
    allocations: list[Allocation] = field(default_factory=list)
    live_bytes: int = 0
    peak_bytes: int = 0
    live_all_bytes: int = 0
    peak_all_bytes: int = 0

    def __post_init__(self) -> None:
        super().__init__()
        self._inside_triton = 0
        self._tracked: set[int] = set()

    # --- totals ---------------------------------------------------------------------------

    @property
    def read(self) -> int:
        return sum(launch.read for launch in self.launches)

    @property
    def written(self) -> int:
        return sum(launch.written for launch in self.launches)

    @property
    def moved(self) -> int:
        """Bytes read plus bytes written."""
        return self.read + self.written

    def names(self) -> list[str]:
        return [launch.name for launch in self.launches]

    # --- the dispatch mode ----------------------------------------------------------------

    def __enter__(self) -> TrafficCounter:
        _ACTIVE.append(self)
        if len(_ACTIVE) == 1:
            _hook_triton(True)
            cpu_loops.on_launch = _record_cpu_loop
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                _hook_triton(False)
                cpu_loops.on_launch = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._inside_triton:
            return func(*args, **kwargs)
        packet = func.overloadpacket
        launches = not (func.is_view or packet in NO_LAUNCH)
        if launches:
            reads, writes = _aten_accesses(func, args, kwargs)
        argument_storages = {_storage_key(t) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        if launches:
            writes = writes + [t for t in _distinct(_tensors(out))
                               if _storage_key(t) not in argument_storages]
            self.launches.append(Launch(
                str(packet), self._bytes(reads), self._bytes(writes),
            ))
        for t in _tensors(out):
            if _storage_key(t) not in argument_storages:
                self._allocated(str(packet), t)
        return out

    # --- bookkeeping ----------------------------------------------------------------------

    def _full(self, t: Tensor) -> bool:
        return t.numel() == self.numel

    def _bytes(self, tensors: list[Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if self._full(t))

    def _allocated(self, op: str, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._tracked:
            return
        nbytes, full = storage.nbytes(), self._full(t)
        self._tracked.add(key)
        self.live_all_bytes += nbytes
        self.peak_all_bytes = max(self.peak_all_bytes, self.live_all_bytes)
        if full:
            self.allocations.append(Allocation(op, t.dtype, nbytes))
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._freed, key, nbytes, full)

    def _freed(self, key: int, nbytes: int, full: bool) -> None:
        self._tracked.discard(key)
        self.live_all_bytes -= nbytes
        if full:
            self.live_bytes -= nbytes

    def record_loop(self, name: str, reads: list[Tensor], writes: list[Tensor]) -> None:
        """Record a launch that is not an ATen operator (a CPU loop)."""
        self.launches.append(Launch(
            name, self._bytes(_distinct(reads)), self._bytes(_distinct(writes)),
        ))

    def record_triton(self, name: str, reads: list[Tensor], writes: list[Tensor],
                      others: list[Tensor]) -> None:
        """Record a Triton launch (called by the launch hook)."""
        undeclared = [t for t in others if self._full(t)]
        if undeclared:
            raise ValueError(
                f"Triton kernel {name} got a full-size tensor argument that its TRAFFIC entry "
                f"(iabn/kernels/triton_kernels.py) neither reads nor writes: declare it"
            )
        self.launches.append(Launch(
            f"triton.{name}", self._bytes(_distinct(reads)), self._bytes(_distinct(writes)),
        ))


_ACTIVE: list[TrafficCounter] = []


def _record_cpu_loop(name: str, reads: list[Tensor], writes: list[Tensor]) -> None:
    if _ACTIVE:
        _ACTIVE[-1].record_loop(name, reads, writes)


def _tensors(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _storage_key(t: Tensor) -> int:
    return id(t.untyped_storage())


def _bound(func, args: tuple, kwargs: dict) -> list[tuple[Any, Any]]:
    """``(schema argument, value)`` for the arguments given."""
    pairs = []
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            pairs.append((argument, args[i]))
        elif argument.name in kwargs:
            pairs.append((argument, kwargs[argument.name]))
    return pairs


def _distinct(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` without repeats of the same memory (one tensor passed twice is read once)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    kept = []
    for t in tensors:
        key = (_storage_key(t), t.storage_offset(), tuple(t.stride()))
        if key not in seen:
            seen.add(key)
            kept.append(t)
    return kept


def _aten_accesses(func, args: tuple, kwargs: dict) -> tuple[list[Tensor], list[Tensor]]:
    """The tensors an ATen operator reads and writes, one entry per pass (results it
    allocates are added by the caller), by the rules of the module docstring."""
    packet = func.overloadpacket
    name = packet.__name__
    values = {argument.name: value for argument, value in _bound(func, args, kwargs)}
    if name in _BATCH_NORM_PASSES:
        outs = [t for argument, value in _bound(func, args, kwargs) if argument.is_out
                for t in _tensors(value)]
        return _BATCH_NORM_PASSES[name](values), _distinct(outs)
    if "batch_norm" in name:
        raise ValueError(f"no pass rule for aten.{name}: add one to iabn.measure.traffic")
    reads: list[Tensor] = []
    writes: list[Tensor] = []
    for argument, value in _bound(func, args, kwargs):
        tensors = _tensors(value)
        if argument.alias_info is not None and argument.alias_info.is_write:
            writes += tensors
            if not argument.is_out and packet not in WRITE_ONLY_SELF:
                reads += tensors
        else:
            reads += tensors
    return _distinct(reads), _distinct(writes)


def _native_batch_norm(values: dict) -> list[Tensor]:
    return [values["input"]] * (2 if values["training"] else 1)


def _native_batch_norm_backward(values: dict) -> list[Tensor]:
    want_dx, want_dweight, want_dbias = values["output_mask"]
    train = values["train"]
    grad_out, x = values["grad_out"], values["input"]
    reads = []
    if train or want_dweight or want_dbias:
        reads += [grad_out, x]  # the reduction pass
    if want_dx:
        reads += [grad_out, x] if train else [grad_out]  # the input-gradient pass
    return reads


def _one_pass(values: dict) -> list[Tensor]:
    return [values["input"]]


#: Batch-norm operators: the full-size tensors their passes read (duplicates are passes).
_BATCH_NORM_PASSES = {
    "native_batch_norm": _native_batch_norm,
    "native_batch_norm_backward": _native_batch_norm_backward,
    "batch_norm_update_stats": _one_pass,
}


# --- Triton ---------------------------------------------------------------------------------


def _triton_kernels():
    """The kernel module, if Triton is installed (imported here so that every kernel is hooked
    however late the backend is first used)."""
    from ..kernels import backends

    if not backends.has_triton():
        return None
    from ..kernels import triton_kernels

    return triton_kernels


def _hook_triton(on: bool) -> None:
    kernels = _triton_kernels() if on else sys.modules.get("iabn.kernels.triton_kernels")
    if kernels is None:
        return
    for name, traffic in kernels.TRAFFIC.items():
        kernel = getattr(kernels, name)
        if on:
            kernel.run = _counted_run(kernel, name, traffic)
        else:
            kernel.__dict__.pop("run", None)


def _counted_run(kernel, name: str, traffic):
    original = type(kernel).run.__get__(kernel)
    arg_names = list(kernel.arg_names)

    def run(*args, grid, warmup, **kwargs):
        counter = _ACTIVE[-1] if _ACTIVE else None
        if counter is None or warmup or counter._inside_triton:
            return original(*args, grid=grid, warmup=warmup, **kwargs)
        values = dict(zip(arg_names, args, strict=False))
        values.update(kwargs)
        declared = set(traffic.reads) | set(traffic.writes)
        counter.record_triton(
            name,
            [values[n] for n in traffic.reads],
            [values[n] for n in traffic.writes],
            [v for n, v in values.items() if isinstance(v, Tensor) and n not in declared],
        )
        counter._inside_triton += 1
        try:
            return original(*args, grid=grid, warmup=warmup, **kwargs)
        finally:
            counter._inside_triton -= 1

    return run


# --- one step -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTraffic:
    """The counters of one step's forward and backward."""

    forward: TrafficCounter
    backward: TrafficCounter


@contextmanager
def _fresh_scratch() -> Iterator[None]:
    # The reference backward keeps its CPU temporaries in reused per-thread buffers
    # (kernels/scratch.py); released first, they are allocated inside the counted backward,
    # as a GPU (which does not use them) allocates its temporaries.
    from ..kernels import scratch

    scratch.release()
    yield


def count_step(layer: nn.Module, leaf: Tensor, grad: Tensor) -> StepTraffic:
    """Count ``layer(leaf.clone()).backward(grad)``: forward and backward separately.

    Gradients are reset to ``None`` first (as ``optimizer.zero_grad()`` does), so that none is
    accumulated into an existing one."""
    numel = leaf.numel()
    leaf.grad = None
    layer.zero_grad(set_to_none=True)
    x = leaf.clone()
    with _fresh_scratch():
        with TrafficCounter(numel) as forward:
            out = layer(x)
        with TrafficCounter(numel) as backward:
            out.backward(grad)
    return StepTraffic(forward, backward)
