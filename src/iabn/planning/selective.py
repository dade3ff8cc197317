"""Selective recomputation: a segment recomputed in backward except for its products.

Checkpointing a segment keeps only its input and runs its whole forward again in backward,
convolutions and matrix products included, which is most of the forward's time. Most of the
memory, though, is in the outputs of the cheap operations between them (normalisation,
activation, pooling, additions): a ResNet block saves its convolutions' outputs and as many
normalised-and-activated tensors again. Selective recomputation keeps the outputs of the
products (the operations with a FLOP formula in ``torch.utils.flop_counter``, the planner's cost
model's definition) and recomputes only the rest, the batch-norm-aware checkpointing of the
In-Place ABN paper (section 3.2) for any segment: about half the memory for the cost of the
cheap operations' forward.

Why not ``torch.utils.checkpoint``'s selective checkpointing (``context_fn`` with
``create_selective_checkpoint_contexts``): before torch 2.14 it keeps its values outside
autograd's saved tensors, where no ``saved_tensors_hooks`` sees them, so
:func:`iabn.memory.saved_tensor_bytes` (and the planner's accounting) would not count them and
an offloading hook would not move them. Here they are saved by a small autograd function at
the segment's output, as autograd saves any tensor, and the recomputation takes them from there.

Mechanics: the segment runs under ``torch.utils.checkpoint`` (non-reentrant) with two dispatch
modes (its ``context_fn``). In the forward, :class:`_Keeper` runs every operation and remembers
the products' outputs (an output that a later operation of the segment writes into is
remembered as a copy taken before the write, so the recomputation sees the value the forward
used). In backward, :class:`_Replayer` runs the cheap operations again and hands the
remembered outputs back in place of the products, in the order the forward made them.
While ``torch.compile`` traces (Dynamo follows no custom dispatch mode),
:func:`compiled_selectively` hands the same choice to PyTorch's selective checkpointing, whose
marks the compiler's partitioner honours.

Lean (``lean=True``): the products whose output is larger than their input
(:func:`is_expansion`, e.g. a ResNet bottleneck's w -> 4w convolution) are not kept but run
again in backward from their recomputed input, for more memory saved at the cost of their
FLOPs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import (
    TreeSpec,
    tree_flatten,
    tree_leaves,
    tree_map_only,
    tree_unflatten,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry


def _cpu_attention_flops(query: Tensor, key: Tensor, value: Tensor, *args: Any,
                         **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_attention_backward_flops(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                  *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape,
                                                 value.shape)


def _cpu_attention_formulas() -> dict:
    """The CPU flash attention's forward and backward, which ``torch.utils.flop_counter``
    has no formula for (its CUDA kernels' formulas, the same products, apply): without them
    a CPU attention counted 0 FLOPs (timm's ViT-S/16, batch 2, one thread: 8 ms predicted
    from its bytes against 92 ms measured)."""
    aten = torch.ops.aten
    formulas = {}
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", _cpu_attention_flops),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward",
                           _cpu_attention_backward_flops)):
        if hasattr(aten, name):
            formulas[getattr(aten, name)] = formula
    return formulas


#: ATen operation (overload packet) -> its FLOP formula (tensors in, a count out), for the
#: operations ``torch.utils.flop_counter``'s registry lacks. The registry itself is read at
#: each call, not copied: a formula registered later (``register_flop_formula``) counts too.
EXTRA_FLOPS = _cpu_attention_formulas()


def is_product(func: Any) -> bool:
    """Whether an ATen operation is one whose output selective recomputation keeps: one that
    has a FLOP formula (``torch.utils.flop_counter``'s or :data:`EXTRA_FLOPS`: convolutions,
    matrix products, attention)."""
    packet = func._overloadpacket
    return packet in flop_registry or packet in EXTRA_FLOPS


def product_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """The FLOPs of one call of a product (:func:`is_product`)."""
    packet = func._overloadpacket
    formula = flop_registry[packet] if packet in flop_registry else EXTRA_FLOPS[packet]
    return float(formula(*args, **kwargs, out_val=out))


# The products whose output size the lean rule reads from their arguments (attention is not
# here: its output is always kept)
_CONVOLUTIONS = frozenset(
    getattr(torch.ops.aten, name) for name in ("convolution", "_convolution")
    if hasattr(torch.ops.aten, name))
_MATRIX_PRODUCTS = frozenset((torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                              torch.ops.aten.baddbmm))


def _conv_size(size: int, kernel: int, stride: int, padding: int, dilation: int,
               transposed: bool, output_padding: int) -> int:
    if transposed:
        return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _conv_output_numel(args: tuple) -> int:
    x, weight = args[0], args[1]
    stride, padding, dilation, transposed, output_padding, groups = args[3:9]
    spatial = x.dim() - 2
    stride, padding, dilation, output_padding = (
        [v] * spatial if isinstance(v, int) else list(v) + [v[-1]] * (spatial - len(v))
        for v in (stride, padding, dilation, output_padding))
    channels = weight.shape[1] * groups if transposed else weight.shape[0]
    numel = x.shape[0] * channels
    for i in range(spatial):
        numel *= _conv_size(x.shape[2 + i], weight.shape[2 + i], stride[i], padding[i],
                            dilation[i], transposed, output_padding[i])
    return numel


def _product_sizes(func: Any, args: tuple) -> tuple[int, int] | None:
    """(elements of the activation input, elements of the output) of a convolution or a
    matrix product, from the shapes alone (before it runs: PyTorch's selective checkpointing
    asks its policy then); ``None`` for other products (attention: its output is always
    kept)."""
    packet = func._overloadpacket
    if packet in _CONVOLUTIONS:
        if len(args) < 9:  # arguments by keyword: not met in practice; kept, never run again
            return None
        return args[0].numel(), _conv_output_numel(args)
    if packet in _MATRIX_PRODUCTS:
        a, b = (args[0], args[1]) if packet in (torch.ops.aten.mm, torch.ops.aten.bmm) else (
            args[1], args[2])
        return a.numel(), a.numel() // a.shape[-1] * b.shape[-1]
    return None


def is_expansion(func: Any, args: tuple) -> bool:
    """Whether a product's output has more elements than its activation input (a ResNet
    bottleneck's last 1x1 convolution, w -> 4w channels; a stem's 3 -> 64): lean selective
    recomputation runs these again from their input rather than keep their output."""
    sizes = _product_sizes(func, args)
    return sizes is not None and sizes[1] > sizes[0]


# Products whose own backward does not read their output (it reads their inputs): where no
# later operation of the segment reads that output either, the recomputation needs no value
# for it. Attention kernels are not here: their backward reads their output.
_OUTPUT_UNUSED_BY_BACKWARD = frozenset(
    getattr(torch.ops.aten, name) for name in (
        "convolution", "_convolution", "convolution_overrideable", "cudnn_convolution",
        "_slow_conv2d_forward", "mm", "addmm", "bmm", "baddbmm")
    if hasattr(torch.ops.aten, name))


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def _written(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors ``func`` writes into (in place or ``out=``), by its schema."""
    where = _WRITES.get(func)
    if where is None:
        where = _WRITES[func] = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    found = []
    for i, name in where:
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, Tensor):
            found.append(value)
        elif value is not None:
            found += [t for t in tree_leaves(value) if isinstance(t, Tensor)]
    return found


def _detach(t: Tensor) -> Tensor:
    # Below autograd the view-tracking key is excluded: let detach share the version counter
    # (as torch.utils.checkpoint's selective mode does), which the write checks read.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


class _Memory:
    """The products of one forward of a segment, in order: their outputs while the forward
    runs (tensors detached), then only their structure (the tensors go to :class:`_Hold`),
    and in backward the outputs as unpacked there. ``unread`` are the products whose output
    nothing reads again (see ``_OUTPUT_UNUSED_BY_BACKWARD``): their tensors are not kept, and
    the recomputation gets a stand-in of the same shape that owns no memory. A product whose
    output is ``None`` here is not kept at all but run again (lean: :func:`is_expansion`)."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.funcs: list[Any] = []
        self.unread: set[int] = set()
        self.specs: list[tuple[TreeSpec, list[Any]] | Tensor | None] = []
        self.restored: list[Any] | None = None

    def hand_over(self) -> list[Tensor]:
        """The tensors to save; only the structure (and any non-tensor values) stays here."""
        kept = []
        for index, out in enumerate(self.outputs):
            if out is None:  # run again
                self.specs.append(None)
                continue
            if index in self.unread:
                self.specs.append(_stand_in(out))
                continue
            leaves, spec = tree_flatten(out)
            self.specs.append((spec, [None if isinstance(v, Tensor) else v for v in leaves]))
            kept += [v for v in leaves if isinstance(v, Tensor)]
        self.outputs = []
        return kept

    def restore(self, kept: Sequence[Tensor]) -> None:
        tensors = iter(kept)
        self.restored = [
            spec if spec is None or isinstance(spec, Tensor) else
            tree_unflatten([next(tensors) if v is None else v for v in spec[1]], spec[0])
            for spec in self.specs]


def _stand_in(t: Tensor) -> Tensor:
    """A tensor with ``t``'s shape, dtype and device whose one element is all its memory."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


class _Keeper(TorchDispatchMode):
    def __init__(self, memory: _Memory, lean: bool = False) -> None:
        super().__init__()
        self.memory = memory
        self.lean = lean
        self.storages: set[int] = set()  # of the remembered outputs
        self.unread: dict[int, int] = {}  # storage -> product, of outputs nothing read yet

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # (host cost matters: this runs for every operation of the segment)
        if self.unread:
            self._reading(args)
            self._reading(kwargs.values())
        if self.storages and not func.is_view:
            written = {_storage(t) for t in _written(func, args, kwargs)} & self.storages
            if written:
                self.memory.outputs = [
                    tree_map_only(Tensor, lambda t: t.clone() if _storage(t) in written else t,
                                  out)
                    for out in self.memory.outputs]
                self.storages = {_storage(t) for out in self.memory.outputs
                                 for t in tree_leaves(out) if isinstance(t, Tensor)}
        out = func(*args, **kwargs)
        if is_product(func):
            if self.lean and is_expansion(func, args):
                self.memory.funcs.append(func)
                self.memory.outputs.append(None)
                return out
            kept = _detach(out) if isinstance(out, Tensor) else tree_map_only(Tensor, _detach,
                                                                                 out)
            self.memory.funcs.append(func)
            self.memory.outputs.append(kept)
            self.storages.update(_storage(t) for t in tree_leaves(kept)
                                 if isinstance(t, Tensor))
            if func._overloadpacket in _OUTPUT_UNUSED_BY_BACKWARD and isinstance(out, Tensor):
                self.unread[_storage(out)] = len(self.memory.outputs) - 1
        return out

    def _reading(self, values: Any) -> None:
        """Forget, among the unread outputs, those whose storage one of ``values`` uses (any
        use counts as a read: a view, an in-place write, an ``out=``)."""
        for value in values:
            if isinstance(value, Tensor):
                self.unread.pop(_storage(value), None)
            elif isinstance(value, (list, tuple)):
                self._reading(value)

    def __exit__(self, *exc: Any) -> Any:
        self.memory.unread = set(self.unread.values())
        return super().__exit__(*exc)


class _Replayer(TorchDispatchMode):
    def __init__(self, memory: _Memory) -> None:
        super().__init__()
        self.memory = memory
        self.next = 0

    def __enter__(self):
        self.next = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_product(func):
            return func(*args, **(kwargs or {}))
        restored = self.memory.restored
        index = self.next
        self.next += 1
        if restored is None or index >= len(restored) or self.memory.funcs[index] is not func:
            raise RuntimeError(
                f"selective recomputation: the recomputed forward ran {func} as product "
                f"{index}, which its first run did not: the segment's forward must run the "
                f"same operations each time")
        out = restored[index]
        if out is None:  # lean: run again
            return func(*args, **(kwargs or {}))
        return _detach(out) if isinstance(out, Tensor) else tree_map_only(Tensor, _detach, out)


class _Hold(torch.autograd.Function):
    """Saves the remembered outputs for backward (where saved-tensor hooks see them) and hands
    them to the recomputation, which runs after this function's backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, memory: _Memory, out: Tensor, *kept: Tensor
    ) -> Tensor:
        ctx.memory = memory
        ctx.save_for_backward(*kept)
        # an alias, not a view: a view made in a custom function could not be written into
        # in place (a ReLU(inplace=True) after the segment); the alias shares the version
        # counter, so autograd refuses to unpack a kept output written into after this
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:  # type: ignore[override]
        kept = ctx.saved_tensors
        ctx.memory.restore(kept)
        return (None, grad) + (None,) * len(kept)


def _policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_product(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _lean_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # MUST: the partitioner never recomputes a convolution or matrix product on its own
    if is_product(func):
        return (CheckpointPolicy.MUST_RECOMPUTE if is_expansion(func, args)
                else CheckpointPolicy.MUST_SAVE)
    return CheckpointPolicy.PREFER_RECOMPUTE


def compiled_selectively(fn: Callable[..., Any], *args: Any, lean: bool = False) -> Any:
    """What :func:`selectively_recomputed` is while ``torch.compile`` traces: Dynamo traces no
    custom ``context_fn``, so PyTorch's own selective checkpointing gives the compiler's
    partitioner the same marks (keep the products' outputs, recompute the rest), and the
    compiled graph recomputes inside the backward (buffer updates are not replayed)."""
    return torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=functools.partial(create_selective_checkpoint_contexts,
                                     _lean_policy if lean else _policy))


def selectively_recomputed(run: Callable[..., Any], *args: Any, lean: bool = False) -> Any:
    """``run(*args)`` keeping its input and its products' outputs for backward; the rest is
    recomputed there by ``run`` again (see the module docstring). ``run`` returns one tensor.
    ``lean``: the products whose output is larger than their input (:func:`is_expansion`) are
    not kept but run again too."""
    memory = _Memory()
    out = torch.utils.checkpoint.checkpoint(
        run, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=lambda: (_Keeper(memory, lean), _Replayer(memory)))
    if not isinstance(out, Tensor) or not out.requires_grad:
        return out
    return _Hold.apply(memory, out, *memory.hand_over())


__all__ = ["EXTRA_FLOPS", "compiled_selectively", "is_expansion", "is_product", "product_flops",
           "selectively_recomputed"]
