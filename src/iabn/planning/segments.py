"""Where a model can be cut: the units a plan decides about.

A *chain* is an ``nn.Sequential`` whose ``forward`` is ``nn.Sequential``'s own (each child's
output is the next child's only input) and which forward calls once: the model itself, or a
module found by walking down from it. Its children are grouped into *units*: a unit starts at
the first child and at every child that has parameters of its own and is not a normalisation
layer (so ``conv, bn, relu, pool`` is one unit, a ResNet block is one). Consecutive units of
a chain form *runs*, which can be recomputed as one segment (checkpointing keeps only the
run's input).

Outside chains, a *single* unit is a module that forward calls exactly once, with tensors as
its only (positional) arguments and a tensor as its output (a ResNet's ``conv1``, ``bn1``,
``maxpool``). Modules that forward calls more than once (a shared activation), with other
arguments, or never, are not units; containers that are never called themselves (an
``nn.ModuleList``) are looked into.

A *traced chain* crosses those containers: when the model's own ``forward`` (not a
``Sequential``) traces with ``torch.fx`` (every unit's modules leaves) to the same graph in
training and in evaluation mode, and its graph holds a path of unit calls in which each call's
only argument is the previous call's output and that output has no other user (ResNet:
``conv1, bn1, relu, maxpool, layer1.0, ..., layer4.2, avgpool``), those units form one more
chain, :attr:`Segmentation.traced`, whose runs may span several containers. Every
``Sequential`` chain on the path is covered whole or not at all (the path is cut at a chain
covered in part). Units keep their own chain (``chain``) as well: a plan without a run across
containers is built as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

_NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


@dataclass
class Unit:
    """One thing a plan decides about.

    ``container`` is the dotted path of the chain (``""``: the model) or of the single
    module's parent; ``children`` the names of its modules there; ``start``/``stop`` their
    positions in the chain (``0, 1`` for a single module); ``chain`` the index of its chain
    (``None`` for a single module)."""

    index: int
    name: str
    container: str
    children: tuple[str, ...]
    start: int
    stop: int
    chain: int | None

    @property
    def single(self) -> bool:
        return self.chain is None

    @property
    def path(self) -> str:
        """A single unit's own dotted path."""
        return _join(self.container, self.children[0])


@dataclass
class Chain:
    path: str
    units: list[int] = field(default_factory=list)


@dataclass
class Traced:
    """A chain through the model's traced forward: ``units`` in call order, ``graph`` the
    traced graph (module calls by path), ``nodes[i]`` the names of unit ``units[i]``'s
    call nodes there."""

    units: list[int]
    graph: Any
    nodes: list[tuple[str, ...]]


@dataclass
class Segmentation:
    chains: list[Chain]
    units: list[Unit]
    skipped: list[tuple[str, str]]  # (module path, why it is not a unit)
    traced: Traced | None = None
    traced_note: str | None = None  # why no traced chain was found (when there are chains)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def is_plain_sequential(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def _starts_unit(module: nn.Module) -> bool:
    return (not isinstance(module, _NORMS)) and next(module.parameters(), None) is not None


@dataclass
class _Calls:
    count: int = 0
    tensors_only: bool = True  # every call: tensor positional arguments, a tensor result


def _probe(model: nn.Module, args: tuple) -> dict[int, _Calls]:
    """How often forward calls each module, and whether it passes it tensors only."""
    calls: dict[int, _Calls] = {}
    handles = []

    def before(module: nn.Module, inputs: tuple, kwargs: dict) -> None:
        info = calls.setdefault(id(module), _Calls())
        info.count += 1
        if kwargs or not inputs or not all(isinstance(a, Tensor) for a in inputs):
            info.tensors_only = False

    def after(module: nn.Module, inputs: tuple, output: Any) -> None:
        if not isinstance(output, Tensor):
            calls[id(module)].tensors_only = False

    try:
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after))
        with torch.no_grad():
            model(*args)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def find_units(model: nn.Module, args: tuple) -> Segmentation:
    """The chains and units of ``model`` (run once on ``args``, without autograd; the
    caller passes a copy whose buffers may change)."""
    calls = _probe(model, args)
    result = Segmentation([], [], [])

    def info(module: nn.Module) -> _Calls:
        return calls.get(id(module), _Calls())

    def add_chain(path: str, sequential: nn.Sequential) -> None:
        children = list(sequential.named_children())
        if not children:
            return
        objects = [id(m) for _, m in children]
        bad = next((name for name, m in children
                    if info(m).count != 1 or not info(m).tensors_only), None)
        if bad is not None or len(set(objects)) != len(objects):
            why = (f"its child {bad!r} is called {info(dict(children)[bad]).count} times or "
                   f"with other than one tensor" if bad is not None
                   else "a module appears twice in it")
            result.skipped.append((path or "(the model)", why))
            return
        chain = Chain(path)
        groups: list[list[int]] = []
        for position, (_, module) in enumerate(children):
            if not groups or _starts_unit(module):
                groups.append([])
            groups[-1].append(position)
        for group in groups:
            names = tuple(children[p][0] for p in group)
            label = names[0] if len(names) == 1 else f"{names[0]}-{names[-1]}"
            unit = Unit(len(result.units), _join(path, label), path, names, group[0],
                        group[-1] + 1, len(result.chains))
            chain.units.append(unit.index)
            result.units.append(unit)
        result.chains.append(chain)

    def walk(path: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            child_path = _join(path, name)
            found = info(child)
            if found.count == 1 and found.tensors_only:
                if is_plain_sequential(child):
                    add_chain(child_path, child)
                else:
                    result.units.append(Unit(len(result.units), child_path, path, (name,), 0,
                                             1, None))
            elif found.count == 0:
                walk(child_path, child)  # a container forward does not call (ModuleList)
            else:
                result.skipped.append((child_path, f"forward calls it {found.count} times"
                                       if found.count > 1 else "it is called with other "
                                       "than tensors, or returns other than a tensor"))

    if is_plain_sequential(model):
        add_chain("", model)
    else:
        walk("", model)
        if result.chains:
            try:
                result.traced = _traced_chain(model, result)
            except Exception as error:  # fx cannot trace it: the chains as they are
                first = str(error).strip().splitlines()[0] if str(error).strip() else ""
                result.traced_note = (f"forward does not trace with torch.fx "
                                      f"({type(error).__name__}: {first[:120]})")
    return result


class _Leaves(torch.fx.Tracer):
    """fx's tracer with the units' modules as leaves (besides fx's own: torch.nn layers)."""

    def __init__(self, leaves: set[int]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return id(m) in self.leaves or (super().is_leaf_module(m, qualified_name)
                                        and not isinstance(m, nn.Sequential))


def _trace(model: nn.Module, leaves: set[int], training: bool) -> Any:
    modes = {m: m.training for m in model.modules()}
    try:
        model.train(training)
        return _Leaves(leaves).trace(model)
    finally:
        for m, mode in modes.items():
            m.training = mode


def _traced_chain(model: nn.Module, result: Segmentation) -> Traced | None:
    """The longest path of unit calls in ``model``'s traced forward that crosses a container
    (see the module's docstring); ``None`` (and ``result.traced_note``) where there is none."""
    leaves = {id(m) for u in result.units for m in unit_modules(model, u)}
    graph = _trace(model, leaves, True)
    if graph.python_code("self").src != _trace(model, leaves, False).python_code("self").src:
        result.traced_note = "its traced forward differs between training and evaluation"
        return None
    of_path: dict[str, tuple[int, int]] = {}  # module path -> (unit, position in the unit)
    for u in result.units:
        for position, name in enumerate(u.children):
            of_path[_join(u.container, name)] = (u.index, position)
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in of_path]
    if len({n.target for n in calls}) != len(calls):
        result.traced_note = "its traced forward calls a unit's module twice"
        return None
    best: list[tuple[int, list[str]]] = []
    current: list[tuple[int, list[str]]] = []  # (unit, its nodes) along the current path

    def close() -> None:
        nonlocal best, current
        whole = _whole_chains(current, result)
        if len(whole) > len(best):
            best = whole
        current = []

    previous = None
    for node in calls:
        linked = (previous is not None and node.args == (previous,) and not node.kwargs
                  and list(previous.users) == [node])
        simple = (len(node.args) == 1 and isinstance(node.args[0], torch.fx.Node)
                  and not node.kwargs)
        unit, position = of_path[node.target]
        if not linked:
            close()
        if not simple:
            previous = None
            continue
        if current and current[-1][0] == unit and position == len(current[-1][1]):
            current[-1][1].append(node.name)
        elif position == 0:
            if current and len(current[-1][1]) != len(result.units[current[-1][0]].children):
                current.pop()  # a unit called in part: the path stops before it
                close()
            current.append((unit, [node.name]))
        else:
            close()
            previous = None
            continue
        previous = node
    close()
    if len({result.units[u].chain if result.units[u].chain is not None else ("single", u)
            for u, _ in best}) < 2:
        result.traced_note = "its traced forward has no path of unit calls across containers"
        return None
    return Traced([u for u, _ in best], graph, [tuple(nodes) for _, nodes in best])


def _whole_chains(path: list[tuple[int, list[str]]],
                  result: Segmentation) -> list[tuple[int, list[str]]]:
    """The longest part of ``path`` whose units are whole and whose Sequential chains are
    covered whole."""
    pieces: list[list[tuple[int, list[str]]]] = [[]]
    i = 0
    while i < len(path):
        unit = result.units[path[i][0]]
        if len(path[i][1]) != len(unit.children):
            pieces.append([])
            i += 1
            continue
        if unit.chain is None:
            pieces[-1].append(path[i])
            i += 1
            continue
        members = result.chains[unit.chain].units
        span = [u for u, _ in path[i:i + len(members)]]
        if span == members and all(len(nodes) == len(result.units[u].children)
                                   for u, nodes in path[i:i + len(members)]):
            pieces[-1].extend(path[i:i + len(members)])
            i += len(members)
        else:
            pieces.append([])
            i += 1
    return max(pieces, key=len)


def unit_modules(model: nn.Module, unit: Unit) -> list[nn.Module]:
    container = model.get_submodule(unit.container) if unit.container else model
    return [getattr(container, name) for name in unit.children]


def shares_tensors(model: nn.Module, unit: Unit) -> bool:
    """Whether a parameter or buffer of the unit is also used by a module outside it
    (tied weights: converting the unit on its own would untie them)."""
    inside = {id(m) for module in unit_modules(model, unit) for m in module.modules()}
    mine = {id(t) for module in unit_modules(model, unit)
            for t in (*module.parameters(), *module.buffers())}
    for module in model.modules():
        if id(module) in inside:
            continue
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            if id(t) in mine:
                return True
    return False


def tensor_leaves(value: Any) -> list[Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, Tensor)]


def as_args(example_input: Any) -> tuple:
    return example_input if isinstance(example_input, tuple) else (example_input,)


__all__ = ["Chain", "Segmentation", "Traced", "Unit", "as_args", "find_units",
           "is_plain_sequential", "shares_tensors", "tensor_leaves", "unit_modules"]
