"""Putting the decided layers into the model: by swapping modules where that expresses every
decision, else as a ``torch.fx`` module generated from the traced graphs."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable

from torch import fx, nn

from ..distributed import ABNSync, InPlaceABNSync
from ..layers.batch_norm import ABN, InPlaceABN
from ..layers.group_norm import GroupNormAct, InPlaceGroupNormAct
from ..layers.rebuild import rebuilt_as
from .decide import IN_PLACE, OUTPUT_ONLY, Decision
from .graph import Site


def new_layer(norm: nn.Module, decision: Decision) -> ABN | GroupNormAct:
    """The iabn layer for ``norm``, holding norm's very parameter and buffer tensors (so an
    optimizer built on them and ``requires_grad`` flags carry over)."""
    in_place = decision.layer in (IN_PLACE, OUTPUT_ONLY)
    kwargs = {"overwrite_input": decision.layer == IN_PLACE} if in_place else {}
    if type(norm) is nn.GroupNorm:
        cls = InPlaceGroupNormAct if in_place else GroupNormAct
    else:
        sync = type(norm) is nn.SyncBatchNorm
        cls = ((InPlaceABNSync if in_place else ABNSync) if sync
               else (InPlaceABN if in_place else ABN))
        if sync:
            kwargs["group"] = norm.process_group
    return rebuilt_as(norm, cls, decision.activation, decision.activation_param, **kwargs)


def _references(model: nn.Module) -> Counter:
    """How many places in the module tree hold each module object."""
    return Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))


def removal_obstacle(model: nn.Module, graphs: list[fx.Graph]) -> Callable[[fx.Node], str | None]:
    """For an activation node of ``graphs``: why swapping modules cannot remove it, or ``None``.

    A fused activation is removed by replacing its module with ``nn.Identity``; that is only
    right when the module is called for this norm alone: held once in the model and called
    once in every graph. A functional activation (``F.relu(x)``) has no module to replace."""
    references = _references(model)
    calls = [Counter(n.target for n in g.nodes if n.op == "call_module") for g in graphs]

    def obstacle(node: fx.Node) -> str | None:
        if node.op != "call_module":
            return "it is a function call in forward, not a module"
        module = model.get_submodule(node.target)
        if references[id(module)] > 1 or any(c[node.target] > 1 for c in calls):
            return f"its module '{node.target}' is shared with other calls"
        return None
    return obstacle


def swap_obstacle(model: nn.Module, graphs: list[fx.Graph], fused: list[Site]) -> str | None:
    """Why swapping modules cannot express the fusions in ``fused``, or ``None``."""
    obstacle = removal_obstacle(model, graphs)
    for site in fused:
        node = site.activation_node
        if node is None:
            continue  # inside the norm module itself (timm's BatchNormAct2d)
        if node.op != "call_module":
            return f"{site.norm}'s activation is written as {site.activation.written_as} in forward"
        if obstacle(node) is not None:
            return f"{site.norm}'s activation module '{node.target}' is shared with other calls"
    return None


def swap(model: nn.Module, layers: dict[str, ABN], fused: list[Site]) -> nn.Module:
    """``model`` with each norm replaced by its new layer and fused activation modules by
    ``nn.Identity`` (modified in place and returned)."""
    for name, layer in layers.items():
        model.set_submodule(name, layer)
    for site in fused:
        if site.activation_node is not None:
            model.set_submodule(site.activation_node.target, nn.Identity())
    return model


class TrainEvalGraphModule(fx.GraphModule):
    """A ``GraphModule`` with one graph per mode, switched by ``train()``/``eval()``.

    Tracing fixes every ``if self.training:`` of the model's code, so a model whose forward
    branches on the mode (auxiliary heads, stochastic depth) needs both graphs. Pickling a
    whole module keeps only the current mode's graph (``torch.fx``'s own format); save the
    ``state_dict`` instead.
    """

    def __init__(self, root: nn.Module, train_graph: fx.Graph, eval_graph: fx.Graph,
                 class_name: str, constants: nn.Module | None = None) -> None:
        # The tracer keeps tensor constants of the code as attributes of the module it traced
        # (``constants``, when that is not ``root``).
        if constants is not None:
            for graph in (train_graph, eval_graph):
                for node in graph.nodes:
                    if node.op == "get_attr" and not _has(root, node.target):
                        _copy(constants, root, node.target, dict(root.named_modules()))
        super().__init__(root, train_graph if root.training else eval_graph, class_name)
        # GraphModule copies the modules and tensors its graph uses, under their own names;
        # add those only the other graph uses, and any whose parameters no graph uses, so the
        # state_dict keys are the original model's.
        have = dict(self.named_modules())
        for graph in (train_graph, eval_graph):
            for node in graph.nodes:
                if node.op in ("call_module", "get_attr"):
                    _copy(root, self, node.target, have)
        own = set(self.state_dict())
        for key in root.state_dict():
            if key not in own:
                _copy(root, self, key.rpartition(".")[0] or key, have)
        self.__dict__["_graphs"] = {True: train_graph, False: eval_graph}

    def __deepcopy__(self, memo: dict) -> TrainEvalGraphModule:
        # GraphModule's deepcopy rebuilds the module from its current graph only
        result = super().__deepcopy__(memo)
        result.__dict__["_graphs"] = copy.deepcopy(self.__dict__["_graphs"], memo)
        return result

    def train(self, mode: bool = True) -> TrainEvalGraphModule:
        graphs = self.__dict__.get("_graphs")
        if graphs is not None and mode != self.training:
            self.graph = graphs[mode]  # GraphModule's setter regenerates forward
        return super().train(mode)


def _has(module: nn.Module, path: str) -> bool:
    for part in path.split("."):
        if not hasattr(module, part):
            return False
        module = getattr(module, part)
    return True


def _copy(source: nn.Module, target: nn.Module, path: str, have: dict[str, nn.Module]) -> None:
    """Make ``target.<path>`` the object ``source.<path>`` is, creating empty parents."""
    if not path or path in have:
        return
    *parents, field = path.split(".")
    source_parent, target_parent, walked = source, target, []
    for part in parents:
        walked.append(part)
        source_parent = getattr(source_parent, part)
        name = ".".join(walked)
        if name not in have:
            have[name] = nn.Module()
            setattr(target_parent, part, have[name])
        target_parent = have[name]
        if target_parent is source_parent:
            return  # the whole parent is already in place
    value = getattr(source_parent, field)
    if isinstance(value, nn.Module):
        have[path] = value
        setattr(target_parent, field, value)
    elif isinstance(value, nn.Parameter):
        target_parent.register_parameter(field, value)
    else:
        persistent = field not in source_parent._non_persistent_buffers_set
        target_parent.register_buffer(field, value, persistent=persistent)


def fuse_in_graph(graph: fx.Graph, fused: list[Site]) -> None:
    """Remove the fused activations' nodes: their users read the norm's output instead."""
    for site in fused:
        node = site.activation_node
        if node is not None and node.graph is graph:
            node.replace_all_uses_with(site.node)
            graph.erase_node(node)
    graph.lint()


def replace_calls(graph: fx.Graph, calls: dict[str, tuple[nn.Module, list[fx.Node]]]) -> None:
    """Make each replaced call of ``graph`` (an activation written as a function) a call of
    its new module, on the call's first argument (the function's other arguments are the
    module's settings). The new modules are put on the generated module's root, which the
    graph's owning module (the original's, from counting bytes) does not have."""
    for name, (_layer, nodes) in calls.items():
        for node in nodes:
            if node.graph is graph:
                with graph.inserting_before(node):
                    call = graph.create_node("call_module", name, (node.args[0],))
                node.replace_all_uses_with(call)
                graph.erase_node(node)


def as_graph_module(model: nn.Module, layers: dict[str, nn.Module], graphs: dict[bool, fx.Graph],
                    fused: list[Site], traced: nn.Module,
                    calls: dict[str, tuple[nn.Module, list[fx.Node]]] | None = None
                    ) -> TrainEvalGraphModule:
    """The graphs (traced on ``traced``, a copy of ``model``) with fused activations removed
    and the ``calls`` replaced by their new modules (put on ``model`` under their names), as
    a module over ``model``'s submodules with the norms replaced."""
    for name, layer in layers.items():
        model.set_submodule(name, layer)
    for name, (layer, _nodes) in (calls or {}).items():
        model.add_module(name, layer)
    for graph in graphs.values():
        fuse_in_graph(graph, fused)
        replace_calls(graph, calls or {})
    return TrainEvalGraphModule(model, graphs[True], graphs[False], type(model).__name__,
                                constants=traced)
