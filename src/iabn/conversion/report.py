"""The conversion report: one row per normalisation layer, totals, a table and JSON."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class LayerRow:
    """One normalisation (or activation) module of the model and what became of it.

    ``decision``: the new layer's class (``InPlaceABN``, ``ABN``, ``InPlaceABNSync``,
    ``ABNSync``, ``InPlaceLayerNorm``, ``InPlaceGELU``...) or ``"untouched"``; ``reason``
    says why.

    ``saved_before``/``saved_after``: bytes of activation memory the norm and its activation
    keep for backward at the example input (storages first saved by their graph nodes; see
    docs/design.md, "Converting existing models"), ``None`` where the layer is not in a part
    converted (a forward that branches on tensor values) or does not run in training mode.
    """

    name: str
    pattern: str
    decision: str
    reason: str
    saved_before: int | None = None
    saved_after: int | None = None


@dataclass
class ConversionReport:
    """What :func:`iabn.convert` did. ``print(report)`` shows the table."""

    policy: str
    example_shape: list[list[int]]
    rows: list[LayerRow]
    saved_before: int          # the whole model's activation bytes at the example input
    saved_after: int
    result: str  # "modules swapped", "torch.fx GraphModule" or "converted by parts"
    result_reason: str
    max_difference_train: float | None = None
    max_difference_eval: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(row.decision for row in self.rows).items()))

    @property
    def norm_saved_before(self) -> int:
        """The normalisation + activation part of :attr:`saved_before` (rows with figures)."""
        return sum(r.saved_before for r in self.rows if r.saved_before is not None
                   and r.saved_after is not None)

    @property
    def norm_saved_after(self) -> int:
        return sum(r.saved_after for r in self.rows if r.saved_before is not None
                   and r.saved_after is not None)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["counts"] = self.counts
        data["norm_saved_before"] = self.norm_saved_before
        data["norm_saved_after"] = self.norm_saved_after
        return data

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kwargs})

    def table(self) -> str:
        header = ("layer", "pattern", "decision", "saved before", "after", "reason")
        lines = [(r.name, r.pattern, r.decision, _bytes(r.saved_before), _bytes(r.saved_after),
                  r.reason) for r in self.rows]
        widths = [max(len(str(x)) for x in column) for column in zip(header, *lines, strict=True)]
        widths[-1] = 0  # the reason is last and not padded
        out = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
               for row in (header, *lines)]
        counts = ", ".join(f"{n} {d}" for d, n in sorted(self.counts.items()))
        out.append("")
        layers = "layer" + "s" * (len(self.rows) != 1)
        out.append(f"policy {self.policy}; {len(self.rows)} {layers}: {counts}")
        out.append(f"norm + activation part: {_bytes(self.norm_saved_before)} -> "
                   f"{_bytes(self.norm_saved_after)}"
                   f"{_ratio(self.norm_saved_after, self.norm_saved_before)}")
        shapes = ", ".join("x".join(map(str, shape)) for shape in self.example_shape)
        out.append(f"whole model, saved for backward at {shapes}: "
                   f"{_bytes(self.saved_before)} -> {_bytes(self.saved_after)}"
                   f"{_ratio(self.saved_after, self.saved_before)}")
        for mode in ("train", "eval"):
            value = getattr(self, f"max_difference_{mode}")
            if value is not None:
                out.append(f"largest output difference from the original, {mode} mode: "
                           f"{value:.3g}")
        out.append(f"result: {self.result} ({self.result_reason})")
        out.extend(f"note: {note}" for note in self.notes)
        return "\n".join(out)

    __str__ = table


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _ratio(after: int, before: int) -> str:
    return f" ({after / before:.3f}x)" if before else ""
