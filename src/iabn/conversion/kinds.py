"""The three kinds of site :func:`iabn.convert` decides about, and the one loop that decides
them all (docs/design.md, "Converting existing models"):

- a batch or group norm, with the activation it absorbs if one follows (:class:`FusedNorm`);
- a layer or RMS norm alone (:class:`NormAlone`);
- an activation alone: a module, or a function or method call, that no norm absorbed
  (:class:`ActivationAlone`).

Each kind says how its sites are found in one graph, which subjects (modules, function calls)
the report has a row for, how one is decided from its calls in the train and eval graphs, and
how its new layer is built. :func:`plan` runs the kinds in this order (an activation a norm
absorbed is no activation alone) and collects the layers, the fusions and the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch import fx, nn

from .decide import IN_PLACE, UNTOUCHED, Decision, decide, pattern
from .graph import (
    Site,
    Traced,
    activation_kind,
    find_sites,
    is_convertible_norm,
    is_site_module,
    layer_kind,
    node_activation,
    recognition,
    standalone_layer,
    stands_alone,
)
from .layers import decide_layer, find_layer_sites, new_norm
from .rewrite import new_layer


@dataclass(frozen=True)
class Subject:
    """What one row of the report is about."""

    key: str                  # graph.site_key of its calls
    name: str                 # the row's name: the module's, or the new module's of a call
    module: nn.Module | None  # None: a function or method call
    order: int                # its place among its kind's rows


@dataclass
class Context:
    """What every kind reads, fixed for one conversion."""

    root: nn.Module                        # the model the graphs were traced on
    modules: dict[str, nn.Module]          # its named modules
    traced: dict[bool, Traced]             # by training mode
    policy: str
    activations: bool                      # convert's argument
    #: site_key -> the other nodes that save (part of) the site's input for backward
    input_savers: dict[str, set[fx.Node]]
    #: why an activation node may not be removed by a fusion, if it may not
    unfusable: Callable[[fx.Node], str | None] | None
    #: with these fusions, why the result is a module swap (function calls then stay), or
    #: ``None`` where the graphs are rewritten
    calls_stay: Callable[[list[Site]], str | None]

    def input_kept(self, key: str) -> str | None:
        """Why a site's input stays saved for backward whatever its layer keeps: the nodes
        other than site modules (each of which may also stop keeping it) that save it."""
        savers = self.input_savers.get(key, ())
        others = sorted(str(n.target) if n.op == "call_module" else n.name for n in savers
                        if not (n.op == "call_module" and is_site_module(self.modules[n.target])))
        if not others:
            return None
        return (f"{', '.join(map(repr, others[:3]))} also save{'s' * (len(others) == 1)} it "
                f"for backward, so a layer that keeps only its output would save nothing")


@dataclass(frozen=True)
class PlannedRow:
    subject: Subject
    pattern: str
    decision: Decision
    group: int  # the report lists batch and group norms (0) before the layers alone (1)


@dataclass
class Plan:
    """The decisions and the new layers."""

    rows: list[PlannedRow] = field(default_factory=list)
    layers: dict[str, nn.Module] = field(default_factory=dict)  # module name -> new layer
    #: new module's name -> (its layer, the call nodes of both graphs it replaces)
    calls: dict[str, tuple[nn.Module, list[fx.Node]]] = field(default_factory=dict)
    fused: list[Site] = field(default_factory=list)  # norm sites that absorb an activation
    notes: list[str] = field(default_factory=list)

    def layer(self, name: str) -> nn.Module | None:
        """The new layer of a row, if it has one."""
        call = self.calls.get(name)
        return call[0] if call is not None else self.layers.get(name)


class SiteKind:
    """How one kind of site is found, decided and built."""

    group = 1

    def find(self, traced: Traced, context: Context, plan: Plan) -> list:
        """The sites (with ``key``) of this kind in one graph."""
        raise NotImplementedError

    def subjects(self, sites: list, context: Context, plan: Plan) -> Iterator[Subject]:
        """Who gets a row; ``sites``: those of both graphs."""
        raise NotImplementedError

    def decide(self, subject: Subject, per_graph: list[list], context: Context
               ) -> Decision | None:
        """From the subject's calls in each graph; ``None``: no row."""
        raise NotImplementedError

    def pattern(self, subject: Subject, calls: list) -> str:
        return type(subject.module).__name__

    def build(self, subject: Subject, calls: list, decision: Decision,
              work: nn.Module) -> nn.Module:
        """The new layer, holding the tensors of ``work``'s module."""
        raise NotImplementedError

    def fusions(self, calls: list) -> list[Site]:
        """The sites among ``calls`` whose activation the new layer absorbs."""
        return []


def _shared(per_graph: list[list], both_modes: bool) -> Decision | None:
    """Untouched where forward calls the subject more than once in a graph, or (``both_modes``)
    in one mode only."""
    if any(len(calls) > 1 for calls in per_graph):
        return Decision(UNTOUCHED, "forward calls it more than once (a shared layer)")
    if both_modes and not all(per_graph):
        return Decision(UNTOUCHED, "forward calls it in one mode only")
    return None


class FusedNorm(SiteKind):
    """Batch and group norms, each with the activation that alone consumes its output."""

    group = 0

    def find(self, traced, context, plan):
        return find_sites(traced.graph, context.modules, traced.escapes, context.unfusable)

    def subjects(self, sites, context, plan):
        for order, (name, m) in enumerate(context.modules.items()):
            if is_convertible_norm(m):
                yield Subject(name, name, m, order)

    def decide(self, subject, per_graph, context):
        if not any(per_graph):
            return Decision(UNTOUCHED, "forward never calls it")
        return _shared(per_graph, both_modes=False) or decide(
            subject.module, [s for calls in per_graph for s in calls], context.policy,
            context.input_kept(subject.key))

    def pattern(self, subject, calls):
        return pattern(subject.module, calls[0] if calls else None)

    def build(self, subject, calls, decision, work):
        return new_layer(work.get_submodule(subject.name), decision)

    def fusions(self, calls):
        return [s for s in calls if s.activation is not None]


class NormAlone(SiteKind):
    """Layer and RMS norms: nothing to fuse with."""

    def find(self, traced, context, plan):
        modules = context.modules
        return find_layer_sites(traced.graph, modules, traced.escapes, lambda node: (
            node.op == "call_module" and layer_kind(modules[node.target]) is not None))

    def subjects(self, sites, context, plan):
        for order, (name, m) in enumerate(context.modules.items()):
            if layer_kind(m) is not None:
                yield Subject(name, name, m, order)

    def decide(self, subject, per_graph, context):
        if not any(per_graph):
            return None
        return _shared(per_graph, both_modes=True) or decide_layer(
            subject.module, [s for calls in per_graph for s in calls],
            context.input_kept(subject.key))

    def build(self, subject, calls, decision, work):
        return new_norm(work.get_submodule(subject.name), decision)


class ActivationAlone(SiteKind):
    """Activations no norm absorbed (:func:`~iabn.conversion.graph.stands_alone`): modules,
    and calls of the registry's function and method forms, which become calls of a new
    module where the graphs are rewritten (a module swap cannot reach them)."""

    def find(self, traced, context, plan):
        modules = context.modules
        absorbed = {s.activation_node for s in plan.fused}
        absorbed_modules = _absorbed_modules(plan)

        def wanted(node: fx.Node) -> bool:
            if node in absorbed:
                return False
            if node.op == "call_module":
                return (node.target not in absorbed_modules
                        and activation_kind(modules[node.target]) is not None)
            return node.op in ("call_function", "call_method") and stands_alone(
                node_activation(node, modules))

        return find_layer_sites(traced.graph, modules, traced.escapes, wanted)

    def subjects(self, sites, context, plan):
        absorbed = _absorbed_modules(plan)
        for order, (name, m) in enumerate(context.modules.items()):
            if name not in absorbed and activation_kind(m) is not None:
                yield Subject(name, name, m, order)
        calls = {s.key: s for s in sites if s.node.op != "call_module"}  # first call of each
        stay = context.calls_stay(plan.fused) if calls else None
        if stay is not None:
            written = [f"{s.activation.written_as} ({key})" for key, s in calls.items()]
            more = f" and {len(written) - 5} more" if len(written) > 5 else ""
            plan.notes.append(f"activations written as functions in forward stay "
                              f"({', '.join(written[:5])}{more}): {stay}, and a function call "
                              f"has no module to swap")
            return
        taken = set(context.modules)
        for order, key in enumerate(calls, start=len(context.modules)):
            name = _free_name(key, context.root, taken)
            taken.add(name)
            yield Subject(key, name, None, order)

    def decide(self, subject, per_graph, context):
        calls = [s for graph_calls in per_graph for s in graph_calls]
        if not calls:
            return None
        if not context.activations:
            return Decision(UNTOUCHED, "activations=False: activations without a norm stay")
        found = calls[0].activation
        if any(s.activation != found for s in calls):  # a call's name is the same, not its code
            return Decision(UNTOUCHED, "train and eval mode compute different activations here")
        if standalone_layer(found, overwrite_input=True) is None:
            return Decision(UNTOUCHED, f"iabn has no in-place layer of {found.name} "
                            f"(iabn.layers.activation), so {found.written_as} stays")
        return _shared(per_graph, both_modes=True) or decide_layer(
            subject.module, calls, context.input_kept(subject.key))

    def pattern(self, subject, calls):
        return calls[0].activation.written_as

    def build(self, subject, calls, decision, work):
        layer = standalone_layer(calls[0].activation, overwrite_input=decision.layer == IN_PLACE)
        source = work if subject.module is None else work.get_submodule(subject.name)
        return layer.train(source.training)


class Unrecognised(SiteKind):
    """Modules of classes iabn does not know that were probed as a norm or activation and
    match none of the forms it replaces (:mod:`.recognise`): a row saying why."""

    def find(self, traced, context, plan):
        return []

    def subjects(self, sites, context, plan):
        for order, (name, m) in enumerate(context.modules.items()):
            found = recognition(m)
            if found is not None and found.found is None and found.reported:
                yield Subject(name, name, m, order)

    def decide(self, subject, per_graph, context):
        return Decision(UNTOUCHED, recognition(subject.module).why)


def _absorbed_modules(plan: Plan) -> set[str]:
    """The activation modules the norms decided so far absorb."""
    return {s.activation_node.target for s in plan.fused
            if s.activation_node is not None and s.activation_node.op == "call_module"}


def _free_name(base: str, root: nn.Module, taken: set[str]) -> str:
    """``base``, or ``base`` with a suffix, that is neither an attribute of ``root`` nor
    ``taken``: the name of a new module replacing a function call."""
    name, number = base, 0
    while name in taken or hasattr(root, name):
        number += 1
        name = f"{base}_iabn{'' if number == 1 else number}"
    return name


#: Every kind, in the order they are decided.
KINDS: tuple[SiteKind, ...] = (FusedNorm(), NormAlone(), ActivationAlone(), Unrecognised())


def plan(context: Context, work: nn.Module, kinds: tuple[SiteKind, ...] = KINDS) -> Plan:
    """Find, decide and build every site of every kind; the new layers hold ``work``'s
    tensors. Rows are in the report's order: batch and group norms, then the layers alone,
    each in model order (function calls last)."""
    result = Plan()
    for kind in kinds:
        per_mode = [kind.find(traced, context, result) for traced in context.traced.values()]
        by_key: dict[str, list[list]] = {}
        for mode, sites in enumerate(per_mode):
            for site in sites:
                by_key.setdefault(site.key, [[] for _ in per_mode])[mode].append(site)
        every_site = [site for sites in per_mode for site in sites]
        for subject in list(kind.subjects(every_site, context, result)):
            per_graph = by_key.get(subject.key, [[] for _ in per_mode])
            decision = kind.decide(subject, per_graph, context)
            if decision is None:
                continue
            calls = [site for graph_calls in per_graph for site in graph_calls]
            result.rows.append(PlannedRow(subject, kind.pattern(subject, calls), decision,
                                          kind.group))
            if decision.layer == UNTOUCHED:
                continue
            layer = kind.build(subject, calls, decision, work)
            if subject.module is None:
                result.calls[subject.name] = (layer, [site.node for site in calls])
            else:
                result.layers[subject.name] = layer
            result.fused.extend(kind.fusions(calls))
    result.rows.sort(key=lambda row: (row.group, row.subject.order))
    return result


__all__ = ["KINDS", "ActivationAlone", "Context", "FusedNorm", "NormAlone", "Plan",
           "SiteKind", "Subject", "Unrecognised", "plan"]
