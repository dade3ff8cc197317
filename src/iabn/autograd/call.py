"""The one call sequence of every layer, the checks every call runs before it (the input's
kind and whether the caller's tensor may be overwritten), and what the layers' ``Function``\\ s
share (docs/design.md, "The in-place contract").

:func:`layer_call` runs, in order: the run-time rule (:func:`overwrite_refused`: an input that
autograd or an engine does not let be overwritten is computed output-only, on a copy), the
debug mode's poisoned call (:mod:`iabn.debug`) where the
input is overwritten, the layer composed of PyTorch's differentiable operators under
forward-mode AD and ``torch.func`` (which cannot run a ``Function`` that sets up its context in
``forward``), the computation without an autograd node where no gradient is wanted, or the
family's ``Function``. An op family (:class:`OpFamily`: batch norm, group norm, row norm,
activation) supplies those three computations; the sequence is written once, here.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor
from torch.autograd import forward_ad

from .. import debug

_peek_interpreter_stack = torch._C._functorch.peek_interpreter_stack


class OpFamily(Protocol):
    """What a family gives :func:`layer_call`. ``options`` is the family's own tuple (e.g.
    ``(running_mean, running_var, config)`` of batch norm), passed through untouched."""

    @staticmethod
    def composed(input: Tensor, weight: Tensor | None, bias: Tensor | None, options: Any,
                 overwrite: bool) -> Tensor:
        """The layer from differentiable operators (forward-mode AD, ``torch.func``)."""
        ...

    @staticmethod
    def without_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None, options: Any,
                     overwrite: bool) -> Tensor:
        """The layer's output without an autograd node."""
        ...

    @staticmethod
    def with_grad(input: Tensor, weight: Tensor | None, bias: Tensor | None, options: Any,
                  overwrite: bool) -> Tensor:
        """The layer's output through its ``Function``."""
        ...


def layer_call(family: OpFamily, input: Tensor, weight: Tensor | None, bias: Tensor | None,
               options: Any, overwrite: bool, layer: str) -> Tensor:
    """The output of a layer of ``family`` on ``input`` (written into ``input`` and ``input``
    returned where ``overwrite``), after the layer's checks. ``layer`` names the call in the
    debug mode's reports."""
    # Spelled out: a generator over the three tensors costs a microsecond per layer call.
    grad = torch.is_grad_enabled() and (
        input.requires_grad
        or (weight is not None and weight.requires_grad)
        or (bias is not None and bias.requires_grad)
    )
    if overwrite and overwrite_refused(input, grad):
        overwrite = False  # the output-only mode: nothing of the caller's is written
    if overwrite and debug._ACTIVE and debug.intercepts():
        # the debug mode reruns this call on a copy of the input, which it poisons
        return debug.poisoned_call(
            lambda copy: layer_call(family, copy, weight, bias, options, True, layer),
            input, layer)
    if transformed():
        return family.composed(input, weight, bias, options, overwrite)
    if grad:
        return family.with_grad(input, weight, bias, options, overwrite)
    return family.without_grad(input, weight, bias, options, overwrite)


_DEFAULT_VIEW = torch._C._autograd.CreationMeta.DEFAULT
_creation_meta = torch._C._autograd._get_creation_meta
_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_graph_task_id = torch._C._current_graph_task_id
#: the qualified name's start of the pack hook of a non-reentrant checkpoint's first forward
_CHECKPOINT_FORWARD = "_checkpoint_hook."


def overwrite_refused(input: Tensor, grad: bool) -> bool:
    """The run-time rule of the in-place layers: whether ``input``, which the checks let
    through, must nevertheless not be overwritten, because autograd or an engine refuses it;
    the layer then computes output-only (a new output; the input left untouched). Decided
    before anything is written. ``grad``: whether the call records an autograd node.

    - With a node: a view autograd does not let be overwritten (its creation meta is not
      the default one): one of several views a function returned (``chunk``, ``split``,
      ``unbind``), a custom ``Function``'s output returned as-is (FSDP2's hooks pass every
      block's input through one), a view made under ``no_grad`` or inference mode; a leaf
      that requires grad or a view of one, which reaches here only inside a backward (the
      checks refuse the user's own: :func:`check_writable`), i.e. a
      reentrant checkpoint's recomputation on its detached inputs; and any input while a
      non-reentrant ``torch.utils.checkpoint`` runs its first forward, whose inputs it
      recomputes from in backward.
    - Without a node: an input that requires grad (a tensor autograd recorded, read under
      ``no_grad``: a reentrant checkpoint's first forward, a custom ``Function``'s forward),
      which something outside may have saved for backward.

    Eager mode only: under ``torch.compile`` an overwritten input is a copy already
    (:func:`overwritable`), and under ``torch.func`` transforms the layer is composed. Cost
    on the common path (a computed tensor that is no view, no checkpoint): the compiler's
    flag, two attribute reads and the saved-tensor hooks' query, about 0.5 µs on the loaded
    2-core VM, equal within noise in a layer's call (benchmarks/writability_cost.py)."""
    if not grad:
        return input.requires_grad and _eager_untransformed()
    # ordered for the common case, a computed tensor that is no view: the compiler's flag,
    # two attribute reads and the hooks' query (torch.compile traces none of the queries)
    if torch.compiler.is_compiling():
        return False
    if input._is_view():
        if _peek_interpreter_stack() is not None:
            return False
        if refused_view(input):
            return True
        base = input._base
        if base.is_leaf and base.requires_grad:
            return True
    elif input.is_leaf:
        return input.requires_grad and _peek_interpreter_stack() is None
    return in_checkpoint_forward()


def _eager_untransformed() -> bool:
    return not torch.compiler.is_compiling() and _peek_interpreter_stack() is None


def in_checkpoint_forward() -> bool:
    """Whether a non-reentrant ``torch.utils.checkpoint`` runs its first forward here: its
    saved-tensor hooks are the innermost ones. It recomputes the region from the region's
    inputs in backward, so they must keep their values; the region's saved tensors are
    dropped, so computing a layer output-only there costs a copy in forward and no memory
    kept. (Its recomputation in backward runs under other hooks, and overwrites as usual.)
    Eager mode only."""
    hooks = _top_saved_tensors_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith(
        _CHECKPOINT_FORWARD)


def refused_view(view: Tensor) -> bool:
    """Whether autograd refuses to let ``view`` (a view: ``_is_view()``) be overwritten while
    it records: its creation meta (``MULTI_OUTPUT_NODE``, ``IN_CUSTOM_FUNCTION``,
    ``NO_GRAD_MODE``, ``INFERENCE_MODE``) is not the default one. Eager mode only."""
    return _creation_meta(view) != _DEFAULT_VIEW


def whole_base(input: Tensor) -> Tensor | None:
    """The base of ``input`` where ``input`` is a view of all of it in its own order (both
    contiguous, the same elements, offset and dtype: a linear layer's 3-d output is a view of
    its 2-d matrix product), else ``None``. An elementwise layer overwrites that base in its
    place: overwritten in place, a view makes autograd record ``CopySlices``, whose backward
    copies the gradient into a tensor of the base's size and back (four activation-sized
    copies and a fill of zeros per layer: 48 ms of the 68 ms a converted ViT-S/16 step took
    beyond the model's in one profile, batch 2, one thread); the base then costs a view's
    backward, a reshape. Eager mode only."""
    if torch.compiler.is_compiling() or not input._is_view():
        return None
    base = input._base
    if (base.dtype == input.dtype and base.numel() == input.numel()
            and base.storage_offset() == input.storage_offset()
            and base.is_contiguous() and input.is_contiguous()):
        return base
    return None


def engine_made(input: Tensor, base: Tensor | None) -> bool:
    """Whether a leaf that requires grad, or a view of one (``base``: ``input._base``), is an
    engine's rather than the caller's, so that the checks let it through to
    :func:`overwrite_refused`: a view autograd does not let be overwritten (FSDP2's hooks pass
    a block's input through a custom ``Function``), or a tensor met inside a backward (a
    reentrant checkpoint recomputes its region there on detached leaves). Eager mode only."""
    return in_backward() or (base is not None and refused_view(input))


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a reentrant
    checkpoint recomputes its segment there)."""
    return _graph_task_id() != -1


def transformed() -> bool:
    """Whether forward-mode AD (a ``forward_ad.dual_level``) or a ``torch.func`` transform
    (``jvp``, ``vmap``, ``grad``, ``jacfwd``...) is active. The in-place autograd Functions
    have a backward only, and ``torch.func`` cannot run a Function that sets up its context in
    ``forward``; under these the layer is computed by composition (about 0.2 µs a call to
    ask, measured on CPU)."""
    return (
        forward_ad._current_level >= 0 or _peek_interpreter_stack() is not None
    ) and not torch.compiler.is_compiling()


def overwritable(x: Tensor) -> Tensor:
    """The tensor to hand to an autograd function that overwrites its input and calls
    ``ctx.mark_dirty``: ``x`` itself in eager mode, a copy under ``torch.compile``.

    The compiler (torch 2.13, and still 2.14.1: input-gradient error 7.3 on the test's data)
    loses ``ctx.mark_dirty`` when the overwritten tensor is an input of the compiled graph (a
    graph break before the layer, a compiled block that starts with its norm): backward then
    passed ``dz`` through as ``dx`` (pytorch/pytorch#184113). On a copy the overwritten tensor
    is an intermediate of the graph, which compiles correctly, and Inductor drops the copy
    where ``x`` already is one. The single-process batch-norm layers compile through
    :mod:`iabn.autograd.compiled` instead, which does not mark anything dirty.
    """
    return x.clone() if torch.compiler.is_compiling() else x


def grad_mask(ctx: Any, weight: Tensor | None, bias: Tensor | None) -> list[bool]:
    """``[dx, dweight, dbias]`` wanted, from a ``Function``'s first three inputs
    ``(x, weight, bias)``: a gradient of an absent parameter is never wanted."""
    want_dx, want_dweight, want_dbias = ctx.needs_input_grad[:3]
    return [want_dx, want_dweight and weight is not None, want_dbias and bias is not None]


def refuse_double_backward(layer: str, instead: str, *, plural: bool = False) -> None:
    """Raise under ``create_graph=True``, the only case in which backward runs with grad mode
    on: call it from a ``Function``'s backward as ``if torch.is_grad_enabled():
    refuse_double_backward(...)``. ``instead``: what computes the layer with second
    derivatives. (A check instead of ``@once_differentiable``: its wrapper adds ~2.5 µs per
    layer and step, measured on the 2-core CPU machine, and its error names no fix.)"""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"{layer} {'do' if plural else 'does'} not support double backward "
            f"(create_graph=True); use {instead} "
            f"where second derivatives are needed"
        )

# ------------------------------------------------------------------ the checks of every call
#
# What a layer checks on every call, before anything is written: the tensor's kind and whether
# the caller's tensor may be overwritten at all (a leaf that requires grad, an inference
# tensor, elements that share memory are refused, naming the way out). What autograd or an
# engine refuses is not an error: :func:`overwrite_refused` computes it output-only. A layer's
# other checks (shapes, dtypes, options) run when its :func:`input_signature` changes.

_STRIDED = torch.strided


def input_signature(
    input: Tensor, training: bool, weight: Tensor | None, bias: Tensor | None,
    running_mean: Tensor | None, running_var: Tensor | None,
) -> tuple:
    """Everything a layer's full checks (e.g. :func:`iabn.layers.checks.check_inputs`) decide
    from, except what :func:`check_per_call` checks: the input's shape, dtype and device,
    ``training``, and each per-channel tensor's shape, dtype and device (``None`` where absent;
    a layer without running statistics passes ``None``).

    A module keeps the signature of its last validated call and revalidates only when it
    changes, so a steady training loop pays for building this tuple (about 1 µs), not for the
    whole validation (about 3 µs on CPU). ``input`` must be a tensor (check that first).
    Spelled out, without a loop or helper: it runs on every layer call.
    """
    return (
        input.shape, input.dtype, input.device, training,
        None if weight is None else (weight.shape, weight.dtype, weight.device),
        None if bias is None else (bias.shape, bias.dtype, bias.device),
        None if running_mean is None
        else (running_mean.shape, running_mean.dtype, running_mean.device),
        None if running_var is None
        else (running_var.shape, running_var.dtype, running_var.device),
    )


def check_per_call(input: Tensor, *, in_place: bool) -> None:
    """The checks a cached :func:`input_signature` cannot stand for: the tensor's kind (its
    layout is not in the signature, and a nested tensor has no shape to build one) and
    whether this particular tensor may be overwritten (autograd leaf, memory overlap,
    inference tensor)."""
    # The common case in one test; any failure goes through the full check, which names it.
    if not isinstance(input, Tensor) or input.is_nested or input.layout is not _STRIDED:
        check_tensor_kind(input)
    if in_place:
        check_writable(input)


def check_tensor_kind(input: Tensor) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.is_nested:
        raise TypeError(
            "input is a nested tensor; batch normalisation takes dense (strided) tensors: "
            "pass torch.nested.to_padded_tensor(input, 0.0), or each of its tensors"
        )
    if input.layout is not torch.strided:
        raise TypeError(
            f"input is a {input.layout} tensor; batch normalisation takes dense (strided) "
            f"tensors: pass input.to_dense()"
        )


def check_writable(input: Tensor, layer: str = "",
                   instead: str = "the non-in-place iabn.ABN") -> None:
    """The in-place layer overwrites ``input``: reject tensors autograd or memory forbid.
    ``layer``: a prefix naming the layer in the messages; ``instead``: what to use instead."""
    # Neither query below can be traced by torch.compile: they run in eager mode only (inside
    # a compiled graph, layer inputs are the graph's own intermediates).
    eager = not torch.compiler.is_compiling()
    prefix = f"{layer}: " if layer else ""
    if eager and input.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{prefix}input is an inference tensor (made under torch.inference_mode()), which "
            f"cannot be overwritten outside inference mode: run the layer under "
            f"torch.inference_mode() too, pass input.clone(), or use {instead}"
        )
    if torch.is_grad_enabled():
        base = input._base
        leaf = input if base is None else base
        if leaf.is_leaf and leaf.requires_grad and not (eager and engine_made(input, base)):
            what = "a leaf tensor" if leaf is input else "a view of a leaf tensor"
            functional = " (iabn.functional.abn)" if instead.endswith("iabn.ABN") else ""
            raise RuntimeError(
                f"{prefix}input is {what} that requires grad; an in-place layer overwrites its "
                f"input, and autograd cannot differentiate with respect to an overwritten "
                f"leaf. Use {instead}{functional}, or pass a computed tensor (e.g. the output "
                f"of a convolution, or input.clone())"
            )
    # torch.func's wrapped tensors (vmap's batched ones) have no overlap query: there the
    # layer is computed by composition and ATen's copy_ into the input does its own check.
    # A contiguous tensor cannot overlap: asking that first spares the common case the
    # overlap query (0.09 against 0.5 µs, CPU). (_peek_interpreter_stack: torch.func runs.)
    if (eager and _peek_interpreter_stack() is None and not input.is_contiguous()
            and has_internal_overlap(input)):
        raise ValueError(
            f"{prefix}input has elements that share memory (e.g. a tensor made by expand() or "
            f"as_strided()), so it cannot be overwritten in place: pass input.contiguous(), "
            f"or use {instead}"
        )


# torch._debug_has_internal_overlap's verdicts (ATen's MemOverlap)
_OVERLAP_NO, _OVERLAP_YES, _OVERLAP_TOO_HARD = 0, 1, 2


def has_internal_overlap(t: Tensor) -> bool:
    """Whether two elements of ``t`` share a memory location.

    ATen answers at once for dense tensors (no) and for a zero stride (yes), and "too hard" for
    the rest, where its own in-place operators go ahead and write. Here "too hard" is settled:
    first by a sufficient condition (each stride, in increasing order, steps past the extent of
    the smaller ones: true of every slice of a dense tensor), and only for tensors that fail
    it, exactly, by comparing the storage offsets of all elements.
    """
    verdict = torch._debug_has_internal_overlap(t)
    if verdict != _OVERLAP_TOO_HARD:
        return verdict == _OVERLAP_YES
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz > 1)
    extent = 0  # the largest offset the dimensions of smaller stride reach
    for stride, size in dims:
        if stride <= extent:
            break
        extent += stride * (size - 1)
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        index = torch.arange(size, dtype=torch.int64) * stride
        offsets = offsets + index.reshape((size,) + (1,) * (t.dim() - dim - 1))
    return int(torch.unique(offsets).numel()) < t.numel()


__all__ = ["OpFamily", "check_per_call", "check_tensor_kind", "check_writable", "engine_made",
           "grad_mask", "has_internal_overlap", "in_backward", "in_checkpoint_forward",
           "input_signature", "layer_call", "overwritable", "overwrite_refused",
           "refuse_double_backward", "refused_view", "transformed"]
