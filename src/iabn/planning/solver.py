"""The plan as an integer program (``scipy.optimize.milp``, HiGHS).

Variables: ``x[c]`` (binary) for each candidate ``c`` (a unit or a run of units with one
choice); ``y[s]`` in [0, 1] for each boundary identity ``s`` some candidate saves (1 when a
chosen candidate saves it: ``y[s] >= x[c]``, summed over candidates that cover one unit and
so exclude each other, which is tighter; fixed at 1 when the rest saves it); where the
size of ``s`` depends on the variant its producer runs (as given or converted), ``w[s, b]``
in [0, 1] with ``w[s, b] >= y[s] + x(producer runs variant b) - 1``. Constraints: every unit is
covered by exactly one chosen candidate; the saved bytes

    constant + sum_c private[c] x[c] + sum_s size[s] y[s] + sum_{s,b} size[s, b] w[s, b]

are at most the budget. The ``y`` and ``w`` are continuous: the bytes constraint only pushes
them down, and at any integer ``x`` their least feasible values are the exact 0/1 indicators,
so the byte figure of a solution is exact, not a relaxation. Objective: the predicted extra
time; among plans of the same time, a second solve takes the fewest changes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Identity = tuple


@dataclass
class Option:
    """One candidate: ``units`` it covers, its predicted extra seconds, private bytes, the
    boundary identities it saves, and ``variant`` (``"keep"`` or ``"inplace"``): which variant
    of its units produces their outputs."""

    units: tuple[int, ...]
    cost: float
    private: int
    shared: frozenset
    variant: str
    change: bool  # not the model as given


@dataclass
class Problem:
    units: int
    options: list[Option]
    constant: int                      # the rest's private bytes
    fixed: frozenset                   # identities the rest saves
    sizes: dict[Any, dict[str, int]]   # identity -> variant -> bytes (or {"": bytes})
    producer: dict[Any, int]           # identity -> unit that produces it (outputs only)

    def size(self, identity: Any, variants: dict[int, str]) -> int:
        by_variant = self.sizes[identity]
        if "" in by_variant:
            return by_variant[""]
        return by_variant[variants[self.producer[identity]]]

    def saved_bytes(self, chosen: Sequence[int]) -> int:
        """The exact bytes of a selection (indices into ``options``): the union of what its
        choices and the rest save."""
        variants = {u: self.options[i].variant for i in chosen for u in self.options[i].units}
        identities = set(self.fixed)
        total = self.constant
        for i in chosen:
            identities |= self.options[i].shared
            total += self.options[i].private
        return total + sum(self.size(s, variants) for s in identities)

    def cost(self, chosen: Sequence[int]) -> float:
        return sum(self.options[i].cost for i in chosen)


@dataclass
class Solution:
    chosen: list[int]
    status: str          # "optimal" or "time limit"
    seconds: float
    bound: float | None = None  # proven bound of the objective when not optimal
    notes: list[str] = field(default_factory=list)


def _scipy() -> None:
    try:
        import scipy.optimize  # noqa: F401
    except ImportError:
        raise ImportError("iabn.plan solves its integer program with SciPy "
                          "(scipy.optimize.milp, SciPy >= 1.9): pip install scipy") from None


class _Model:
    """The matrices of :class:`Problem`, built once."""

    def __init__(self, problem: Problem) -> None:
        _scipy()
        from scipy.sparse import coo_matrix

        self.problem = problem
        options = problem.options
        identities = sorted({s for o in options for s in o.shared} | set(problem.fixed),
                            key=repr)
        self.n_x = len(options)
        self.y = {s: self.n_x + k for k, s in enumerate(identities)}
        w_keys = [(s, v) for s in identities if "" not in problem.sizes[s]
                  for v in problem.sizes[s]]
        self.w = {key: self.n_x + len(identities) + k for k, key in enumerate(w_keys)}
        n = self.n_x + len(identities) + len(w_keys)
        self.n = n
        rows: list[tuple[dict[int, float], float, float]] = []
        for unit in range(problem.units):  # each unit covered once
            rows.append(({i: 1.0 for i, o in enumerate(options) if unit in o.units}, 1.0, 1.0))
        # y[s] >= x[c] for every c saving s, aggregated: candidates that cover one unit
        # exclude each other, so y[s] >= (sum of those that save s) holds and is tighter
        groups: dict[tuple, list[int]] = {}
        for i, o in enumerate(options):
            for s in o.shared:
                near = min(o.units, key=lambda u, s=s: (abs(u - s[1]), u))
                groups.setdefault((s, near), []).append(i)
        for (s, _), members in groups.items():
            coefficients = {self.y[s]: 1.0}
            coefficients.update({i: -1.0 for i in members})
            rows.append((coefficients, 0.0, np.inf))
        for (s, variant), column in self.w.items():  # w >= y + x(producer in variant) - 1
            unit = problem.producer[s]
            coefficients = {column: 1.0, self.y[s]: -1.0}
            for i, o in enumerate(options):
                if unit in o.units and o.variant == variant:
                    coefficients[i] = -1.0
            rows.append((coefficients, -1.0, np.inf))
        self.bytes = np.zeros(n)
        for i, o in enumerate(options):
            self.bytes[i] = o.private
        for s, column in self.y.items():
            if "" in problem.sizes[s]:
                self.bytes[column] = problem.sizes[s][""]
        for (s, variant), column in self.w.items():
            self.bytes[column] = problem.sizes[s][variant]
        self.cost = np.zeros(n)
        self.cost[:self.n_x] = [o.cost for o in options]
        self.changes = np.zeros(n)
        self.changes[:self.n_x] = [1.0 if o.change else 0.0 for o in options]
        entries = [(r, column, value) for r, (coefficients, _, _) in enumerate(rows)
                   for column, value in coefficients.items()]
        r_index, c_index, values = zip(*entries, strict=True) if entries else ((), (), ())
        self.matrix = coo_matrix((values, (r_index, c_index)), shape=(len(rows), n)).tocsr()
        self.lower = np.array([lo for _, lo, _ in rows], dtype=float)
        self.upper = np.array([hi for _, _, hi in rows], dtype=float)
        self.integrality = np.zeros(n)
        self.integrality[:self.n_x] = 1
        self.lb = np.zeros(n)
        self.ub = np.ones(n)
        for s in problem.fixed:
            self.lb[self.y[s]] = 1.0

    def solve(self, objective: np.ndarray, extra: list[tuple[np.ndarray, float, float]],
              time_limit: float) -> Any:
        from scipy.optimize import Bounds, LinearConstraint, milp

        constraints = [LinearConstraint(self.matrix, self.lower, self.upper)]
        constraints += [LinearConstraint(row.reshape(1, -1), lo, hi) for row, lo, hi in extra]
        return milp(objective, integrality=self.integrality, bounds=Bounds(self.lb, self.ub),
                    constraints=constraints,
                    options={"time_limit": max(time_limit, 1e-3), "mip_rel_gap": 0.0,
                             "presolve": True})

    def chosen(self, x: np.ndarray) -> list[int]:
        return [i for i in range(self.n_x) if x[i] > 0.5]


class SolverTimeout(RuntimeError):
    """No plan was found within the time limit."""


def smallest(problem: Problem, time_limit: float) -> tuple[int, list[int], bool, float]:
    """The fewest bytes any plan reaches: ``(bytes, selection, proven, lower bound)``."""
    if not problem.options:  # nothing to choose: the model as given
        return problem.saved_bytes([]), [], True, problem.saved_bytes([])
    model = _Model(problem)
    result = model.solve(model.bytes, [], time_limit)
    if result.x is None:
        raise SolverTimeout(f"no plan found within time_limit={time_limit:g} s")
    chosen = model.chosen(result.x)
    proven = result.status == 0
    bound = getattr(result, "mip_dual_bound", None)
    lower = problem.saved_bytes(chosen) if proven else (
        problem.constant + float(bound) if bound is not None else 0.0)
    return problem.saved_bytes(chosen), chosen, proven, lower


def solve(problem: Problem, budget: int, time_limit: float) -> Solution:
    """The plan of least predicted time within ``budget`` bytes (then the fewest changes)."""
    start = time.perf_counter()
    if not problem.options:
        return Solution([], "optimal", 0.0)
    model = _Model(problem)
    limit = [(model.bytes, -np.inf, float(budget - problem.constant))]
    result = model.solve(model.cost, limit, time_limit)
    if result.x is None:
        raise SolverTimeout(f"no plan within the budget was found within time_limit="
                            f"{time_limit:g} s")
    chosen = model.chosen(result.x)
    status = "optimal" if result.status == 0 else "time limit"
    bound = None if result.status == 0 else getattr(result, "mip_dual_bound", None)
    notes = []
    left = time_limit - (time.perf_counter() - start)
    if result.status == 0 and left > 0 and any(problem.options[i].change for i in chosen):
        best = problem.cost(chosen)
        ceiling = best * (1 + 1e-9) + 1e-12
        second = model.solve(model.changes, [*limit, (model.cost, -np.inf, ceiling)], left)
        if second.x is not None:
            candidate = model.chosen(second.x)
            if problem.cost(candidate) <= ceiling and len(
                    [i for i in candidate if problem.options[i].change]) <= len(
                    [i for i in chosen if problem.options[i].change]):
                chosen = candidate
        if second.status != 0:
            notes.append("the time limit ended the search for the plan with the fewest "
                          "changes; the plan is still of least predicted time")
    return Solution(chosen, status, time.perf_counter() - start,
                    None if bound is None else float(bound), notes)


__all__ = ["Option", "Problem", "Solution", "SolverTimeout", "smallest", "solve"]
