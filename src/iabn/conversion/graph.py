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
  ``ABN`` keep that output for backward, so a later in-place write would break backward.
"""

from __future__ import annotations

import inspect
import operator
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from ..modules import ABN

#: Python's in-place operators, which fx would otherwise record as their out-of-place forms.
_INPLACE_OPERATORS = {
    "__iadd__": operator.iadd, "__isub__": operator.isub, "__imul__": operator.imul,
    "__itruediv__": operator.itruediv, "__ifloordiv__": operator.ifloordiv,
    "__imod__": operator.imod, "__ipow__": operator.ipow, "__iand__": operator.iand,
    "__ior__": operator.ior, "__ixor__": operator.ixor, "__ilshift__": operator.ilshift,
    "__irshift__": operator.irshift, "__imatmul__": operator.imatmul,
}
_MUTATING_FUNCTIONS = {*_INPLACE_OPERATORS.values(), operator.setitem}


class _Proxy(fx.Proxy):
    """An ``fx.Proxy`` that records Python's augmented assignments as in-place calls."""


def _inplace_method(function):
    def method(self, other):
        return self.tracer.create_proxy("call_function", function, (self, other), {})
    return method


for _name, _function in _INPLACE_OPERATORS.items():
    setattr(_Proxy, _name, _inplace_method(_function))


def _timm_leaves() -> tuple[tuple[type, ...], list[Any]]:
    """timm's own "do not trace" modules and functions, when timm is already imported."""
    if "timm" not in sys.modules:
        return (), []
    try:
        from timm.layers import _fx
        return tuple(_fx.get_notrace_modules()), list(_fx.get_notrace_functions())
    except (ImportError, AttributeError):  # an older or newer timm without this registry
        return (), []


class Tracer(fx.Tracer):
    """``fx.Tracer`` with in-place operators recorded and normalisation layers as leaves."""

    def __init__(self) -> None:
        self._timm_modules, functions = _timm_leaves()
        super().__init__(autowrap_functions=tuple(functions))

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (_BatchNorm, ABN)) or is_norm_act(m):
            return True
        if self._timm_modules and isinstance(m, self._timm_modules):
            return True
        return super().is_leaf_module(m, module_qualified_name)


def trace(model: nn.Module, training: bool) -> fx.Graph:
    """The graph of ``model``'s forward in training or eval mode (every module's mode is
    restored). The tracer keeps the tensor constants of the code as new attributes of
    ``model`` (``_tensor_constant0``...), which the graph's ``get_attr`` nodes name: trace a
    copy when that matters."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        return Tracer().trace(model)
    finally:
        for m, mode in modes:
            m.training = mode


# ------------------------------------------------------------------ normalisation layers

#: The norm classes converted, exact types: a subclass may have changed ``forward``.
NORM_CLASSES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def is_norm_act(m: nn.Module) -> bool:
    """timm's ``BatchNormAct2d`` (batch norm, dropout, activation in one module)."""
    return type(m).__name__ == "BatchNormAct2d" and type(m).__module__.startswith("timm.")


def is_convertible_norm(m: nn.Module) -> bool:
    return type(m) in NORM_CLASSES or is_norm_act(m)


# ------------------------------------------------------------------ activations


@dataclass(frozen=True)
class Activation:
    """An activation as iabn's layers name it, and how the model wrote it."""

    name: str           # "relu", "leaky_relu", "elu", "identity", or the unsupported one's
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


_FUNCTIONAL = {
    # target: (activation, parameter name, default parameter)
    F.relu: ("relu", None, 0.0), F.relu_: ("relu", None, 0.0),
    torch.relu: ("relu", None, 0.0), torch.relu_: ("relu", None, 0.0),
    F.leaky_relu: ("leaky_relu", "negative_slope", 0.01),
    F.leaky_relu_: ("leaky_relu", "negative_slope", 0.01),
    F.elu: ("elu", "alpha", 1.0), F.elu_: ("elu", "alpha", 1.0),
}
_FUNCTION_NAMES = {
    F.relu: "F.relu", F.relu_: "F.relu_", torch.relu: "torch.relu", torch.relu_: "torch.relu_",
    F.leaky_relu: "F.leaky_relu", F.leaky_relu_: "F.leaky_relu_", F.elu: "F.elu",
    F.elu_: "F.elu_",
}


def module_activation(m: nn.Module) -> Activation | None:
    """The activation a module computes, if it is one iabn's layers can fuse."""
    kind = type(m)
    if kind is nn.ReLU:
        return Activation("relu", 0.0, "ReLU")
    if kind is nn.LeakyReLU:
        return Activation("leaky_relu", float(m.negative_slope), "LeakyReLU")
    if kind is nn.ELU:
        return Activation("elu", float(m.alpha), "ELU")
    if kind is nn.Identity:
        return Activation("identity", 0.0, "Identity")
    return None


def node_activation(node: fx.Node, modules: dict[str, nn.Module]) -> Activation | None:
    """The fusable activation ``node`` computes on its first argument, or ``None``."""
    if node.op == "call_module":
        return module_activation(modules[node.target])
    if node.op == "call_function" and node.target in _FUNCTIONAL:
        name, param_name, default = _FUNCTIONAL[node.target]
        arguments = _bound(node.target, node)
        if arguments is None:
            return None
        param = _number(arguments.get(param_name, default)) if param_name else 0.0
        return None if param is None else Activation(name, param, _FUNCTION_NAMES[node.target])
    if node.op == "call_method" and node.target in ("relu", "relu_") and len(node.args) == 1:
        return Activation("relu", 0.0, f".{node.target}()")
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

#: Operations whose result may share memory with their (first) input.
_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute", "transpose",
    "t", "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "chunk", "split",
    "tensor_split", "unbind", "contiguous", "detach", "as_strided", "movedim", "swapaxes",
    "select", "unfold", "__getitem__", "type_as", "to", "float", "half", "bfloat16", "double",
}
_VIEW_FUNCTIONS = {
    operator.getitem, torch.flatten, torch.reshape, torch.transpose, torch.permute,
    torch.squeeze, torch.unsqueeze, torch.chunk, torch.split, torch.tensor_split, torch.narrow,
    torch.unbind, torch.t, torch.movedim, torch.swapaxes, torch.detach, torch.select,
}


def is_fresh_producer(node: fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return isinstance(modules[node.target], (_ConvNd, nn.Linear))
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS
    if node.op == "call_method":
        return node.target in _FRESH_METHODS
    return False


def _writes_first_argument(node: fx.Node, modules: dict[str, nn.Module]) -> bool | None:
    """True if ``node`` may write into its input, False if it provably does not, None when
    unknown (a function or module iabn knows nothing about)."""
    if node.op == "output":
        return False
    if node.op == "call_module":
        m = modules[node.target]
        if getattr(m, "inplace", False) is True or getattr(m, "_in_place", False):
            return True  # an nn module with inplace=True, or iabn's InPlaceABN
        if isinstance(m, ABN):
            return False
        # PyTorch's own modules write into their input only through ``inplace``
        return False if type(m).__module__.startswith("torch.nn") else None
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("__")
    if node.op == "call_function":
        target = node.target
        if target in _MUTATING_FUNCTIONS:
            return True
        name = getattr(target, "__name__", "")
        module = getattr(target, "__module__", None) or ""
        if target in _VIEW_FUNCTIONS or target in _FRESH_FUNCTIONS:
            return False
        if module == "_operator" or module.startswith("torch"):
            if name.endswith("_") and not name.startswith("__"):
                return True
            arguments = _bound(target, node)
            return bool(arguments and arguments.get("inplace") is True)
        return None
    return None


def _is_view(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS)


def later_write(output: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    """Why ``output`` (or a view of it) may be written after it is produced, or ``None``."""
    pending, seen = [output], set()
    while pending:
        node = pending.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if _is_view(user):
                pending.append(user)
                continue
            writes = _writes_first_argument(user, modules)
            if writes is None:
                return (f"its output goes to {describe(user, modules)}, which iabn cannot vet "
                        f"for in-place writes")
            if writes and user.args and user.args[0] is node:
                return f"{describe(user, modules)} writes into the norm's output in place"
    return None


@dataclass
class Site:
    """One call of a normalisation module in one traced graph."""

    norm: str                      # the module's qualified name
    node: fx.Node
    activation: Activation | None  # fused with the norm (None: nothing to fuse)
    activation_node: fx.Node | None
    next_op: str | None            # the single consumer when it is not fusable (for the report)
    input_fresh: str | None        # None when fresh, else why not
    output_written: str | None     # None when nothing writes the output later, else why


def find_sites(graph: fx.Graph, modules: dict[str, nn.Module]) -> list[Site]:
    """Every call of a convertible normalisation module in ``graph``, with its facts."""
    sites = []
    for node in graph.nodes:
        if node.op != "call_module" or not is_convertible_norm(modules[node.target]):
            continue
        norm = modules[node.target]
        activation, activation_node, next_op = None, None, None
        if is_norm_act(norm):
            inner = module_activation(norm.act) if type(norm.drop) is nn.Identity else None
            activation = inner or Activation(type(norm.act).__name__, 0.0,
                                             type(norm.act).__name__, supported=False)
        elif len(node.users) == 1:
            (user,) = node.users
            found = node_activation(user, modules) if user.args and user.args[0] is node else None
            if found is not None:
                activation, activation_node = found, user
            else:
                next_op = describe(user, modules)
        output = activation_node or node
        sites.append(Site(node.target, node, activation, activation_node, next_op,
                          _input_not_fresh(node, modules), later_write(output, modules)))
    return sites


def _input_not_fresh(node: fx.Node, modules: dict[str, nn.Module]) -> str | None:
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return "its input is not a traced tensor"
    if source.op == "placeholder":
        return "its input is the model's input"
    others = len(source.users) - 1
    if others:
        return f"its input is also used by {others} other operation{'s' * (others > 1)}"
    if not is_fresh_producer(source, modules):
        return (f"its input comes from {describe(source, modules)}, which may keep or share "
                f"it (in place only after a convolution, linear, add or concatenation)")
    return None
