"""``iabn.plan``: the fastest mix of in-place norms, recomputation and offloading that fits a
memory budget (docs/design.md, "Planning memory")."""

from __future__ import annotations

import copy
import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..measure.trial_runs import preserved, same_randomness
from ..memory import saved_tensor_bytes
from . import caches
from .accounting import Run, Saved, observe, recomputed_saves, record
from .cost import DeviceSpeed, calibrate
from .recovery import unit_recovery_seconds
from .report import DecisionRow, PlanReport
from .segments import (
    Segmentation,
    Unit,
    _join,
    as_args,
    find_units,
    shares_tensors,
    tensor_leaves,
    unit_modules,
)
from .solver import Option, Problem, Solution, SolverTimeout, smallest, solve
from .wrappers import (
    INPLACE,
    INPLACE_RECOMPUTE,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    RECOMPUTED,
    SELECTIVE,
    SELECTIVE_LEAN,
    Observer,
    PlannedSequential,
    plan_module,
    plan_traced,
    traced_plan,
)

#: What ``allow`` may name.
ALLOWED = ("inplace", "recompute", "offload")
POLICIES = ("lossless", "leaky_relu")


@dataclass
class Candidate:
    """A choice for one unit or a run of units of one chain."""

    units: tuple[int, ...]
    choice: str
    saved: Saved
    seconds: float

    @property
    def variant(self) -> str:
        return INPLACE if self.choice in (INPLACE, INPLACE_RECOMPUTE) else KEEP


def _deepcopy(model: nn.Module) -> nn.Module:
    from ..conversion.converter import _deepcopy as deepcopy_model

    return deepcopy_model(model)


def _check_arguments(model: Any, example_input: Any, budget: Any, policy: Any, allow: Any,
                     time_limit: Any) -> tuple[tuple, tuple[str, ...]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args = as_args(example_input)
    if not args or not any(isinstance(a, Tensor) for a in args):
        raise TypeError("example_input must be a tensor or a tuple of forward's arguments "
                        "with at least one tensor, e.g. torch.randn(8, 3, 224, 224)")
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Integral, numbers.Real)):
        raise TypeError(f"budget must be a number of bytes (int) or a fraction in (0, 1] "
                        f"(float) of the model's activation memory, got {budget!r}")
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise ValueError(f"budget={budget}: a number of bytes must be positive (or give "
                             f"a fraction in (0, 1] as a float)")
    elif not (math.isfinite(budget) and 0.0 < budget <= 1.0):
        raise ValueError(f"budget={budget}: a fraction of the model's activation memory must "
                         f"be in (0, 1]; give bytes as an int")
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: use one of {', '.join(map(repr, POLICIES))} "
                         f"(iabn.convert's policies)")
    if isinstance(allow, str):
        allow = (allow,)
    try:
        allowed = tuple(dict.fromkeys(allow))
    except TypeError:
        raise TypeError(f"allow must be a tuple of {', '.join(map(repr, ALLOWED))}, got "
                        f"{allow!r}") from None
    unknown = [a for a in allowed if a not in ALLOWED]
    if unknown:
        raise ValueError(f"allow={allow!r}: unknown choice {unknown[0]!r}; use any of "
                         f"{', '.join(map(repr, ALLOWED))}")
    if isinstance(time_limit, bool) or not isinstance(time_limit, numbers.Real) or not (
            time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit={time_limit!r}: must be a positive number of seconds")
    return args, allowed


def _device_of(args: tuple) -> torch.device:
    return next(a.device for a in args if isinstance(a, Tensor))


def _dtype_of(args: tuple, model: nn.Module) -> torch.dtype:
    for t in (*model.parameters(), *(a for a in args if isinstance(a, Tensor))):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


class Planner:
    """Measures the candidates of one model at one input (see docs/design.md).

    Bytes are counted on the ``meta`` device (shapes only: no arithmetic, no memory) when
    its count of the model as given equals the count on the input's device, else there.
    In-place conversion runs on the real model (its rules read the weights) with the units'
    real inputs; the returned model is built from the real model.
    """

    def __init__(self, model: nn.Module, args: tuple, policy: str, allow: Sequence[str],
                 timing_device: torch.device | str | None = None,
                 progress: Callable[[str], None] | None = None, verify: bool = True,
                 compiled: bool = False) -> None:
        self.say = progress or (lambda _text: None)
        self.compiled = compiled
        self.policy, self.allow, self.args = policy, tuple(allow), args
        self.notes: list[str] = []
        self.real = _deepcopy(model)
        self.device = _device_of(args)
        self.verify = verify and self.device.type != "meta"
        timing = torch.device(timing_device) if timing_device is not None else (
            torch.device("cpu") if self.device.type == "meta" else self.device)
        self.speed: DeviceSpeed = calibrate(timing, _dtype_of(args, self.real))
        self.say(f"counting the activation memory of the model as given on {self.device}")
        self.as_given = _count(self.real, args)
        self.base, self.count_args = self._counting_copy()
        self.counting_device = _device_of(self.count_args)
        probe = _deepcopy(self.base)
        with preserved(probe):
            self.segmentation: Segmentation = find_units(probe.train(), self.count_args)
        del probe
        self.units: list[Unit] = self.segmentation.units
        self.say(f"{len(self.units)} units in {len(self.segmentation.chains)} chains; "
                 f"recording the model as given on {self.counting_device}")
        self.converted_real: dict[int, list[nn.Module]] = {}
        self.converted: dict[int, list[nn.Module]] = {}
        self.keep_model = self.assemble([((u.index,), KEEP) for u in self.units], observe=True)
        self.keep: Run = record(self.keep_model, self.count_args, capture_inputs=True,
                                count_ops=True, backward=True)
        self.input_identities = self.keep.input_names
        self.inplace: Run | None = None
        self.inplace_model: nn.Module | None = None
        #: unit -> the measured extra time of its layers converted in place (recovery.py)
        self.recovery: dict[int, float] = {}
        if "inplace" in self.allow:
            self._convert_units()
        self.offload: Run | None = None
        if "offload" in self.allow:
            if self.device.type == "cuda":
                offloaded = self.assemble([((u.index,), OFFLOAD) for u in self.units],
                                          observe=True, real=True)
                self.say("recording every unit offloaded")
                self.offload = record(offloaded, args)
            else:
                self.notes.append(
                    f"offload is not a candidate on {self.device.type}: the tensors would "
                    f"stay in the same memory (offloading moves device memory to the host)")
        self.candidates = self._candidates()

    def _counting_copy(self) -> tuple[nn.Module, tuple]:
        """The model and input the bytes are counted on: ``meta`` copies where that gives the
        count of the input's device for the model as given, else the model itself."""
        if self.device.type == "meta":
            return self.real, self.args
        try:
            model = _deepcopy(self.real).to("meta")
            args = tuple(torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device="meta")
                         if isinstance(a, Tensor) else a for a in self.args)
            if _count(model, args) == self.as_given:
                return model, args
            self.notes.append("bytes were counted on the input's device: the meta device's "
                              "count differs for this model")
        except Exception as error:  # an operation without a meta implementation
            self.notes.append(f"bytes were counted on the input's device: the model does not "
                              f"run on meta ({type(error).__name__})")
        return self.real, self.args

    # ------------------------------------------------------------ building models

    def assemble(self, blocks: Iterable[tuple[tuple[int, ...], str]],
                 observe: bool = False, real: bool = False) -> nn.Module:
        """A copy of the model running ``blocks`` (``(units, choice)`` covering every unit;
        units absent run as given). With ``observe`` every unit is wrapped so that its start
        and end can be recorded. ``real``: built from the real model (else from the one the
        bytes are counted on)."""
        blocks = list(blocks)
        model = _deepcopy(self.real if real else self.base)
        converted = self.converted_real if real else self.converted
        choice_of = {u: choice for units, choice in blocks for u in units}
        for units, choice in blocks:
            if choice in (INPLACE, INPLACE_RECOMPUTE):
                for u in units:
                    if u in converted:
                        unit = self.units[u]
                        container = model.get_submodule(unit.container)
                        for name, module in zip(unit.children, copy.deepcopy(converted[u]),
                                                strict=True):
                            setattr(container, name, module)
        traced = self.segmentation.traced
        crossing = (traced is not None and not observe
                    and any(self._crosses(units) for units, _ in blocks))
        on_trace = set(traced.units) if crossing and traced is not None else set()
        for index, chain in enumerate(self.segmentation.chains):
            if chain.units and chain.units[0] in on_trace:
                continue  # the traced forward calls its children itself
            mine = [(units, choice) for units, choice in blocks
                    if self.units[units[0]].chain == index]
            covered = {u for units, _ in mine for u in units}
            mine += [((u,), KEEP) for u in chain.units if u not in covered]
            mine.sort(key=lambda block: self.units[block[0][0]].start)
            if not observe and all(choice in (KEEP, INPLACE) for _, choice in mine):
                continue
            sequential = model.get_submodule(chain.path)
            spans = [(self.units[units[0]].start, self.units[units[-1]].stop, choice)
                     for units, choice in mine]
            planned = PlannedSequential(sequential, spans)
            if observe:
                planned.units = [units[0] for units, _ in mine]
            model = _put(model, chain.path, planned)
        for unit in self.units:
            if not unit.single or unit.index in on_trace:
                continue
            choice = choice_of.get(unit.index, KEEP)
            if not observe and choice not in (*RECOMPUTED, OFFLOAD):
                continue
            planned = plan_module(model.get_submodule(unit.path), choice)
            if observe:
                planned.unit = unit.index
        if on_trace:
            plan_traced(model, [_join(u.container, name) for u in self.units
                                for name in u.children],
                        [(tuple(_join(self.units[u].container, name) for u in units
                                for name in self.units[u].children), choice)
                         for units, choice in blocks
                         if units[0] in on_trace and choice in (*RECOMPUTED, OFFLOAD)])
        return model

    def _crosses(self, units: tuple[int, ...]) -> bool:
        """Whether a run spans more than one container (runs only the traced chain has)."""
        chains = {self.units[u].chain for u in units}
        return len(units) > 1 and (len(chains) > 1 or None in chains)

    def _modules(self, model: nn.Module, unit: Unit) -> list[nn.Module]:
        return unit_modules(model, unit)

    # ------------------------------------------------------------ in place

    def _convert_units(self) -> None:
        from ..conversion import ConversionWarning, convert
        from ..conversion.graph import RETURNED_WRITTEN, is_site_module

        if self.device.type == "meta":
            self.notes.append("in place is not a candidate: iabn.convert reads the norms' "
                              "weights (|weight| < eps is clamped), which a meta model has not; "
                              "give the model on a real device (bytes are still counted on "
                              "meta)")
            return
        inputs: dict[int, tuple[Tensor, ...]] | None = None
        for unit in self.units:
            modules = unit_modules(self.real, unit)
            if not any(is_site_module(m) for module in modules for m in module.modules()):
                continue
            if shares_tensors(self.real, unit):
                self.notes.append(f"{unit.name}: not converted: it shares parameters or "
                                  f"buffers with other layers")
                continue
            if unit.index in self.keep.output_written:
                self.notes.append(f"{unit.name}: not converted: a later operation writes "
                                  f"into its output")
                continue
            if inputs is None:  # the units' real inputs: conversion reads values
                inputs = (self.keep.inputs if self.base is self.real
                          else _unit_inputs(self.assemble(
                              [((u.index,), KEEP) for u in self.units], observe=True,
                              real=True), self.args))
            example = inputs.get(unit.index)
            if not example:
                continue
            target = modules[0] if len(modules) == 1 else nn.Sequential(*modules)
            self.say(f"converting {unit.name}")
            # a unit's outputs feed the next units, not the caller: the versions of the
            # recorded run below tell whether anything writes into them
            written = RETURNED_WRITTEN.set(False)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ConversionWarning)
                    converted, report = convert(target, example if len(example) > 1
                                                else example[0], policy=self.policy,
                                                verify=self.verify)
            finally:
                RETURNED_WRITTEN.reset(written)
            if all(row.decision == "untouched" for row in report.rows):
                continue
            if len(modules) == 1:
                self.converted_real[unit.index] = [converted]
            elif type(converted) is nn.Sequential:
                self.converted_real[unit.index] = list(converted.children())
            else:
                self.notes.append(f"{unit.name}: not converted: its layers would become one "
                                  f"graph module ({report.result_reason})")
        for u, modules in self.converted_real.items():
            self.converted[u] = (modules if self.base is self.real
                                 else [copy.deepcopy(m).to("meta") for m in modules])
        if not self.converted:
            return
        self.say(f"recording {len(self.converted)} units converted in place")
        self.inplace_model = self.assemble(
            [((u.index,), INPLACE if u.index in self.converted else KEEP) for u in self.units],
            observe=True)
        self.inplace = record(self.inplace_model, self.count_args, count_ops=True)
        if not self.inplace.rest.same_as(self.keep.rest):
            self.notes.append("in-place conversion changed what the code outside the units "
                              "saves; in-place choices are left out")
            self.converted.clear()
            self.converted_real.clear()
            return
        for u in list(self.converted):
            mine = self.inplace.units.get(u, Saved())
            if mine.same_as(self.keep.units.get(u, Saved())) or u in (
                    self.inplace.output_written | self.inplace.writes_input):
                del self.converted[u]  # saves nothing, or is not safe in this graph
                del self.converted_real[u]
        if not self.compiled:
            self.say("timing the converted layers against the layers they replace")
            for u in self.converted:
                try:
                    self.recovery[u] = unit_recovery_seconds(
                        unit_modules(self.real, self.units[u]), self.converted_real[u],
                        inputs[u] if inputs is not None else ())
                except Exception as error:  # a layer that does not run alone on its input
                    self.notes.append(f"{self.units[u].name}: in place is charged no extra "
                                      f"time: timing its converted layers failed "
                                      f"({type(error).__name__}: {error})")

    # ------------------------------------------------------------ candidates

    def _forward_seconds(self, unit: int, variant: str, recompute: bool = False) -> float:
        """The predicted time of the unit's forward (``recompute``: run again in backward)."""
        run = self.inplace if variant == INPLACE and self.inplace is not None else self.keep
        count = run.forward_ops.get(unit)
        if count is None:
            return 0.0
        return (count.recompute_seconds(self.speed, self.compiled) if recompute
                else count.seconds(self.speed))

    def _candidates(self) -> list[Candidate]:
        found: list[Candidate] = []
        for unit in self.units:
            u = unit.index
            found.append(Candidate((u,), KEEP, self.keep.units.get(u, Saved()), 0.0))
            if u in self.converted and self.inplace is not None:
                # in place costs what its layers were measured to cost beyond the layers they
                # replace (recovery.py; 0 for a model run under torch.compile)
                found.append(Candidate((u,), INPLACE, self.inplace.units.get(u, Saved()),
                                       self.recovery.get(u, 0.0)))
            if self.offload is not None:
                moved = self.offload.transferred.get(u, 0)
                seconds = 0.0
                if self.speed.pcie_bytes_per_s:
                    transfer = moved / self.speed.pcie_bytes_per_s
                    forward = self._forward_seconds(u, KEEP)
                    # each way hides behind the unit's own forward and (about twice as long)
                    # backward; what does not fit is charged
                    seconds = max(0.0, transfer - forward) + max(0.0, transfer - 2 * forward)
                found.append(Candidate((u,), OFFLOAD, self.offload.units.get(u, Saved()),
                                       seconds))
        if "recompute" in self.allow:
            found += self._recompute_candidates()
        return found

    def _runs(self) -> list[tuple[int, ...]]:
        traced = self.segmentation.traced
        on_trace = set(traced.units) if traced is not None else set()
        runs = [(u.index,) for u in self.units if u.single and u.index not in on_trace]
        chains = [chain.units for chain in self.segmentation.chains
                  if not (chain.units and chain.units[0] in on_trace)]
        for units in ([traced.units] if traced is not None else []) + chains:
            for i in range(len(units)):
                for j in range(i, len(units)):
                    runs.append(tuple(units[i:j + 1]))
        return runs

    def _recompute_candidates(self) -> list[Candidate]:
        """Every run, recomputed (and, where a unit converts, recomputed in place), and
        recomputed selectively (all but its products, where it has any). What a run keeps is
        measured by running it under checkpoint on its first unit's recorded input.
        Checkpoint saves the run's inputs before it runs the run, so the runs from one unit
        keep the same storages whatever their length: the shortest and the longest are
        measured, and where they agree (always, so far) the others take that figure; where
        they do not, each run is measured. A selective run keeps its products' outputs too:
        each is measured."""
        found = []
        runs = [r for r in self._runs() if r[0] not in self.keep.writes_input
                and self.keep.inputs.get(r[0])]
        skipped = {u.index for u in self.units} - {r[0] for r in runs}
        for u in sorted(skipped):
            self.notes.append(f"{self.units[u].name}: not recomputed: "
                              + ("its forward writes into its input" if u in
                                 self.keep.writes_input else "it has no tensor input"))
        by_start: dict[int, list[tuple[int, ...]]] = {}
        for units in runs:
            by_start.setdefault(units[0], []).append(units)
        self.say(f"measuring {len(runs)} recomputed runs from {len(by_start)} units")
        for group in by_start.values():
            variants = [(RECOMPUTE, self.keep_model)]
            if any(u in self.converted for units in group for u in units) and (
                    self.inplace_model is not None):
                variants.append((INPLACE_RECOMPUTE, self.inplace_model))
            for choice, model in variants:
                ends = {units: self._measure_run(model, units) for units in (group[0],
                                                                             group[-1])}
                same = ends[group[0]].same_as(ends[group[-1]]) and (
                    ends[group[0]].private == ends[group[-1]].private)
                variant = INPLACE if choice == INPLACE_RECOMPUTE else KEEP
                for units in group:
                    if choice == INPLACE_RECOMPUTE and not any(u in self.converted
                                                               for u in units):
                        continue  # the same as recomputing it as given
                    saved = ends.get(units) or (ends[group[0]] if same
                                                else self._measure_run(model, units))
                    seconds = sum(self._forward_seconds(u, variant, recompute=True)
                                  for u in units)
                    if variant == INPLACE:
                        seconds += sum(self.recovery.get(u, 0.0) for u in units)
                    found.append(Candidate(units, choice, saved, seconds))
            # selective runs across containers too (each is measured: on a traced chain as
            # long as ResNet-50's, 4x3x64x64 on a CPU, planning takes 12 s instead of 4): a
            # run split at a container keeps the tensor there, which one run need not (VGG's
            # features and classifier: torch.compile's budget 0.5 saves exactly what one
            # selective run over both keeps)
            found += self._selective_candidates(group)
        return found

    def _selective_candidates(self, group: list[tuple[int, ...]]) -> list[Candidate]:
        """Each run recomputed selectively, and where it has an expansion (a product whose
        output is larger than its input), lean: the expansions run again too."""
        found = []
        for units in group:
            counts = [c for c in (self.keep.forward_ops.get(u) for u in units) if c is not None]
            if not any(op.product for c in counts for op in c.ops):
                continue  # no product: the same as recomputing it
            if units[-1] in self.keep.output_written:
                continue  # a later operation may write into a product's output it keeps
            for choice, lean in ((SELECTIVE, False), (SELECTIVE_LEAN, True)):
                if lean and not any(c.has_expansion for c in counts):
                    continue  # the same as SELECTIVE
                seconds = sum(c.selective_seconds(self.speed, lean, self.compiled)
                              for c in counts)
                found.append(Candidate(units, choice, self._measure_run(
                    self.keep_model, units, selective=True, lean=lean), seconds))
        return found

    def _measure_run(self, model: nn.Module, units: tuple[int, ...],
                     selective: bool = False, lean: bool = False) -> Saved:
        modules = [m for u in units for m in self._modules(model, self.units[u])]
        return recomputed_saves(modules, self.keep.inputs[units[0]],
                                self.input_identities[units[0]], units[-1], selective, lean)

    # ------------------------------------------------------------ the integer program

    def problem(self) -> Problem:
        producer: dict[Any, int] = {}
        sizes: dict[Any, dict[str, int]] = {}
        identities = set(self.keep.rest.shared)
        for c in self.candidates:
            identities |= set(c.saved.shared)
        for s in identities:
            kind, unit, _ = s
            if kind == "out":
                producer[s] = unit
                by = {KEEP: self.keep.sizes[s]}
                if (self.inplace is not None and unit in self.converted
                        and s in self.inplace.sizes):
                    by[INPLACE] = self.inplace.sizes[s]
                sizes[s] = {"": by[KEEP]} if len(set(by.values())) == 1 else by
            else:
                sizes[s] = {"": self.keep.sizes[s]}
        options = [Option(c.units, c.seconds * 1e3, c.saved.private_bytes,
                          frozenset(c.saved.shared), c.variant, c.choice != KEEP)
                   for c in self.candidates]
        return Problem(len(self.units), options, self.keep.rest.private_bytes,
                       frozenset(self.keep.rest.shared), sizes, producer)

    # ------------------------------------------------------------ the report

    def rows(self, problem: Problem, chosen: Sequence[int]) -> tuple[list[DecisionRow], int]:
        """Rows in model order, and the bytes of the rest."""
        keep_choice = [i for i, c in enumerate(self.candidates) if c.choice == KEEP]
        before = self._attributed(problem, keep_choice)
        after = self._attributed(problem, chosen)
        rows = []
        for i in sorted(chosen, key=lambda i: self.candidates[i].units[0]):
            c = self.candidates[i]
            names = tuple(self.units[u].name for u in c.units)
            segment = names[0] if len(names) == 1 else _run_name(self.units, c.units)
            rows.append(DecisionRow(segment, c.choice, names,
                                    sum(before.get(u, 0) for u in c.units),
                                    sum(after.get(u, 0) for u in c.units), c.seconds * 1e3))
        return rows, self.keep.rest.private_bytes

    def _attributed(self, problem: Problem, chosen: Sequence[int]) -> dict[int, int]:
        """Bytes per unit: private storages of its choice, and the boundary storages it
        produces (outputs) or is first to receive from outside the units (inputs) that some
        choice or the rest keeps."""
        variants = {u: problem.options[i].variant for i in chosen for u in problem.options[i].units}
        identities = set(problem.fixed)
        per_unit: dict[int, int] = {}
        for i in chosen:
            identities |= problem.options[i].shared
            units = problem.options[i].units
            per_unit[units[0]] = per_unit.get(units[0], 0) + problem.options[i].private
        for s in identities:
            per_unit[s[1]] = per_unit.get(s[1], 0) + problem.size(s, variants)
        return per_unit


def _run_name(units: Sequence[Unit], indices: Sequence[int]) -> str:
    first, last = units[indices[0]], units[indices[-1]]
    if first.container == last.container:
        start = first.children[0]
        stop = last.children[-1]
        prefix = f"{first.container}." if first.container else ""
        return f"{prefix}{start}-{stop}"
    return f"{first.name}..{last.name}"


def _count(model: nn.Module, args: tuple) -> int:
    with preserved(model), same_randomness(args):
        return saved_tensor_bytes(model.train(), *args)


class _Inputs(Observer):
    def __init__(self) -> None:
        self.inputs: dict[int, tuple[Tensor, ...]] = {}

    def enter(self, unit: int, inputs: Sequence[Any]) -> None:
        self.inputs[unit] = tuple(t.detach().clone() for t in tensor_leaves(tuple(inputs)))

    def exit(self, unit: int, outputs: Any) -> None:
        pass


def _unit_inputs(model: nn.Module, args: tuple) -> dict[int, tuple[Tensor, ...]]:
    """Each unit's inputs in one training forward without autograd (``model`` observed)."""
    found = _Inputs()
    observe(model, found)
    try:
        with preserved(model), same_randomness(args), torch.no_grad():
            model.train()(*args)
    finally:
        observe(model, None)
    return found.inputs


def _put(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    if not path:
        return module
    model.set_submodule(path, module)
    return model


def plan(
    model: nn.Module,
    example_input: Tensor | tuple[Any, ...],
    budget: int | float,
    *,
    policy: str = "lossless",
    allow: Sequence[str] = ALLOWED,
    time_limit: float = 10.0,
    verify: bool = True,
    timing_device: torch.device | str | None = None,
    progress: Callable[[str], None] | None = None,
    compiled: bool = False,
) -> tuple[nn.Module, PlanReport]:
    """The plan of least predicted time whose activation memory fits ``budget``; returns
    ``(planned model, report)``. ``model`` is not modified.

    The model is cut into units (``nn.Sequential`` chains grouped at each layer with its own
    weights, e.g. conv + norm + activation, a ResNet block; and modules forward calls once
    outside chains). Each unit is kept as it is, converted in place (:func:`iabn.convert` on
    the unit), recomputed in backward (alone or as a run of consecutive units of one chain:
    ``torch.utils.checkpoint``, running statistics updated once), both, recomputed
    selectively (all but its convolutions and matrix products, whose outputs are kept), or
    offloaded to host memory (CUDA only). The saved bytes of every choice are measured exactly (as
    :func:`iabn.memory.saved_tensor_bytes` counts them, with storages shared by neighbouring
    units counted once); the time of each choice is predicted from the operations it
    recomputes or the bytes it transfers and the device's measured speed (for eager steps,
    or with ``compiled=True`` for a model that will run under ``torch.compile``). An integer program
    (``scipy.optimize.milp``) picks the plan. See docs/design.md, "Planning memory".

    Args:
        model: the network (in training, as it will run; its buffers are left untouched).
        example_input: a tensor or a tuple of forward's arguments, at the training batch's
            shape, on the model's device (``meta`` counts bytes without memory; the speed is
            then measured on ``timing_device``, default CPU).
        budget: bytes (int), or a fraction in (0, 1] (float) of the activation memory of the
            model as given at ``example_input``.
        policy: :func:`iabn.convert`'s policy for in-place units (``"leaky_relu"`` changes the
            model).
        allow: which of ``"inplace"``, ``"recompute"``, ``"offload"`` may be used.
        time_limit: seconds for the solver; when it runs out the best plan found so far is
            returned and the report says so.
        verify: run a backward pass through the planned model (not on ``meta``).
        timing_device: the device whose speed the time model uses (default: the input's).
        progress: called with a line of text at each stage.
        compiled: predict the times of a model that will run under ``torch.compile``: there
            the recomputed operations other than convolutions and matrix products are fused
            into the backward's kernels and cost no time of their own (:mod:`.cost`). The
            bytes are still those of the eager model: the compiled graphs save what the
            compiler's partitioner chooses (:func:`iabn.memory.compiled_saved_bytes`
            measures it).

    Raises:
        ValueError: the budget is below the smallest reachable activation memory (the message
            gives that figure), or an argument is invalid.
    """
    args, allowed = _check_arguments(model, example_input, budget, policy, allow, time_limit)
    if not isinstance(compiled, bool):
        raise TypeError(f"compiled must be True or False, got {compiled!r}")
    # the caller's random streams stay as they were (the calibration draws numbers)
    devices = sorted({a.device.index or 0 for a in args
                      if isinstance(a, Tensor) and a.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            return _plan(model, args, budget, policy, allowed, time_limit, verify,
                         timing_device, progress, compiled)
        finally:
            caches.release()  # the buffers that emptied the caches for the timings


def _plan(model: nn.Module, args: tuple, budget: int | float, policy: str,
          allowed: tuple[str, ...], time_limit: float, verify: bool,
          timing_device: torch.device | str | None,
          progress: Callable[[str], None] | None,
          compiled: bool) -> tuple[nn.Module, PlanReport]:
    started = time.perf_counter()
    say = progress or (lambda _text: None)
    planner = Planner(model, args, policy, allowed, timing_device, say, verify, compiled)
    limit = (int(budget) if isinstance(budget, numbers.Integral)
             else math.floor(float(budget) * planner.as_given))
    problem = planner.problem()
    say(f"solving: {len(problem.options)} candidates")
    solve_start = time.perf_counter()
    try:
        least, fewest, proven, lower = smallest(problem, time_limit)
    except SolverTimeout:
        raise ValueError(f"time_limit={time_limit:g}: the solver found no plan in time; give "
                         f"it more seconds") from None
    if limit < least:
        reach = (f"the smallest activation memory reachable with allow={allowed} is {least} "
                 f"bytes ({least / planner.as_given:.4f} of the {planner.as_given} bytes of "
                 f"the model as given)") if proven else (
                 f"no plan within it was found within time_limit={time_limit:g} s (the "
                 f"smallest found is {least} bytes, at least {math.ceil(lower)} may be "
                 f"reachable)")
        raise ValueError(f"budget={budget!r} ({limit} bytes) is out of reach: {reach}; give "
                         f"budget >= {least}"
                         + ("" if set(allowed) == set(ALLOWED) else
                            " or allow more choices"))
    remaining = max(time_limit - (time.perf_counter() - solve_start), 1e-3)
    try:
        solution = solve(problem, limit, remaining)
    except SolverTimeout:  # the plan of fewest bytes fits: better than none
        solution = Solution(fewest, "time limit", time.perf_counter() - solve_start, None, [
            "the time limit ended the search before it found a plan of less time than the "
            "plan of fewest bytes, which is this one"])
    chosen = solution.chosen
    predicted = problem.saved_bytes(chosen)
    blocks = [(planner.candidates[i].units, planner.candidates[i].choice) for i in chosen]
    say("building the planned model")
    planned = planner.assemble(blocks, real=True)
    measured = _count(planned, args)
    if planner.verify:
        _verify(planned, args)
    rows, rest = planner.rows(problem, chosen)
    notes = list(planner.notes) + solution.notes
    if solution.status != "optimal":
        notes.append(f"the solver stopped at time_limit={time_limit:g} s: this is the best plan "
                     f"found by then, not proven optimal"
                     + (f" (a bound on the least extra time: {solution.bound:.3f} ms)"
                        if solution.bound is not None else ""))
    if measured != predicted:
        notes.append(f"the measured bytes ({measured}) differ from the prediction "
                     f"({predicted}): please report this model")
    if not planner.units:
        notes.append("no units: forward calls no module once with tensors only (see "
                     "docs/design.md, \"Planning memory\"); the model is returned as given")
    for path, why in planner.segmentation.skipped:
        notes.append(f"{path}: not a unit: {why}")
    segmentation = planner.segmentation
    if segmentation.traced_note is not None:
        notes.append(f"runs do not cross containers: {segmentation.traced_note}")
    if traced_plan(planned) is not None and segmentation.traced is not None:
        crossed = [c.path for c in segmentation.chains
                   if c.units and c.units[0] in segmentation.traced.units]
        notes.append(f"a run crosses containers: the model runs its forward as traced by "
                     f"torch.fx, which calls the modules of {', '.join(crossed)} itself (their "
                     f"own forward and hooks do not run)")
    step = (sum(c.seconds(planner.speed) for c in planner.keep.forward_ops.values())
            + (planner.keep.backward_ops.seconds(planner.speed)
               if planner.keep.backward_ops is not None else 0.0)) * 1e3
    report = PlanReport(
        policy=policy, allow=list(allowed),
        example_shape=[list(t.shape) for t in args if isinstance(t, Tensor)],
        device=str(planner.device), budget=limit, rows=rows, as_given=planner.as_given,
        predicted=predicted, measured=measured, smallest=least, rest_bytes=rest,
        predicted_step_ms=step, predicted_overhead_ms=problem.cost(chosen),
        solver_status=solution.status, solver_seconds=solution.seconds,
        speed=planner.speed.to_dict(), candidates=len(problem.options), notes=notes,
        compiled=compiled)
    say(f"planned in {time.perf_counter() - started:.1f} s")
    return planned, report


def _verify(planned: nn.Module, args: tuple) -> None:
    """A backward pass through the planned model (on a copy): a plan whose backward fails
    where the model's own runs would be a bug."""
    probe = _deepcopy(planned)
    with same_randomness(args):
        out = probe.train()(*args)
    roots = [t for t in tensor_leaves(out) if t.requires_grad]
    if roots:
        torch.autograd.backward([r.float().sum() for r in roots])


__all__ = ["ALLOWED", "POLICIES", "Planner", "plan"]
