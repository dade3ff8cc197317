"""Recording the dataflow of one real forward, for models ``torch.fx`` cannot trace.

``torch.fx`` runs forward on proxies, so Python that needs real values stops it: a loop over
a module list routed by stored indices (``x = y[m.f]``, outputs kept in a list: "Proxy object
cannot be iterated"), a list built from ``chunk`` and extended in a loop, a decoder that zips
skip lists. Here forward runs once on the example input, and every call is recorded as an
``fx.Node`` of the kinds fx's graph has, so :func:`~iabn.conversion.graph.find_sites` and the
rules read it unchanged:

- normalisation layers, iabn's layers and PyTorch's own modules are one ``call_module`` node
  each (fx's leaves, :func:`~iabn.conversion.graph.is_leaf`), recorded by a wrapper put on each
  module's ``forward`` for the run; nothing inside them is recorded;
- everything else is recorded by a ``TorchFunctionMode``: torch functions (``F.silu``,
  ``torch.cat``) as ``call_function``, tensor methods (``x.chunk``, ``x.add_``) as
  ``call_method``, indexing and operators as ``operator.getitem``/``setitem``/``add``...,
  attributes (``x.mT``) as ``getattr``. A mode sees each call once at the level the code wrote
  it: calls made inside a recorded call are not seen;
- a tensor is its node; a call's result becomes the node of the tensor it returns (an
  in-place ``x.relu_()`` included, as ``x = x.relu_()`` would be in fx), and each tensor in
  a returned tuple, list or dict a ``getitem`` node;
- values that escape (:class:`~iabn.conversion.graph.Escape`): given to a module's hook,
  stored on a module, or still alive after the run when neither the model nor its outputs
  hold them (a closure, a global).

Why not ``torch.export`` or ``make_fx``: they record ATen operations (a convolution is
``aten.convolution``, ``F.silu`` is ``aten.silu``, ``x[i]`` a ``select``), below the level of the
rules and of the report, which name modules and functions; and module calls would have to be
found again from their metadata.

What one run cannot show: a forward that takes other paths for other inputs. Reads of a
tensor's values into Python (``bool``, ``.item()``, ``.tolist()``...) on anything computed
from the input or from random numbers are listed (:attr:`Traced.value_reads`); branching on
sizes is not visible, so decisions hold for the recorded input's shapes.
"""

from __future__ import annotations

import gc
import operator
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..memory import attributing_saves, state_keys, storage_key
from .graph import (
    INPLACE_OPERATORS,
    Escape,
    Traced,
    add_escape,
    attribute_values,
    hook_kinds,
    is_leaf,
    is_site_module,
    timm_leaves,
)

#: Tensor dunder methods recorded as the ``operator`` functions fx's graph shows for them.
_DUNDERS = {
    "__getitem__": operator.getitem, "__setitem__": operator.setitem,
    "__add__": operator.add, "__radd__": operator.add, "__sub__": operator.sub,
    "__rsub__": operator.sub, "__mul__": operator.mul, "__rmul__": operator.mul,
    "__truediv__": operator.truediv, "__rtruediv__": operator.truediv,
    "__floordiv__": operator.floordiv, "__rfloordiv__": operator.floordiv,
    "__mod__": operator.mod, "__rmod__": operator.mod, "__pow__": operator.pow,
    "__rpow__": operator.pow, "__matmul__": operator.matmul, "__rmatmul__": operator.matmul,
    "__neg__": operator.neg, "__abs__": operator.abs, "__lt__": operator.lt,
    "__le__": operator.le, "__gt__": operator.gt, "__ge__": operator.ge, "__eq__": operator.eq,
    "__ne__": operator.ne, **INPLACE_OPERATORS,
}
#: Calls that bring a tensor's values into Python, where forward may branch on them, as the
#: report names them.
_VALUE_READS = {"__bool__": "bool()", "item": ".item()", "tolist": ".tolist()",
                "__int__": "int()", "__float__": "float()", "__index__": "an index",
                "__complex__": "complex()", "numpy": ".numpy()", "__array__": "an array"}
#: Calls whose result is random: a value read of it may differ from run to run.
_RANDOM = {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
           "bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "multinomial",
           "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "poisson",
           "dropout", "dropout_", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
           "feature_alpha_dropout", "rrelu", "rrelu_"}
#: Code of these packages is not "the model's code" when a value read is located.
_LIBRARY_DIRS = tuple(os.path.dirname(module.__file__) + os.sep for module in (torch,))
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller() -> str:
    """``file:line`` of the innermost frame outside PyTorch and iabn: where the model's code
    made the call being recorded."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_LIBRARY_DIRS) and not name.startswith(_OWN_DIR):
            return f"{os.path.basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _has_tensor(value: Any) -> bool:
    return any(isinstance(t, Tensor) for t in tree_leaves(value))


class _Recorder(TorchFunctionMode):
    """Builds the graph of one forward as it runs (see the module's docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.escapes: dict[fx.Node, Escape] = {}
        self.value_reads: list[str] = []
        self.node_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its node
        self.state = {id(t): name for name, t in (*model.named_parameters(),
                                                  *model.named_buffers())}
        self.inside = 0          # > 0 while a leaf module runs: its calls are not recorded
        self.current = ""        # the node running now, for attributing saved tensors
        self.norm_inputs: dict[str, Any] = {}  # norm node name -> storage key of its input
        #: those storages, held while the recorder lives: a storage key is the storage's
        #: address, which a storage made after the input's was freed could take, and its
        #: savers would then count as saving the norm's input
        self.norm_input_storages: list[Any] = []
        self.reads = 0           # value reads so far (each one, not deduplicated)
        #: for each module called, one entry per call: whether values were read during it
        self.calls: dict[str, list[bool]] = {}

    # ---------------------------------------------------------------- tensors and nodes

    def node(self, t: Tensor) -> fx.Node:
        node = self.node_of.get(t)
        if node is None:  # a parameter, a buffer, or a tensor made before the run
            node = self.graph.get_attr(self.state.get(id(t), "constant"))
            node.meta["data"] = False
            self.node_of[t] = node
        return node

    def nodes(self, value: Any) -> Any:
        """``value`` with each tensor replaced by its node (lists, tuples, dicts followed)."""
        if isinstance(value, Tensor):
            return self.node(value)
        if isinstance(value, list):
            return [self.nodes(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.nodes(v) for v in value)
        if isinstance(value, dict):
            return {k: self.nodes(v) for k, v in value.items()}
        return value

    def bind(self, result: Any, node: fx.Node) -> None:
        """Make ``node`` the node of the tensor ``result`` is, or of each tensor it holds
        (through ``getitem`` nodes, as fx's graph indexes a returned tuple)."""
        if isinstance(result, Tensor):
            self.node_of[result] = node
            return
        items = (result.items() if isinstance(result, dict)
                 else enumerate(result) if isinstance(result, (list, tuple)) else ())
        for key, item in items:
            if _has_tensor(item):
                part = self.graph.call_function(operator.getitem, (node, key))
                part.meta["data"] = node.meta["data"]
                self.bind(item, part)

    def create(self, op: str, target: Any, args: tuple, kwargs: dict,
               random: bool = False) -> fx.Node:
        node = self.graph.create_node(op, target, self.nodes(args), self.nodes(kwargs))
        node.meta["data"] = random or any(n.meta.get("data") for n in node.all_input_nodes)
        return node

    def escape(self, values: Any, how: str, may_write: bool, needs_class: bool) -> None:
        nodes = [self.node_of[t] for t in tree_leaves(values)
                 if isinstance(t, Tensor) and t in self.node_of]
        add_escape(self.escapes, nodes, how, may_write, needs_class)

    # ---------------------------------------------------------------- calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.inside:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _VALUE_READS:
            if any(isinstance(t, Tensor) and t in self.node_of and self.node_of[t].meta["data"]
                   for t in tree_leaves(args)):
                self.reads += 1
                read = f"{_VALUE_READS[name]} at {_caller()}"
                if read not in self.value_reads:
                    self.value_reads.append(read)
            return func(*args, **kwargs)
        op, target, call_args = _as_node(func, name, args)
        node = self.create(op, target, call_args, kwargs, random=name in _RANDOM)
        before, self.current = self.current, node.name
        try:
            result = func(*args, **kwargs)
        except BaseException:
            self.graph.erase_node(node)
            raise
        finally:
            self.current = before
        if _has_tensor(result):
            self.bind(result, node)
        elif not _may_write(op, target, kwargs):
            self.graph.erase_node(node)  # metadata (x.shape, x.size()): no tensor flows on
        return result

    def module_forward(self, m: nn.Module, name: str, leaf: bool, forward):
        """The wrapper put on ``m.forward`` for the run."""
        def recorded(*args, **kwargs):
            reads = self.reads
            if self.inside or not leaf:
                result = forward(*args, **kwargs)
            else:
                node = self.create("call_module", name, args, kwargs)
                if is_site_module(m) and args and isinstance(args[0], Tensor):
                    self.norm_inputs[node.name] = storage_key(args[0])
                    self.norm_input_storages.append(args[0].untyped_storage())
                before, self.current = self.current, node.name
                self.inside += 1
                try:
                    result = forward(*args, **kwargs)
                finally:
                    self.inside -= 1
                    self.current = before
                self.bind(result, node)
            if not self.inside:
                self.calls.setdefault(name, []).append(self.reads > reads)
            kinds = hook_kinds(m) if not self.inside else []
            if kinds:  # hooks run around this forward, on these very tensors
                self.escape((args, kwargs, result), f"passed to {' and '.join(kinds)} of "
                            f"`{name or 'the model'}`", may_write=True, needs_class=not leaf)
            return result
        return recorded


def _as_node(func, name: str, args: tuple) -> tuple[str, Any, tuple]:
    """The fx node kind, target and arguments of a call the mode sees."""
    owner = getattr(func, "__self__", None)
    if name == "__get__" and owner is not None and hasattr(owner, "__name__"):
        return "call_function", getattr, (args[0], owner.__name__)  # a property: x.mT
    if getattr(torch.Tensor, name, None) is func or getattr(torch._C.TensorBase, name,
                                                              None) is func:
        if name in _DUNDERS:
            return "call_function", _DUNDERS[name], args
        return "call_method", name, args
    return "call_function", func, args


def _may_write(op: str, target: Any, kwargs: dict) -> bool:
    """Whether a call that returned no tensor may have written one (``x[i] = v``, ``out=``)."""
    if "out" in kwargs:
        return True
    if op == "call_function":
        return target is operator.setitem or target in INPLACE_OPERATORS.values()
    name = str(target)
    return name.endswith("_") and not name.startswith("__")


@contextmanager
def _wrapped_forwards(model: nn.Module, recorder: _Recorder) -> Iterator[None]:
    """Every module of ``model`` with its ``forward`` wrapped for the run, restored after."""
    timm_modules = timm_leaves()[0]
    saved = []
    try:
        for name, m in model.named_modules():
            leaf = is_leaf(m, timm_modules)
            saved.append((m, m.__dict__.get("forward", _MISSING)))
            m.__dict__["forward"] = recorder.module_forward(m, name, leaf, m.forward)
        yield
    finally:
        for m, before in saved:
            if before is _MISSING:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = before


_MISSING = object()


def _nodes_of(recorder: _Recorder, t: Tensor) -> list[fx.Node]:
    """The recorded nodes of ``t`` and of the tensor it is a view of (kept alive with it)."""
    found = []
    for tensor in (t, t._base):
        node = recorder.node_of.get(tensor) if tensor is not None else None
        if node is not None and node.op not in ("get_attr", "placeholder"):
            found.append(node)
    return found


def _held_by_python(recorder: _Recorder, known: set[fx.Node]) -> list[fx.Node]:
    """The nodes of the recorded tensors that Python objects still hold after the run (a
    closure, a hook's dict, a global), but those in ``known``. Tensors only autograd holds
    (saved for the backward of a tensor kept somewhere) or a view holds as its base are not
    held here: no code reads them (a view's holder is found itself)."""
    candidates = [(ref, node) for ref, node in list(recorder.node_of.data.items())
                  if node.op not in ("get_attr", "placeholder") and node not in known]
    if all(ref() is None for ref, _ in candidates):
        return []  # (no collection needed: the common case)
    gc.collect()  # what forward dropped is gone, cycles (a caught traceback) included
    alive = [t for t in (ref() for ref, _ in candidates) if t is not None]
    by_id = {id(t): t for t in alive}
    # one scan of the heap for all of them (one per tensor took 0.11 s each once
    # transformers was imported); then which tensors each holder holds
    here = sys._getframe()
    held_ids: set[int] = set()
    for holder in gc.get_referrers(*alive):
        if holder is here or holder is alive or holder is by_id:
            continue
        held_ids.update(id(x) for x in gc.get_referents(holder) if id(x) in by_id)
    held = []
    for t in alive:
        if id(t) in held_ids:
            held.extend(n for n in _nodes_of(recorder, t) if n not in held)
    del alive, by_id
    return held


def record(model: nn.Module, args: tuple, training: bool,
           count_saves: bool = False, kwargs: dict[str, Any] | None = None
           ) -> tuple[Traced, Any, dict[str, Any]]:
    """Run ``model(*args, **kwargs)`` once in training or eval mode and record its graph (see the
    module's docstring). The caller keeps the model's state (``trial_runs.preserved``) and
    randomness (``same_randomness``). With ``count_saves``, the tensors saved for backward
    are attributed to the node that saved them (:func:`iabn.memory.attributing_saves`).

    Returns ``(traced, saves, norm_inputs)``: the graph, escapes and value reads; the
    attributed saves (``None`` without ``count_saves``); each norm call's input storage."""
    recorder = _Recorder(model)
    model.train(training)
    inputs = []
    kwargs = kwargs or {}
    for i, value in enumerate(tree_leaves((args, kwargs))):
        if isinstance(value, Tensor):
            node = recorder.graph.placeholder(f"input_{i}")
            node.meta["data"] = True
            recorder.node_of[value] = node
            inputs.append(node)
    saves = None
    with _wrapped_forwards(model, recorder):
        if count_saves:
            with (attributing_saves(lambda: recorder.current, state_keys(model)) as saves,
                  recorder):
                result = model(*args, **kwargs)
        else:
            with recorder:
                result = model(*args, **kwargs)
    output = recorder.graph.output(recorder.nodes(result))
    kinds = hook_kinds(model)
    if kinds:  # the model's own hooks get its inputs and outputs
        add_escape(recorder.escapes, [*inputs, *output.all_input_nodes],
                   f"passed to {' and '.join(kinds)} of the model", may_write=True,
                   needs_class=True)
    stored = {}
    for t, where in attribute_values(model, Tensor):
        for node in _nodes_of(recorder, t):
            stored.setdefault(node, where)
    for node, where in stored.items():
        add_escape(recorder.escapes, [node], f"stored as module attribute `{where}`",
                   may_write=False, needs_class=True)
    del result
    for node in _held_by_python(recorder, set(stored)):
        add_escape(recorder.escapes, [node], "kept outside the graph (by a hook, a closure or "
                   "a global)", may_write=True, needs_class=True)
    traced = Traced(recorder.graph, recorder.escapes, "recorded run",
                    tuple(recorder.value_reads), recorder.calls)
    return traced, saves, recorder.norm_inputs
