"""Exact saved bytes per unit and choice, measured (docs/design.md, "Planning memory").

One training forward of a whole model in which every unit runs one variant (as given, or
converted in place, or offloaded) is recorded with ``saved_tensors_hooks``, as
:mod:`iabn.memory` counts: distinct storages, parameters and buffers excluded. Each saved
storage is attributed to the unit running when it was saved (or to the *rest*: code outside
every unit) and named:

- a storage that is a unit's input or output (a *boundary*) gets an identity that is the same
  in every run: ``("out", u, i)`` for unit ``u``'s ``i``-th output, ``("in", u, i)`` for an
  input that no unit produced (the model's input, a tensor the rest computed). A boundary
  storage saved by two units (a ReLU's output that the next convolution saves too) counts
  once in any combination of choices;
- any other storage is *private* to its saver: created inside the unit, it exists only in that
  unit's run.

A plan's saved bytes are then exactly the private bytes of its choices plus the sizes of the
distinct boundary identities some choice saves, which is what the solver models. A
recomputed run of units keeps what ``torch.utils.checkpoint`` saves — measured by running it
on its recorded input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..measure.trial_runs import preserved, same_randomness
from ..memory import counting_saves, state_keys, storage_key
from .cost import REST, OpCount, OpCounter
from .segments import tensor_leaves
from .wrappers import Observer, PlannedSequential, _chain, module_plan, recomputed

Identity = tuple[str, int, int]


@dataclass
class Saved:
    """What one owner (a unit, or the rest) saves in one run."""

    shared: dict[Identity, int] = field(default_factory=dict)  # boundary identity -> bytes
    private: list[int] = field(default_factory=list)          # sizes of private storages

    @property
    def private_bytes(self) -> int:
        return sum(self.private)

    def same_as(self, other: Saved) -> bool:
        return (set(self.shared) == set(other.shared)
                and sorted(self.private) == sorted(other.private))


@dataclass
class Run:
    """One recorded forward: per unit (and rest) what is saved, the sizes of the boundary
    storages, which units write into their inputs or have their outputs written later, the
    units' inputs (clones, when asked) and the counted operations."""

    units: dict[int, Saved]
    rest: Saved
    sizes: dict[Identity, int]
    writes_input: set[int]
    output_written: set[int]
    inputs: dict[int, tuple[Tensor, ...]]
    forward_ops: dict[int, OpCount]
    backward_ops: OpCount | None
    total: int  # the run's saved bytes (the iabn.memory figure)
    input_names: dict[int, list[Identity]] = field(default_factory=dict)
    transferred: dict[int, int] = field(default_factory=dict)  # offloaded bytes per unit


class _Recorder(Observer):
    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.names: dict[Any, Identity] = {}
        self.sizes: dict[Identity, int] = {}
        # everything named stays alive (counting_saves holds what is saved): keys stay unique
        self.held: list[Tensor] = []
        self.stack: list[int] = []
        self.packs: list[tuple[int, Any, int]] = []
        self.input_versions: dict[int, list[tuple[Tensor, int]]] = {}
        self.outputs: list[tuple[int, Tensor, int]] = []
        self.writes_input: set[int] = set()
        self.inputs: dict[int, tuple[Tensor, ...]] = {}
        self.input_names: dict[int, list[Identity]] = {}

    def _name(self, t: Tensor, identity: Identity) -> None:
        key = storage_key(t)
        if key not in self.names:
            self.names[key] = identity
            self.sizes[identity] = t.untyped_storage().nbytes()
        self.held.append(t)

    def enter(self, unit: int, inputs: Sequence[Any]) -> None:
        tensors = tensor_leaves(tuple(inputs))
        for i, t in enumerate(tensors):
            self._name(t, ("in", unit, i))
        self.input_names[unit] = [self.names[storage_key(t)] for t in tensors]
        self.input_versions[unit] = [(t, t._version) for t in tensors]
        if self.capture:
            self.inputs[unit] = tuple(t.detach().clone() for t in tensors)
        self.stack.append(unit)

    def exit(self, unit: int, outputs: Any) -> None:
        self.stack.pop()
        if any(t._version != v for t, v in self.input_versions.pop(unit, [])):
            self.writes_input.add(unit)
        for i, t in enumerate(tensor_leaves(outputs)):
            self._name(t, ("out", unit, i))
            self.outputs.append((unit, t, t._version))

    def owner(self) -> int:
        return self.stack[-1] if self.stack else REST

    def saved(self, key: Any, t: Tensor, first: bool) -> None:
        """counting_saves' callback: log every save, in order, with its owner."""
        self.packs.append((self.owner(), key, t.untyped_storage().nbytes()))


def observe(model: nn.Module, observer: Observer | None) -> None:
    for module in model.modules():
        target = module if isinstance(module, PlannedSequential) else module_plan(module)
        if target is not None:
            target.observer = observer


def record(model: nn.Module, args: tuple, *, capture_inputs: bool = False,
           count_ops: bool = False, backward: bool = False) -> Run:
    """One training forward of ``model`` (a planned skeleton whose wrappers know their units),
    recorded; ``model``'s buffers and modes are restored afterwards."""
    recorder = _Recorder(capture_inputs)
    counter = OpCounter(recorder.owner) if count_ops else None
    backward_counter = None
    observe(model, recorder)
    try:
        with preserved(model), same_randomness(args):
            model.train()
            with counting_saves(state_keys(model), recorder.saved), \
                    (counter if counter is not None else contextlib.nullcontext()):
                out = model(*args)
            output_written = {unit for unit, t, v in recorder.outputs if t._version != v}
            transferred = _transferred(model)
            if backward:
                roots = [t for t in tensor_leaves(out) if t.requires_grad]
                if roots:
                    backward_counter = OpCounter()
                    with backward_counter:
                        torch.autograd.backward([r.float().sum() for r in roots])
            del out
    finally:
        observe(model, None)
    units: dict[int, Saved] = {}
    rest = Saved()
    seen = set()
    total = 0
    for owner, key, nbytes in recorder.packs:
        if key in seen:  # saved before by this owner or another: counted there
            identity = recorder.names.get(key)
            target = rest if owner == REST else units.setdefault(owner, Saved())
            if identity is not None:
                target.shared[identity] = recorder.sizes[identity]
            continue
        seen.add(key)
        total += nbytes
        target = rest if owner == REST else units.setdefault(owner, Saved())
        identity = recorder.names.get(key)
        if identity is not None:
            target.shared[identity] = recorder.sizes[identity]
        else:
            target.private.append(nbytes)
    recorder.held.clear()
    return Run(units, rest, dict(recorder.sizes), recorder.writes_input, output_written,
               recorder.inputs,
               dict(counter.counts) if counter is not None else {},
               backward_counter.counts.get(REST) if backward_counter is not None else None,
               total, recorder.input_names, transferred)


def _transferred(model: nn.Module) -> dict[int, int]:
    """Bytes each offloaded unit sent to the host in the forward just run."""
    result: dict[int, int] = {}
    for module in model.modules():
        plan = module_plan(module)
        if isinstance(module, PlannedSequential) and module.units is not None:
            for index, offloader in module.offloaders.by_key.items():
                result[module.units[index]] = offloader.stats.transferred_bytes
        elif plan is not None and plan.unit is not None:
            for offloader in plan.offloaders.by_key.values():
                result[plan.unit] = offloader.stats.transferred_bytes
    return result


def recomputed_saves(modules: Sequence[nn.Module], inputs: Sequence[Tensor],
                     identities: Sequence[Identity], last: int,
                     selective: bool = False, lean: bool = False) -> Saved:
    """What a recomputed run of ``modules`` keeps for backward (``selective``: recomputed
    but for its products; ``lean``: but for its products other than expansions), run on
    ``inputs`` (the first unit's recorded input, whose boundary identities are
    ``identities``). ``last`` is the run's last unit: an output it keeps (a selective run
    ending in a product) is that unit's boundary output."""
    names = {storage_key(t): identity for t, identity in zip(inputs, identities, strict=True)}
    excluded = state_keys(*modules)
    container = nn.ModuleList(modules)
    fn = modules[0] if len(modules) == 1 else _chain(modules)
    with preserved(container), same_randomness(tuple(inputs)), \
            counting_saves(excluded) as packed:
        container.train()
        out = recomputed(fn, modules, *inputs, selective=selective, lean=lean)
        for i, t in enumerate(tensor_leaves(out)):
            names.setdefault(storage_key(t), ("out", last, i))
        del out
    saved = Saved()
    for key, nbytes in packed.items():
        if key in names:
            saved.shared[names[key]] = nbytes
        else:
            saved.private.append(nbytes)
    return saved


__all__ = ["Identity", "Run", "Saved", "observe", "recomputed_saves", "record"]
