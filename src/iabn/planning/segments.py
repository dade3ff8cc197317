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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
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
class Segmentation:
    chains: list[Chain]
    units: list[Unit]
    skipped: list[tuple[str, str]]  # (module path, why it is not a unit)


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
    return result


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


__all__ = ["Chain", "Segmentation", "Unit", "as_args", "find_units", "is_plain_sequential",
           "shares_tensors", "tensor_leaves", "unit_modules"]
