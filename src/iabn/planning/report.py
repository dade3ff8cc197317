"""What :func:`iabn.plan` decided: one row per decision, totals, a table and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class DecisionRow:
    """One segment of the plan: a unit, or a run of units recomputed together.

    ``kept_before``/``kept_after``: activation bytes attributed to the segment as given and
    as planned (its own storages plus the boundary storages it produces or receives from
    outside the units that anyone keeps; the rows and :attr:`PlanReport.rest_bytes` add up to
    the total exactly). ``predicted_ms``: the extra time the choice is predicted to cost
    per training step."""

    segment: str
    choice: str
    units: tuple[str, ...]
    kept_before: int
    kept_after: int
    predicted_ms: float

    @property
    def saved(self) -> int:
        return self.kept_before - self.kept_after


@dataclass
class PlanReport:
    """What :func:`iabn.plan` did. ``print(report)`` shows the table."""

    policy: str
    allow: list[str]
    example_shape: list[list[int]]
    device: str
    budget: int
    rows: list[DecisionRow]
    as_given: int           # activation bytes of the model as given (iabn.memory)
    predicted: int          # the plan's bytes by the per-unit accounting
    measured: int | None    # iabn.memory's count of the returned model
    smallest: int           # the fewest bytes any plan with these choices reaches
    rest_bytes: int         # bytes saved outside every unit (not plannable)
    predicted_step_ms: float        # the model as given: forward + backward, predicted
    predicted_overhead_ms: float    # the plan's extra time, predicted
    solver_status: str      # "optimal" or "time limit" (the best plan found by then)
    solver_seconds: float
    speed: dict[str, Any] = field(default_factory=dict)  # the cost model's measured rates
    candidates: int = 0
    notes: list[str] = field(default_factory=list)
    compiled: bool = False  # times predicted for a model run under torch.compile

    @property
    def overhead(self) -> float:
        """Predicted extra time as a fraction of the predicted step time."""
        return (self.predicted_overhead_ms / self.predicted_step_ms
                if self.predicted_step_ms else 0.0)

    @property
    def counts(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for row in self.rows:
            found[row.choice] = found.get(row.choice, 0) + 1
        return dict(sorted(found.items()))

    def to_dict(self) -> dict:
        data = asdict(self)
        for row, source in zip(data["rows"], self.rows, strict=True):
            row["saved"] = source.saved
        data.update(counts=self.counts, overhead=self.overhead,
                    ratio=self.predicted / self.as_given if self.as_given else None)
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    def table(self) -> str:
        header = ("segment", "choice", "kept before", "after", "saved", "predicted ms")
        lines = [(r.segment, r.choice, _bytes(r.kept_before), _bytes(r.kept_after),
                  _bytes(r.saved), f"{r.predicted_ms:.3f}") for r in self.rows]
        widths = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
        out = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
               for row in (header, *lines)]
        shapes = ", ".join("x".join(map(str, s)) for s in self.example_shape)
        counts = ", ".join(f"{n} {c}" for c, n in self.counts.items()) or "none"
        out.append("")
        out.append(f"policy {self.policy}; allowed {', '.join(self.allow) or 'nothing'}; "
                   f"{len(self.rows)} segments: {counts}")
        out.append(f"activation memory at {shapes} on {self.device}: as given "
                   f"{_bytes(self.as_given)}, budget {_bytes(self.budget)}, planned "
                   f"{_bytes(self.predicted)}{_ratio(self.predicted, self.as_given)}, measured "
                   + ("not measured" if self.measured is None else _bytes(self.measured)))
        out.append(f"smallest reachable: {_bytes(self.smallest)}"
                   f"{_ratio(self.smallest, self.as_given)}; outside the segments: "
                   f"{_bytes(self.rest_bytes)}")
        out.append(f"predicted step time {self.predicted_step_ms:.2f} ms, plan overhead "
                   f"{self.predicted_overhead_ms:.2f} ms ({100 * self.overhead:.1f} %)"
                   + (" under torch.compile" if self.compiled else ""))
        out.append(f"solver: {self.solver_status} ({self.candidates} candidates, "
                   f"{self.solver_seconds:.2f} s)")
        out.extend(f"note: {note}" for note in self.notes)
        return "\n".join(out)

    __str__ = table


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{n} B"


def _ratio(after: int, before: int) -> str:
    return f" ({after / before:.3f}x)" if before else ""


__all__ = ["DecisionRow", "PlanReport"]
