"""Tracing a model and reading, for each normalisation call, what the conversion must know.

The model is traced with ``torch.fx`` in training *and* eval mode (code may branch on
``self.training``: auxiliary heads, stochastic depth). The tracer keeps what a plain
``symbolic_trace`` loses and the safety rules need: ``x += y`` is recorded as the in-place
``operator.iadd`` (``torch.fx.Proxy`` has no ``__iadd__``, so Python falls back to ``x = x + y``
and the graph would show a fresh tensor where the code mutates one). Normalisation layers,
iabn's layers and timm's untraceable modules are leaves.

For every call of a normalisation module, :func:`find_sites` records the facts the decision
needs (docs/design.md, "Converting existing models"):

- the activation that alone consumes its output, if one does;
- whether its input is *fresh*: produced by an operation that allocates a new tensor and does
  not keep it for its own backward (convolution, linear, add, concatenation), used by nothing
  else, and not a graph input — only then may an in-place layer overwrite it;
- whether anything writes into its (or its activation's) output later: the in-place layer and
  ``ABN`` keep that output for backward, so a later in-place write would break backward. Writes
  are followed through every operation not known to return a new tensor (a view, ``dropout``
  in eval mode, ``.to()`` to the same type and ``nn.Identity`` return their input or a view of
  it);
- which traced values *escape* the graph (:class:`Escape`): kept in a module attribute, given to
  a hook, or otherwise still referenced when tracing ends. An escape counts as one more user.
"""

from __future__ import annotations

import contextvars
import gc
import inspect
import operator
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.proxy import Attribute
from torch.nn.modules import module as _module_globals
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd
from torch.utils._pytree import tree_leaves

from ..kernels import activations as registry
from ..layers import activation as activation_layers
from ..layers import layer_norm as layer_norms
from ..layers.activation import activation_layer, has_activation_layer
from ..layers.batch_norm import ABN
from ..layers.group_norm import GroupNormAct
from .recognise import NormForm, Recognised, is_candidate_class, recognise


def _layer_classes(*modules: Any) -> tuple[type, ...]:
    """The module classes defined in ``modules`` that have ``overwrite_input``."""
    return tuple(value for module in modules for value in vars(module).values()
                 if isinstance(value, type) and issubclass(value, nn.Module)
                 and value.__module__ == module.__name__ and hasattr(value, "overwrite_input"))


#: iabn's layers that replace a module on their own (:mod:`iabn.conversion.layers`): every
#: layer of :mod:`iabn.layers.layer_norm` and :mod:`iabn.layers.activation` (read off the
#: modules, so a layer added there is one without a change here).
OWN_LAYERS = _layer_classes(layer_norms, activation_layers)

#: Python's in-place operators, which fx would otherwise record as their out-of-place forms.
INPLACE_OPERATORS = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv,
    "__imod__": operator.imod, "__ipow__": operator.ipow, "__iand__": operator.iand,
    "__ior__": operator.ior, "__ixor__": operator.ixor, "__ilshift__": operator.ilshift,
    "__irshift__": operator.irshift, "__imatmul__": operator.imatmul,
}
_MUTATING_FUNCTIONS = {*INPLACE_OPERATORS.values(), operator.setitem}


class _Proxy(fx.Proxy):
    """An ``fx.Proxy`` that records Python's augmented assignments as in-place calls."""


def _inplace_method(function):
    def method(self, other):
        return self.tracer.create_proxy("call_function", function, (self, other), {})
    return method


for _name, _function in INPLACE_OPERATORS.items():
    setattr(_Proxy, _name, _inplace_method(_function))


def timm_leaves() -> tuple[tuple[type, ...], list[Any]]:
    """timm's own "do not trace" modules and functions, when timm is already imported."""
    if "timm" not in sys.modules:
        return (), []
    try:
        from timm.layers import _fx
        return tuple(_fx.get_notrace_modules()), list(_fx.get_notrace_functions())
    except (ImportError, AttributeError):  # an older or newer timm without this registry
        return (), []


@dataclass(frozen=True)
class Escape:
    """A traced value that something outside the graph gets: the conversion must neither
    overwrite it (an in-place layer writes into its input) nor remove it (a fused activation
    removes the norm's own output)."""

    how: str            # e.g. "stored as module attribute `features`", for the report
    may_write: bool     # given to code iabn cannot vet (a hook), which may write into it
    needs_class: bool   # only the model's own forward reproduces it, not a generated fx module


#: (attribute, words) of the hooks that get a module's inputs or outputs (or wrap them: a
#: full backward hook puts its outputs through an autograd function of its own).
_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
          ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))


def hook_kinds(m: nn.Module) -> list[str]:
    """The kinds of hooks that run when ``m`` is called: its own and the global module hooks."""
    kinds = [f"a {words}" for name, words in _HOOKS if getattr(m, name, None)]
    kinds += [f"a global {words}" for name, words in _HOOKS
              if getattr(_module_globals, f"_global{name}", None)]
    return kinds


def add_escape(escapes: dict[fx.Node, Escape], nodes: list[fx.Node], how: str, may_write: bool,
               needs_class: bool) -> None:
    """Record that ``nodes`` escape: the first description stays, the effects add up."""
    for node in nodes:
        known = escapes.get(node)
        escapes[node] = (Escape(how, may_write, needs_class) if known is None else
                         Escape(known.how, known.may_write or may_write,
                                known.needs_class or needs_class))


def is_leaf(m: nn.Module, timm_modules: tuple[type, ...]) -> bool:
    """Whether a graph shows a call of ``m`` as one ``call_module`` node: normalisation layers,
    iabn's layers, timm's "do not trace" modules, and (as fx's default) PyTorch's own modules
    but ``nn.Sequential``."""
    if (isinstance(m, (_BatchNorm, ABN, GroupNormAct, *OWN_LAYERS))
            or is_norm_act(m) or is_layer_site(m)):
        return True
    if timm_modules and isinstance(m, timm_modules):
        return True
    module = type(m).__module__
    return (module.startswith(("torch.nn", "torch.ao.nn"))
            and not isinstance(m, nn.Sequential))


class Tracer(fx.Tracer):
    """``fx.Tracer`` with in-place operators recorded, normalisation layers as leaves, and the
    traced values that escape the graph found (:attr:`escapes`, complete after :func:`trace`)."""

    def __init__(self) -> None:
        self._timm_modules, functions = timm_leaves()
        super().__init__(autowrap_functions=tuple(functions))
        self.escapes: dict[fx.Node, Escape] = {}
        self._proxies: list[weakref.ref] = []

    def proxy(self, node: fx.Node) -> fx.Proxy:
        proxy = _Proxy(node, self)
        self._proxies.append(weakref.ref(proxy))
        return proxy

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return is_leaf(m, self._timm_modules)

    def call_module(self, m: nn.Module, forward, args: tuple, kwargs: dict) -> Any:
        result = super().call_module(m, forward, args, kwargs)
        kinds = hook_kinds(m)
        if kinds:
            # A leaf's hooks run when the converted model calls the same module; a traced
            # module's hooks ran now, on proxies, and only the model's own forward runs them.
            name = self.path_of_module(m)
            self.escape((args, kwargs, result), f"passed to {' and '.join(kinds)} of `{name}`",
                        may_write=True, needs_class=not self.is_leaf_module(m, name))
        return result

    def escape(self, values: Any, how: str, may_write: bool, needs_class: bool) -> None:
        """Record the nodes of this trace among ``values`` (proxies or nodes, nested)."""
        nodes = [value.node if isinstance(value, fx.Proxy) and value.tracer is self else value
                 for value in tree_leaves(values)]
        add_escape(self.escapes, [n for n in nodes if isinstance(n, fx.Node)
                                  and n.graph is self.graph], how, may_write, needs_class)

    def find_kept(self, root: nn.Module) -> None:
        """After tracing, every proxy still alive is kept by something outside the graph: a
        module attribute (named in the report), a hook's closure, a global."""
        if not any(r() is not None for r in self._proxies):
            return
        gc.collect()  # proxies only in reference cycles (a traceback, a frame) are not kept
        alive = [p for p in (r() for r in self._proxies) if p is not None]
        if not alive:
            return
        stored = _stored_proxies(root)
        for proxy in alive:
            where = stored.get(id(proxy))
            if where is not None:
                self.escape(proxy, f"stored as module attribute `{where}`", may_write=False,
                            needs_class=True)
            else:
                self.escape(proxy, "kept outside the graph (by a hook, a closure or a global)",
                            may_write=True, needs_class=True)


def attribute_values(root: nn.Module, kind: type, depth: int = 4) -> Iterator[tuple[Any, str]]:
    """The values of type ``kind`` held in ``root``'s modules' attributes (not their modules,
    parameters, buffers nor a ``forward`` put on the instance), inside lists, tuples and
    dicts up to ``depth`` levels, each with where it is (``"name.attribute[0]"``)."""

    def visit(value: Any, path: str, level: int) -> Iterator[tuple[Any, str]]:
        if isinstance(value, kind):
            yield value, path
        elif level < depth and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from visit(item, f"{path}[{i}]", level + 1)
        elif level < depth and isinstance(value, dict):
            for key, item in value.items():
                yield from visit(item, f"{path}[{key!r}]", level + 1)

    for name, m in root.named_modules():
        for attribute, value in vars(m).items():
            if attribute not in ("_modules", "_parameters", "_buffers", "forward"):
                yield from visit(value, f"{name}.{attribute}" if name else attribute, 0)


def _stored_proxies(root: nn.Module) -> dict[int, str]:
    """``id(proxy) -> "name.attribute[0]"`` for the proxies held in ``root``'s modules'
    attributes (:func:`attribute_values`); ``h.mT`` stored names ``h`` too (a view of it)."""
    found: dict[int, str] = {}
    for value, path in attribute_values(root, fx.Proxy):
        found.setdefault(id(value), path)
        while isinstance(value, Attribute):
            value = value.root
            found.setdefault(id(value), path)
    return found


class Traced(NamedTuple):
    graph: fx.Graph
    escapes: dict[fx.Node, Escape]
    #: "torch.fx" (a symbolic trace: every input takes this graph) or "recorded run" (one
    #: forward on the example input, :mod:`iabn.conversion.recording`)
    source: str = "torch.fx"
    #: where a recorded forward read tensor values into Python ("item at model.py:12"): other
    #: inputs may take other paths there
    value_reads: tuple[str, ...] = ()
    #: of a recorded run: for each module called (qualified name), one entry per call saying
    #: whether tensor values were read during it
    calls: dict[str, list[bool]] | None = None


def trace(model: nn.Module, training: bool) -> Traced:
    """The graph of ``model``'s forward in training or eval mode (every module's mode is
    restored), and the values that escape it. The tracer keeps the tensor constants of the
    code as new attributes of ``model`` (``_tensor_constant0``...), which the graph's
    ``get_attr`` nodes name, and values that forward stores on modules stay there as proxies:
    trace a copy when that matters."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        tracer = Tracer()
        graph = tracer.trace(model)
    finally:
        for m, mode in modes:
            m.training = mode
    kinds = hook_kinds(model)
    if kinds:  # the model's own hooks get its inputs and outputs; a generated module has none
        tracer.escape([n if n.op == "placeholder" else n.args for n in graph.nodes
                       if n.op in ("placeholder", "output")],
                      f"passed to {' and '.join(kinds)} of the model", may_write=True,
                      needs_class=True)
    tracer.find_kept(model)
    return Traced(graph, tracer.escapes)


# ------------------------------------------------------------------ normalisation layers

#: The norm classes converted, exact types: a subclass may have changed ``forward``.
#: ``nn.GroupNorm`` becomes :class:`iabn.InPlaceGroupNormAct` / :class:`iabn.GroupNormAct`
#: under the same rules.
NORM_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.GroupNorm)


def is_norm_act(m: nn.Module) -> bool:
    """timm's ``BatchNormAct2d`` (batch norm, dropout, activation in one module)."""
    return type(m).__name__ == "BatchNormAct2d" and type(m).__module__.startswith("timm.")


def is_convertible_norm(m: nn.Module) -> bool:
    return type(m) in NORM_CLASSES or is_norm_act(m)


# ------------------------------------------------------------------ layers of their own

#: timm's and torchvision's modules that compute what a PyTorch module computes (their
#: ``forward`` read in timm 1.0.31 and torchvision 0.29: ``F.layer_norm``; ``F.layer_norm``
#: between two permutes; ``x * rsqrt(mean(x^2) + eps) * weight``; ``F.gelu``), by
#: ``(module, class name)``, unless their ``_fast_norm`` is set (then they call apex or cast
#: to autocast's dtype, which iabn does not reproduce).
_TIMM_KINDS = {
    ("timm.layers.norm", "LayerNorm"): "layer_norm",
    ("timm.layers.norm", "LayerNorm2d"): "layer_norm_2d",
    ("timm.layers.norm", "RmsNorm"): "rms_norm",
    # torchvision's ConvNeXt: F.layer_norm between the same two permutes (torchvision 0.29)
    ("torchvision.models.convnext", "LayerNorm2d"): "layer_norm_2d",
}
#: timm's activation modules that compute what a ``torch.nn`` module computes (``forward``
#: read in timm 1.0.31: ``F.gelu(input)``, ``F.gelu(input, approximate="tanh")``), by
#: ``(module, class name)``: the ``torch.nn`` module standing for them
#: (:func:`torch_equivalent`), the only place the conversion knows them.
_TIMM_ACTIVATIONS: dict[tuple[str, str], Callable[[nn.Module], nn.Module]] = {
    ("timm.layers.activations", "GELU"): lambda m: nn.GELU(),
    ("timm.layers.activations", "GELUTanh"): lambda m: nn.GELU(approximate="tanh"),
}


def torch_equivalent(m: nn.Module) -> nn.Module:
    """``m`` itself, or for one of timm's activation modules or a module recognised by what
    it computes (:mod:`.recognise`: Hugging Face's ``GELUActivation``,
    ``NewGELUActivation``, ``SiLUActivation``...) the ``torch.nn`` module that computes
    what it computes: what the registry recognises and the layers derive from."""
    cls = type(m)
    make = _TIMM_ACTIVATIONS.get((cls.__module__, cls.__name__))
    if make is not None:
        return make(m)
    found = recognised(m)
    return found if isinstance(found, nn.Module) else m


def _known_class(m: nn.Module) -> bool:
    cls = type(m)
    return (cls in (nn.LayerNorm, getattr(nn, "RMSNorm", None))
            or (cls.__module__, cls.__name__) in _TIMM_KINDS
            or (cls.__module__, cls.__name__) in _TIMM_ACTIVATIONS)


def recognition(m: nn.Module) -> Recognised | None:
    """:func:`.recognise.recognise` of a module of a class the conversion does not know by
    name (``None`` for the known ones and those that are no candidate)."""
    if (_known_class(m) or type(m) in registry.MODULE_FORMS or not is_candidate_class(m)
            or getattr(m, "_fast_norm", False)):
        return None
    return recognise(m)


def recognised(m: nn.Module) -> NormForm | nn.Module | None:
    """What :func:`recognition` found ``m`` computes, if anything."""
    found = recognition(m)
    return None if found is None else found.found


def norm_form(m: nn.Module) -> NormForm | None:
    """What a layer or RMS norm that iabn replaces by a layer of its own computes: the
    known classes' (``nn.LayerNorm``, ``nn.RMSNorm``, timm's and torchvision's, their
    ``eps`` and bias) or a recognised module's form; ``None`` for anything else."""
    cls = type(m)
    kind = None
    if cls is nn.LayerNorm:
        kind = "layer_norm"
    elif cls is getattr(nn, "RMSNorm", None):
        kind = "rms_norm"
    else:
        known = _TIMM_KINDS.get((cls.__module__, cls.__name__))
        if known is not None and getattr(m, "_fast_norm", False) is False:
            kind = known
    if kind is not None:
        return NormForm(kind, m.eps, getattr(m, "bias", None) is not None)
    found = recognised(m)
    return found if isinstance(found, NormForm) else None


def layer_kind(m: nn.Module) -> str | None:
    """What a normalisation that iabn replaces by a layer of its own (not fused with an
    activation) computes: ``"layer_norm"`` (``nn.LayerNorm``, timm's ``LayerNorm``),
    ``"layer_norm_2d"`` (timm's ``LayerNorm2d``: over dim 1), ``"rms_norm"``
    (``nn.RMSNorm``, timm's ``RmsNorm``), or ``None``. Exact classes (a subclass may have
    changed ``forward``), or modules recognised by what they compute (:func:`norm_form`)."""
    form = norm_form(m)
    return None if form is None else form.kind


def activation_kind(m: nn.Module) -> str | None:
    """The registry's name of the activation a module computes where the conversion decides
    about it on its own (:func:`stands_alone`), else ``None``."""
    found = module_activation(m)
    return found.name if stands_alone(found) else None


def is_layer_site(m: nn.Module) -> bool:
    """A module :mod:`iabn.conversion.layers` may replace on its own: a layer or RMS norm,
    or an activation :func:`stands_alone` names."""
    return layer_kind(m) is not None or activation_kind(m) is not None


def is_site_module(m: nn.Module) -> bool:
    """A module the conversion decides about: a convertible norm or a layer site."""
    return is_convertible_norm(m) or is_layer_site(m)


def is_site_node(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """A graph node the conversion decides about: a call of a site module, or an activation
    written as a function or method (``F.gelu(x)``, ``x.relu()``) that :func:`stands_alone`
    names."""
    if node.op == "call_module":
        return is_site_module(modules[node.target])
    return node.op in ("call_function", "call_method") and stands_alone(
        node_activation(node, modules))


def site_key(node: fx.Node) -> str:
    """How the conversion names a site's call in both graphs: a module's qualified name, a
    function call's node name."""
    return node.target if node.op == "call_module" else node.name


# ------------------------------------------------------------------ activations


@dataclass(frozen=True)
class Activation:
    """An activation as iabn's layers name it, and how the model wrote it."""

    name: str           # a name of the registry (iabn.kernels.activations), or the
                        # unsupported one's
    param: float        # leaky_relu's slope, elu's alpha, else 0.0
    written_as: str     # e.g. "ReLU", "F.relu", ".relu_()" (for the report)
    supported: bool = True


def _bound(function, node: fx.Node) -> dict[str, Any] | None:
    try:
        return inspect.signature(function).bind(*node.args, **node.kwargs).arguments
    except (TypeError, ValueError):
        return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def module_activation(m: nn.Module) -> Activation | None:
    """The activation a module computes, if it is one iabn's layers can fuse (the registry's
    module forms: exact type and condition, e.g. ``nn.GELU`` with ``approximate="none"``;
    timm's through :func:`torch_equivalent`)."""
    found = registry.module_activation(torch_equivalent(m))
    if found is None:
        return None
    name, param = found
    return Activation(name, float(param), type(m).__name__)


def torch_module(found: Activation) -> nn.Module:
    """The ``torch.nn`` module of ``found``'s registry record (its ``torch_module``)."""
    return registry.ACTIVATIONS[found.name].torch_module(found.param)


def stands_alone(found: Activation | None) -> bool:
    """Whether the conversion decides about this activation on its own where no norm absorbs
    it: its record has an in-place layer (:func:`iabn.layers.activation.has_activation_layer`
    of the record's ``torch.nn`` module), or one minimum (its PyTorch backward keeps the
    input, which only a bit per element recovers: without a layer of its own it stays, with
    that reason). Invertible activations without a layer are no site: fused with a norm or
    left as they are."""
    if found is None or not found.supported:
        return False
    record = registry.ACTIVATIONS.get(found.name)
    return record is not None and (record.needs_branch
                                   or has_activation_layer(torch_module(found)))


def standalone_layer(found: Activation, *, overwrite_input: bool) -> nn.Module | None:
    """iabn's in-place layer computing ``found`` (module, function or method form):
    :func:`iabn.layers.activation.activation_layer` of the record's ``torch.nn`` module;
    ``None`` where there is none."""
    return activation_layer(torch_module(found), overwrite_input=overwrite_input)


def _call_arguments(function, form: registry.FunctionForm, parameter, node: fx.Node
                    ) -> dict[str, Any] | None:
    """The call's arguments by name: bound to the function's signature, or for a builtin
    without one (``F.gelu``, ``F.leaky_relu_``) the positional ones after the input taken as
    the parameter's keyword, then the required keywords, in order."""
    arguments = _bound(function, node)
    if arguments is not None:
        return arguments
    names = ([parameter.keyword] if parameter is not None else []) + [k for k, _ in
                                                                       form.required]
    if len(node.args) - 1 > len(names) or set(node.kwargs) - set(names):
        return None
    return {**dict(zip(names, node.args[1:], strict=False)), **node.kwargs}


def node_activation(node: fx.Node, modules: dict[str, nn.Module]) -> Activation | None:
    """The fusable activation ``node`` computes on its first argument, or ``None`` (the
    registry's module, function and tensor-method forms)."""
    if node.op == "call_module":
        return module_activation(modules[node.target])
    if node.op == "call_function":
        forms = registry.function_forms(node.target)
        if not forms:
            return None
        record, form = forms[0]  # the records of one function share its signature
        arguments = _call_arguments(node.target, form, record.parameter, node)
        # the records sharing a function (F.gelu: gelu, gelu_tanh) differ by keyword values
        hit = None if arguments is None else registry.function_activation(node.target,
                                                                          arguments)
        if hit is None:
            return None
        record, form = hit
        if record.parameter is None:
            return Activation(record.name, 0.0, form.display)
        param = _number(arguments.get(record.parameter.keyword, record.parameter.default))
        return None if param is None else Activation(record.name, param, form.display)
    if node.op == "call_method" and node.target in registry.METHOD_FORMS and len(node.args) == 1:
        return Activation(registry.METHOD_FORMS[node.target].name, 0.0, f".{node.target}()")
    return None


def describe(node: fx.Node, modules: dict[str, nn.Module]) -> str:
    """A short name of what ``node`` computes, for the report."""
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op == "call_method":
        return f".{node.target}()"
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return node.op


# ------------------------------------------------------------------ safety facts

#: Producers whose output is a new tensor that their own backward does not read.
_FRESH_FUNCTIONS = {
    F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
    F.linear, torch.conv1d, torch.conv2d, torch.conv3d, operator.add, operator.sub,
    torch.add, torch.sub, torch.cat, torch.concat,
}
_FRESH_METHODS = {"add", "sub"}

#: Operations known to return a new tensor (never their argument itself nor a view of it, at
#: any setting: ``F.pad`` by 0, pooling of size 1 and ``x + 0`` copy; checked in
#: tests/conversion/test_convert_aliases.py). Every other operation may return its input or a
#: view of it (views, ``dropout`` in eval mode or with ``p=0``, ``.to()``/``.contiguous()`` when
#: nothing changes, ``nn.Identity``, ``+x``, ``einsum``), so a write into its result may be a
#: write into its input.
_NEW_FUNCTIONS = {
    *_FRESH_FUNCTIONS,
    operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.matmul, operator.neg, operator.abs, operator.lt, operator.le, operator.gt,
    operator.ge, operator.eq, operator.ne,
    torch.concatenate, torch.stack, torch.mul, torch.div, torch.matmul, torch.mm, torch.bmm,
    torch.sum, torch.mean, torch.relu, torch.sigmoid, torch.tanh, torch.exp, torch.log,
    torch.sqrt, torch.rsqrt, torch.abs, torch.neg, torch.clamp, torch.clip, torch.softmax,
    torch.log_softmax, torch.where, torch.maximum, torch.minimum,
    F.bilinear, F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish,
    F.hardswish, F.hardsigmoid, F.hardtanh, F.sigmoid, F.tanh, F.softplus, F.softmax,
    F.log_softmax, F.glu, F.prelu,
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
    F.interpolate, F.pad, F.pixel_shuffle, F.pixel_unshuffle, F.batch_norm, F.layer_norm,
    F.group_norm, F.instance_norm, F.normalize, F.scaled_dot_product_attention,
}
_NEW_METHODS = {
    "add", "sub", "mul", "div", "matmul", "pow", "neg", "abs", "exp", "log", "sqrt", "rsqrt",
    "sigmoid", "tanh", "relu", "softmax", "log_softmax", "sum", "mean", "amax", "amin", "clamp",
    "clip", "clone", "masked_fill",
    # metadata: no tensor at all
    "size", "dim", "numel", "stride", "is_contiguous", "item", "tolist",
}
#: ``x.shape`` and the like: ``getattr`` of these names is no tensor.
_METADATA = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}
#: PyTorch's own modules (exact classes from these files) that return a new tensor; in-place
#: variants (``inplace=True``) are writes. Not ``torch.nn.modules.linear`` as a whole: it
#: holds ``nn.Identity``; nor ``dropout``, ``flatten``.
_NEW_MODULE_FILES = {
    f"torch.nn.modules.{name}" for name in (
        "activation", "conv", "pooling", "padding", "upsampling", "pixelshuffle",
        "channelshuffle", "normalization", "batchnorm", "instancenorm")
}
_NEW_MODULES = (nn.Linear, nn.Bilinear, nn.LazyLinear, ABN)


def _returns_new(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        m = modules[node.target]
        if isinstance(m, OWN_LAYERS):
            return not m.overwrite_input
        return isinstance(m, (ABN, GroupNormAct)) or is_layer_site(m) or (
            type(m) in _NEW_MODULES or type(m).__module__ in _NEW_MODULE_FILES)
    if node.op == "call_function":
        if node.target is getattr:
            return len(node.args) > 1 and node.args[1] in _METADATA
        return node.target in _NEW_FUNCTIONS
    if node.op == "call_method":
        return node.target in _NEW_METHODS
    return False


def is_fresh_producer(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[node.target], (_ConvNd, nn.Linear))
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    return False


def _is_torch(module: str) -> bool:
    return module in ("torch", "_operator") or module.startswith("torch.")


def writes_first_argument(node: fx.Node, modules: dict[str, nn.Module]) -> bool | None:
    """True if ``node`` may write into its first argument, False if it provably does not,
    None when unknown (a function or module from outside PyTorch, which iabn does not vet)."""
    if node.op == "output":
        return False
    if node.op == "call_module":
        m = modules[node.target]
        if isinstance(m, OWN_LAYERS):
            return m.overwrite_input
        if getattr(m, "inplace", False) is True or getattr(m, "_in_place", False):
            return True  # an nn module with inplace=True, or iabn's in-place layers
        if isinstance(m, (ABN, GroupNormAct)) or recognised(m) is not None:
            return False  # a recognised module's probes left their input as it was
        # PyTorch's own modules write into their input only through ``inplace``
        return False if _is_torch(type(m).__module__) else None
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op == "call_function":
        target = node.target
        if target in _MUTATING_FUNCTIONS:
            return True
        if target is getattr:  # reads an attribute (``x.T`` is a view: see _returns_new)
            return False
        name = getattr(target, "__name__", "")
        if not _is_torch(getattr(target, "__module__", None) or ""):
            return None
        if name.endswith("_") and not name.startswith("__"):
            return True
        arguments = _bound(target, node)
        return bool(arguments and arguments.get("inplace") is True)
    return None


#: Whether the model's returned outputs count as written (the caller may write into them); the
#: planner, which converts one unit of a model at a time, turns it off for a unit's outputs.
RETURNED_WRITTEN = contextvars.ContextVar("iabn_returned_written", default=True)


def later_write(output: fx.Node, modules: dict[str, nn.Module],
                escapes: dict[fx.Node, Escape]) -> str | None:
    """Why ``output`` may be written after it is produced, or ``None``. Writes are followed
    through every operation that may return its input or a view of it (all but
    :func:`_returns_new`'s), in this graph; code the graph does not show (a hook) and
    functions or modules from outside PyTorch count as writes."""
    pending, seen = [output], {output}
    while pending:
        node = pending.pop()
        via = ("" if node is output else f"the output of {describe(node, modules)}, which may "
               f"return the norm's output or a view of it")
        what = via or "the norm's output"
        escape = escapes.get(node)
        if escape is not None and escape.may_write:
            return f"{what} escapes: {escape.how}, which may write into it"
        for user in node.users:
            if user in seen:
                continue
            if user.op == "output" and RETURNED_WRITTEN.get():  # the caller's: it may write
                return f"{what} is returned by the model (the caller may write into it)"
            writes = writes_first_argument(user, modules)
            if writes is None:
                return (f"{via or 'its output'} goes to {describe(user, modules)}, which iabn "
                        f"cannot vet for in-place writes")
            if user.kwargs.get("out") is node or (writes and user.args and user.args[0] is node):
                return f"{describe(user, modules)} writes into {what} in place"
            if writes or _returns_new(user, modules):
                continue  # an in-place operation returns its first argument, not this one
            seen.add(user)
            pending.append(user)
    return None


@dataclass
class Site:
    """One call of a normalisation module in one traced graph."""

    norm: str                      # the module's qualified name
    node: fx.Node
    activation: Activation | None  # fused with the norm (None: nothing to fuse)
    activation_node: fx.Node | None
    next_op: str | None            # the single consumer when it is not fused (for the report)
    input_fresh: str | None        # None when fresh, else why not
    output_written: str | None     # None when nothing writes the output later, else why
    unfused: str | None = None     # why an activation that follows is not fused
    #: the input is computed in the graph, kept by nothing outside it (nor returned), and read
    #: by other operations too: a layer that does not overwrite it may drop it from memory
    input_reused: bool = False

    @property
    def key(self) -> str:
        """:func:`site_key` of its call: the norm's name."""
        return self.norm


def find_sites(graph: fx.Graph, modules: dict[str, nn.Module],
               escapes: dict[fx.Node, Escape] | None = None,
               unfusable: Callable[[fx.Node], str | None] | None = None) -> list[Site]:
    """Every call of a convertible normalisation module in ``graph``, with its facts.
    ``escapes``: the graph's values that something outside it gets (:func:`trace`).
    ``unfusable``: why an activation node may not be removed, if it may not."""
    escapes = escapes or {}
    sites = []
    for node in graph.nodes:
        if node.op != "call_module" or not is_convertible_norm(modules[node.target]):
            continue
        norm = modules[node.target]
        activation, activation_node, next_op, unfused = None, None, None, None
        if is_norm_act(norm):
            inner = module_activation(norm.act) if type(norm.drop) is nn.Identity else None
            activation = inner or Activation(type(norm.act).__name__, 0.0,
                                             type(norm.act).__name__, supported=False)
        elif len(node.users) == 1:
            (user,) = node.users
            found = node_activation(user, modules) if user.args and user.args[0] is node else None
            # fusing removes the norm's own output: nothing outside the graph may hold it
            why = (f"its output escapes: {escapes[node].how}" if node in escapes
                   else unfusable(user) if found is not None and unfusable else None)
            if found is not None and why is None:
                activation, activation_node = found, user
            else:
                next_op = describe(user, modules)
                if found is not None:
                    unfused = f"the {found.written_as} after it is not fused ({why})"
        output = activation_node or node
        source = node.args[0] if node.args else None
        reused = (isinstance(source, fx.Node) and source.op != "placeholder"
                  and source not in escapes and len(source.users) > 1
                  and all(user.op != "output" for user in source.users))
        sites.append(Site(node.target, node, activation, activation_node, next_op,
                          input_not_fresh(node, modules, escapes),
                          later_write(output, modules, escapes), unfused, reused))
    return sites


def input_not_fresh(node: fx.Node, modules: dict[str, nn.Module],
                     escapes: dict[fx.Node, Escape]) -> str | None:
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return "its input is not a traced tensor"
    if source.op == "placeholder":
        return "its input is the model's input"
    if source in escapes:  # one more user, outside the graph
        return f"its input escapes: {escapes[source].how}"
    others = len(source.users) - 1
    if others:
        return f"its input is also used by {others} other operation{'s' * (others > 1)}"
    if not is_fresh_producer(source, modules):
        return (f"its input comes from {describe(source, modules)}, which may keep or share "
                f"it (in place only after a convolution, linear, add or concatenation)")
    return None
