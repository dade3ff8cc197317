"""How a plan runs a segment: recomputed in backward, or with its saved tensors offloaded.

The model keeps its ``state_dict`` keys, parameter names, module paths and classes:

- a chain becomes :class:`PlannedSequential`, an ``nn.Sequential`` subclass holding the same
  children under the same names, which runs groups of them (blocks) with their choice;
- a single module keeps its class: :func:`plan_module` gives it an instance ``forward`` that
  runs the class's ``forward`` recomputed or offloaded (its hooks still run once, around it),
  so ``isinstance`` checks (an optimizer's norm-layer groups, weight initialisation) see it;
- a model with a run across containers (a traced chain, :mod:`.segments`) keeps its class
  too: :func:`plan_traced` gives it an instance ``forward`` that runs the code of its own
  forward traced by ``torch.fx`` (every unit's module a leaf), in which each recomputed or
  offloaded block's calls are one call of :func:`_traced_block`. The containers the chain
  crosses (``layer1``) are no longer called themselves: their hooks do not run.

Recomputation is ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout
draws the same mask again); selective recomputation keeps the outputs of the segment's
convolutions and matrix products besides (:mod:`.selective`). Running statistics must be
updated once per forward, as without the plan: the recomputation in backward saves every
buffer of the recomputed modules first and restores it afterwards (also when checkpoint stops
the recomputation early), so batch norm's running mean, variance and ``num_batches_tracked``
end as the unplanned model's, bit for bit. The recomputed forward itself uses batch
statistics in training mode, so its outputs do not depend on the running statistics.
"""

from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .selective import compiled_selectively, selectively_recomputed

#: The choices a plan makes per segment.
KEEP = "keep"
INPLACE = "inplace"
RECOMPUTE = "recompute"
INPLACE_RECOMPUTE = "inplace+recompute"
#: recomputed in backward but for its convolutions and matrix products (:mod:`.selective`)
SELECTIVE = "selective"
#: selectively recomputed, its products whose output is larger than their input run again too
#: (:func:`.selective.is_expansion`)
SELECTIVE_LEAN = "selective-lean"
OFFLOAD = "offload"
CHOICES = (KEEP, INPLACE, RECOMPUTE, INPLACE_RECOMPUTE, SELECTIVE, SELECTIVE_LEAN, OFFLOAD)
RECOMPUTED = (RECOMPUTE, INPLACE_RECOMPUTE, SELECTIVE, SELECTIVE_LEAN)


class Observer:
    """Told when a planned segment starts and ends (the planner's accounting); ``None`` in
    a returned model."""

    def enter(self, unit: int, inputs: Sequence[Any]) -> None:  # pragma: no cover
        raise NotImplementedError

    def exit(self, unit: int, outputs: Any) -> None:  # pragma: no cover
        raise NotImplementedError


def _buffers(modules: Iterable[nn.Module]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for module in modules:
        for buffer in module.buffers():
            seen.setdefault(id(buffer), buffer)
    return list(seen.values())


def recomputed(fn: Callable[..., Any], modules: Sequence[nn.Module], *args: Any,
               selective: bool = False, lean: bool = False) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward and running ``fn`` again there
    (``selective``: keeping also the outputs of its convolutions and matrix products, which
    are then not run again; see :mod:`.selective`; ``lean``: but for those whose output is
    larger than their input, which are run again too).

    The buffers of ``modules`` (running statistics) are restored after the recomputation:
    they are updated by the forward only, as without recomputation.
    """
    if torch.compiler.is_compiling():
        if selective:
            return compiled_selectively(fn, *args, lean=lean)
        return compiled_recomputed(fn, *args)
    calls = [0]

    def run(*inputs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inputs)
        buffers = _buffers(modules)
        with torch.no_grad():
            saved = [b.clone() for b in buffers]
        try:
            return fn(*inputs)
        finally:
            with torch.no_grad():
                for buffer, value in zip(buffers, saved, strict=True):
                    buffer.copy_(value)

    if selective:
        return selectively_recomputed(run, *args, lean=lean)
    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def compiled_recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """What :func:`recomputed` is while ``torch.compile`` traces: ``torch.utils.checkpoint``
    of ``fn`` itself. Dynamo refuses the eager wrapper (its call counter is state outside the
    checkpointed region); it needs none, since the compiled backward recomputes what it needs
    inside its graph and replays no buffer update."""
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)


class Offloaders:
    """The offloaders of a planned chain's blocks or module, made on first use. A cache: a
    copy or a pickle of the model starts without them (their host buffers and CUDA stream
    belong to this process)."""

    def __init__(self) -> None:
        self.by_key: dict[int, Any] = {}

    def get(self, key: int) -> Any:
        if key not in self.by_key:
            from ..memory.offloading import Offloader

            # min_bytes=0: every saved activation goes, so what stays on the device is exactly
            # what the segment's neighbours save themselves (the planner's accounting)
            self.by_key[key] = Offloader(min_bytes=0)
        return self.by_key[key]

    def __deepcopy__(self, memo: dict) -> Offloaders:
        return Offloaders()

    def __getstate__(self) -> dict:
        return {"by_key": {}}


def offloaded(fn: Callable[..., Any], offloader: Any, modules: Sequence[nn.Module],
              *args: Any) -> Any:
    """``fn(*args)`` with the tensors it saves for backward in host memory."""
    from ..memory.offloading import _storage_key

    offloader.keep = {_storage_key(t) for m in modules
                      for t in (*m.parameters(), *m.buffers())}
    with offloader.hooks():
        return fn(*args)


class PlannedSequential(nn.Sequential):
    """An ``nn.Sequential`` (same children, same names) that runs blocks of its children as
    the plan says: ``blocks`` is a list of ``(start, stop, choice)`` covering every child."""

    def __init__(self, sequential: nn.Sequential,
                 blocks: Sequence[tuple[int, int, str]]) -> None:
        super().__init__(OrderedDict(sequential._modules))
        self.training = sequential.training
        self.blocks = [tuple(b) for b in blocks]
        # which planner unit each block is (the planner's accounting), by block index
        self.units: list[int] | None = None
        self.observer: Observer | None = None
        self.offloaders = Offloaders()

    def forward(self, x: Any) -> Any:
        children = list(self._modules.values())
        for index, (start, stop, choice) in enumerate(self.blocks):
            modules = children[start:stop]
            if self.observer is not None and self.units is not None:
                self.observer.enter(self.units[index], (x,))
            fn = modules[0] if len(modules) == 1 else _chain(modules)
            x = _run(choice, fn, modules, self.offloaders, index, x)
            if self.observer is not None and self.units is not None:
                self.observer.exit(self.units[index], x)
        return x

    def extra_repr(self) -> str:
        return "blocks=" + ", ".join(f"[{a}:{b}] {c}" for a, b, c in self.blocks)


def _chain(modules: Sequence[nn.Module]) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        for module in modules:
            x = module(x)
        return x
    return run


def _run(choice: str, fn: Callable[..., Any], modules: Sequence[nn.Module],
         offloaders: Offloaders, key: int, *args: Any) -> Any:
    if choice in RECOMPUTED:
        return recomputed(fn, modules, *args, selective=choice in (SELECTIVE, SELECTIVE_LEAN),
                          lean=choice == SELECTIVE_LEAN)
    if choice == OFFLOAD:
        return offloaded(fn, offloaders.get(key), modules, *args)
    return fn(*args)


class ModulePlan:
    """How one planned single module runs: its ``choice``, and for the planner's accounting
    its ``unit`` and ``observer``."""

    def __init__(self, choice: str) -> None:
        self.choice = choice
        self.unit: int | None = None
        self.observer: Observer | None = None
        self.offloaders = Offloaders()


def _planned_forward(module: nn.Module, plan: ModulePlan, *args: Any) -> Any:
    # the class's forward, not the module's __call__: the module's hooks run once, around this
    forward = type(module).forward.__get__(module)
    if plan.observer is not None and plan.unit is not None:
        plan.observer.enter(plan.unit, args)
    out = _run(plan.choice, forward, [module], plan.offloaders, 0, *args)
    if plan.observer is not None and plan.unit is not None:
        plan.observer.exit(plan.unit, out)
    return out


def plan_module(module: nn.Module, choice: str) -> ModulePlan:
    """Make ``module`` run with ``choice`` (its instance ``forward``; class, keys and hooks
    unchanged). Returns its :class:`ModulePlan`."""
    plan = ModulePlan(choice)
    module.forward = functools.partial(_planned_forward, module, plan)
    return plan


class TracedPlan:
    """How a model runs its traced chain: ``leaves`` the paths of the modules traced as
    leaves, ``blocks`` the module paths called by each recomputed or offloaded block (in
    call order) and its choice. The generated code is made when the plan is (and again after
    unpickling, on first use: code made by ``exec`` does not pickle); copies, deep copies
    included, share it (it reads the model and the plan from its arguments)."""

    def __init__(self, module: nn.Module, leaves: Sequence[str],
                 blocks: Sequence[tuple[tuple[str, ...], str]]) -> None:
        self.leaves = tuple(leaves)
        self.blocks = [(tuple(paths), choice) for paths, choice in blocks]
        self.offloaders = Offloaders()
        self.code: Callable[..., Any] | None = None
        self.code = self.generate(module)

    def generate(self, module: nn.Module) -> Callable[..., Any]:
        from .segments import _Leaves

        graph = _Leaves({id(module.get_submodule(p)) for p in self.leaves}).trace(module)
        by_target = {n.target: n for n in graph.nodes if n.op == "call_module"}
        first = next(iter(graph.nodes))
        with graph.inserting_before(first):
            plan = graph.placeholder("iabn_plan")
        for index, (paths, _) in enumerate(self.blocks):
            nodes = [by_target[p] for p in paths]
            with graph.inserting_before(nodes[0]):
                modules = [graph.get_attr(p) for p in paths]
                call = graph.call_function(_traced_block, (plan, index, nodes[0].args[0],
                                                           *modules))
            nodes[-1].replace_all_uses_with(call)
            for node in reversed(nodes):
                graph.erase_node(node)
        code = graph.python_code("self")
        scope = dict(code.globals)
        exec(compile(code.src, "<iabn.plan traced forward>", "exec"), scope)
        return scope["forward"]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "code": None, "offloaders": Offloaders()}

    def __deepcopy__(self, memo: dict) -> TracedPlan:
        # the code, not None as from __getstate__: a deep copy of the model is often what is
        # compiled, and torch.compile cannot trace the code's generation (torch.fx's tracer)
        copied = TracedPlan.__new__(TracedPlan)
        copied.__dict__.update(self.__getstate__())
        copied.blocks = copy.deepcopy(self.blocks, memo)
        copied.code = self.code
        return copied


@torch.compiler.disable
def _generated(plan: TracedPlan, module: nn.Module) -> Callable[..., Any]:
    # run eagerly (a graph break) when the first call of an unpickled plan is compiled
    if plan.code is None:
        plan.code = plan.generate(module)
    return plan.code


def _traced_block(plan: TracedPlan, index: int, x: Any, *modules: nn.Module) -> Any:
    fn = modules[0] if len(modules) == 1 else _chain(modules)
    return _run(plan.blocks[index][1], fn, modules, plan.offloaders, index, x)


def _traced_forward(module: nn.Module, plan: TracedPlan, *args: Any, **kwargs: Any) -> Any:
    code = plan.code if plan.code is not None else _generated(plan, module)
    return code(module, plan, *args, **kwargs)


def plan_traced(module: nn.Module, leaves: Sequence[str],
                blocks: Sequence[tuple[tuple[str, ...], str]]) -> TracedPlan:
    """Make ``module`` run its traced forward with ``blocks`` (see :class:`TracedPlan`)."""
    plan = TracedPlan(module, leaves, blocks)
    module.forward = functools.partial(_traced_forward, module, plan)
    return plan


def traced_plan(module: nn.Module) -> TracedPlan | None:
    """The plan :func:`plan_traced` gave ``module``, if any."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _traced_forward:
        return forward.args[1]
    return None


def module_plan(module: nn.Module) -> ModulePlan | None:
    """The plan :func:`plan_module` gave ``module``, if any."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, functools.partial) and forward.func is _planned_forward:
        return forward.args[1]
    return None


__all__ = ["CHOICES", "INPLACE", "INPLACE_RECOMPUTE", "KEEP", "OFFLOAD", "RECOMPUTE",
           "RECOMPUTED", "SELECTIVE", "SELECTIVE_LEAN", "ModulePlan", "Offloaders",
           "PlannedSequential", "TracedPlan", "module_plan", "offloaded", "plan_module",
           "plan_traced", "recomputed", "traced_plan"]
