"""A debug mode that makes misuse of the in-place layers loud.

``InPlaceABN``, ``iabn.functional.inplace_abn`` and the synchronised layers overwrite their input
and return that same tensor, so code that reads the input again afterwards (a residual shortcut
taken before the norm, a tensor fed to two branches) silently gets the output. Autograd notices
only when some operation saved the tensor for its backward *before* the layer overwrote it.

Inside :func:`poison_overwritten` every such layer call instead

1. computes its result into a copy (``input.clone()``, then the normal in-place path on the
   copy, so autograd reaches ``input`` through the clone and gradients are unchanged),
2. fills the original ``input`` with NaN under ``torch.no_grad()`` (this moves its version
   counter, so an operation that saved it still fails at backward, as without the mode), and
3. returns the copy.

While the context is active a ``torch.overrides.TorchFunctionMode`` raises
:class:`OverwrittenTensorError` when an overwritten tensor, or another tensor whose memory
overlaps it, is passed to any torch function, naming the layer, the tensor's shape and the fix.
Reads the mode cannot see (a NumPy array made earlier that shares the memory, C extensions,
other threads) get the NaNs.
The contract the mode enforces is "after the call, only the returned tensor is used": code that
deliberately reads the layer's output through its input (e.g. through the base of a view it
normalised) is reported too.

The layer is named by its class and, when the error is raised, by its qualified name in the
outermost module being called (kept by global module hooks while the mode is on).

Scope: the switch is process-wide, a counter of active contexts, so nested and reentrant use
(and use as a decorator) is fine and layer calls in every thread compute into copies while any
context is open. PyTorch keeps torch function modes per thread, so the error is raised in the
thread that entered the context; other threads see the NaNs. Code running under
``torch.compile`` is not intercepted: the layer runs in place there, as normal, and the mode's
hooks and checks step aside while Dynamo traces (it would otherwise trace them and fail).
``torch.compile(module)`` warns that global module hooks exist while the mode is on.

``IABN_DEBUG_INPLACE=1`` in the environment when ``iabn`` is imported turns the mode on for the
whole process (the error-raising mode in the importing thread), without code changes.

Cost outside the mode: one test of :data:`_ACTIVE` per layer call. Inside it, a copy of each
normalised tensor, a NaN fill, two global module hooks, and a check of every tensor
argument of every torch call; it is meant for finding bugs, not for training.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ENV = "IABN_DEBUG_INPLACE"

#: Number of open :func:`poison_overwritten` contexts (plus one for ``IABN_DEBUG_INPLACE=1``).
#: The layers test it on every call, so it is a plain module attribute.
_ACTIVE = 0

FIX = (
    "apply the layer to a copy (x.clone()), or use iabn.ABN there, which does not overwrite "
    "its input"
)


class OverwrittenTensorError(RuntimeError):
    """A tensor that an in-place iabn layer overwrote was used after the layer call."""


class _Poisoned(NamedTuple):
    """What is known of one overwritten tensor; ``tensor`` is a weak reference."""

    tensor: weakref.ReferenceType
    storage: int
    shape: tuple[int, ...]
    layer: str
    module: weakref.ReferenceType | None
    root: weakref.ReferenceType | None


# Reentrant: a weak-reference callback (_forget) may run, from garbage collection, in a thread
# that already holds it.
_lock = threading.RLock()
# Storage address -> the tensors overwritten in it. Weak references only: the mode must not keep
# activations alive. An address is compared only while its tensor is alive, so a freed and
# reused storage is never confused with a poisoned one.
_poisoned: dict[int, list[_Poisoned]] = {}
# Per thread: inside poisoned_call, where the layer's own path runs on the copy.
_local = threading.local()

# Reading a tensor's metadata is no use of its values: these calls are never reported.
_METADATA_PROPERTIES = (
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad_fn",
    "_version", "is_cuda", "is_sparse", "is_quantized", "is_meta", "names", "_base",
)
_METADATA_METHODS = (
    "size", "dim", "stride", "numel", "nelement", "element_size", "storage_offset",
    "untyped_storage", "data_ptr", "is_contiguous", "is_floating_point", "is_complex",
    "__hash__", "__len__",
)
_METADATA = frozenset(
    [getattr(torch.Tensor, name).__get__ for name in _METADATA_PROPERTIES
     if hasattr(torch.Tensor, name)]
    + [getattr(torch.Tensor, name) for name in _METADATA_METHODS if hasattr(torch.Tensor, name)]
)


def intercepts() -> bool:
    """Whether a layer call in this thread should go through :func:`poisoned_call` (called
    only when :data:`_ACTIVE` is set): not from inside one, nor while compiling."""
    return not getattr(_local, "inside", False) and not torch.compiler.is_compiling()


def poisoned_call(run: Callable[[Tensor], Tensor], input: Tensor, layer: str) -> Tensor:
    """``run`` (the layer's normal in-place path) on a copy of ``input``; then ``input`` is
    filled with NaN and registered as overwritten, and the copy is returned.

    ``layer`` names the operation for the error; when the call comes from a module's
    ``forward``, the module's class (and, at error time, its qualified name in the outermost
    module on the stack, if both are still alive) names it instead."""
    module, root = _calling_modules()
    if module is not None:
        layer = type(module).__name__
    _local.inside = True
    try:
        out = run(input.clone())
    finally:
        _local.inside = False
    with torch.no_grad():
        input.fill_(float("nan"))
    _register(input, layer, module, root)
    return out


def _calling_modules() -> tuple[Any, Any]:
    """(the innermost in-place layer being called in this thread, the outermost module)."""
    # The layers' class attribute, not isinstance: modules imports functional, which imports
    # this module.
    stack = getattr(_local, "modules", ())
    for module in reversed(stack):
        if getattr(type(module), "_in_place", False) is True:
            return module, stack[0]
    return None, (stack[0] if stack else None)


# The modules being called, per thread, kept by global module hooks while the mode is on. (Not
# by walking the Python stack: reading a frame's f_locals makes the frame hold a snapshot of
# its locals, which kept overwritten tensors alive.)
def _push_module(module: Any, args: Any) -> None:
    if torch.compiler.is_compiling():  # compiled code is not checked (see the module doc)
        return
    stack = _local.__dict__.setdefault("modules", [])
    stack.append(module)


def _pop_module(module: Any, args: Any, output: Any) -> None:
    if torch.compiler.is_compiling():
        return
    stack = getattr(_local, "modules", None)
    if stack and stack[-1] is module:  # a context entered inside a forward saw no push
        stack.pop()


_hooks: list[Any] = []


def _register(tensor: Tensor, layer: str, module: Any, root: Any) -> None:
    storage = tensor.untyped_storage()._cdata
    entry = _Poisoned(
        weakref.ref(tensor, lambda ref: _forget(storage, ref)), storage, tuple(tensor.shape),
        layer,
        None if module is None else weakref.ref(module),
        None if root is None else weakref.ref(root),
    )
    with _lock:
        _poisoned.setdefault(storage, []).append(entry)


def _forget(storage: int, ref: weakref.ReferenceType) -> None:
    with _lock:
        entries = _poisoned.get(storage)
        if entries is None:
            return
        entries[:] = [e for e in entries if e.tensor is not ref]
        if not entries:
            del _poisoned[storage]


def find_overwritten(t: Tensor) -> _Poisoned | None:
    """The record of the overwritten tensor whose memory ``t`` overlaps, if any."""
    try:
        storage = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses)
        return None
    with _lock:
        entries = list(_poisoned.get(storage, ()))
    for entry in entries:
        poisoned = entry.tensor()
        if poisoned is None or poisoned.untyped_storage()._cdata != storage:
            continue
        if t is poisoned or _overlap(t, poisoned):
            return entry
    return None


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors of one storage share a byte. ``torch._C._overlaps`` is exact only
    for simple layouts and says yes when unsure (e.g. two channel halves of an NCHW tensor), so
    the maybe-cases are settled with a byte mask of the storage."""
    if a.numel() == 0 or b.numel() == 0 or not torch._C._overlaps(a, b):
        return False
    mask = torch.zeros(a.untyped_storage().nbytes(), dtype=torch.uint8, device=a.device)
    _bytes_of(mask, b).fill_(1)
    return bool(_bytes_of(mask, a).any())


def _bytes_of(mask: Tensor, t: Tensor) -> Tensor:
    """The bytes of the storage that ``t`` covers, as a view of ``mask`` (one byte each)."""
    size = t.element_size()
    return mask.as_strided(
        (*t.shape, size), (*(s * size for s in t.stride()), 1), t.storage_offset() * size
    )


def _describe(entry: _Poisoned) -> str:
    # Looked up only here: naming every poisoned call would walk the model each time.
    module = entry.module() if entry.module is not None else None
    root = entry.root() if entry.root is not None else None
    if module is not None and root is not None and root is not module:
        for qualified, candidate in root.named_modules():
            if candidate is module:
                return f"{entry.layer} '{qualified}'"
    return entry.layer


def _error(entry: _Poisoned, used: Tensor, func: Any) -> OverwrittenTensorError:
    called = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    what = f"a tensor of shape {tuple(entry.shape)}"
    if used is not entry.tensor():
        what = (f"a tensor of shape {tuple(used.shape)} shares memory with {what}, which")
    return OverwrittenTensorError(
        f"{what} was overwritten in place by {_describe(entry)} and then used again "
        f"(passed to {called}); after an in-place "
        f"layer its input holds the layer's output, not the original values. To fix it, "
        f"{FIX}. (Reported by iabn.debug.poison_overwritten.)"
    )


class _Detector(TorchFunctionMode):
    """Raises :class:`OverwrittenTensorError` when a poisoned tensor reaches a torch function.
    PyTorch removes the mode while this method runs, so the checks here are not seen by it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _poisoned and func not in _METADATA and not torch.compiler.is_compiling():
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, Tensor):
                    entry = find_overwritten(leaf)
                    if entry is not None:
                        raise _error(entry, leaf, func)
        return func(*args, **kwargs)


def _enter() -> None:
    global _ACTIVE
    with _lock:
        if _ACTIVE == 0:
            _hooks.append(register_module_forward_pre_hook(_push_module))
            _hooks.append(register_module_forward_hook(_pop_module, always_call=True))
        _ACTIVE += 1


def _exit() -> None:
    global _ACTIVE
    with _lock:
        _ACTIVE -= 1
        if _ACTIVE == 0:
            _poisoned.clear()  # nothing checks them any more
            while _hooks:
                _hooks.pop().remove()


@contextmanager
def poison_overwritten() -> Iterator[None]:
    """Find code that uses a tensor after an in-place iabn layer overwrote it.

    Inside the ``with`` block (or a function decorated with it) the in-place layers work on a
    copy, fill their input with NaN and return the copy, and any torch function that receives
    an overwritten tensor raises :class:`OverwrittenTensorError` naming the layer. Outputs and
    gradients of correct code are unchanged (up to the memory of the copies)::

        with iabn.debug.poison_overwritten():
            loss = model(x).sum()
            loss.backward()
    """
    _enter()
    try:
        with _Detector():
            yield
    finally:
        _exit()


def _enabled_by_environment() -> bool:
    raw = os.environ.get(ENV, "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise ValueError(f"{ENV}={raw!r}: use 1 to turn iabn's in-place debug mode on, 0 or unset")


if _enabled_by_environment():  # for the whole process, so never left
    _enter()
    _Detector().__enter__()


__all__ = ["ENV", "OverwrittenTensorError", "poison_overwritten"]
