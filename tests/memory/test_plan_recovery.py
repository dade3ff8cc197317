"""The planner's in-place cost (planning/recovery.py): converted layers paired with the layers
they replace, timed on the inputs those received, and the sum carried into the plan's
candidates. The pairing and the sums are checked with a fixed stand-in for the timing (timings
on a shared machine cannot be asserted); one real timing checks only its sign and caching."""

import copy

import pytest
import torch
from torch import nn

import iabn
from iabn.planning import caches, recovery
from iabn.planning.planner import Planner
from iabn.planning.wrappers import INPLACE


class MLPBlock(nn.Module):
    """A pre-norm transformer MLP block: LayerNorm -> Linear -> GELU -> Linear, residual."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), MLPBlock(), MLPBlock(), nn.Linear(16, 4))


def _converted_unit():
    """A block after a linear layer (so that its norm's input is not the model's: converted
    too), and its conversion."""
    torch.manual_seed(1)
    unit = nn.Sequential(nn.Linear(16, 16), MLPBlock())
    converted, _ = iabn.convert(copy.deepcopy(unit), torch.randn(2, 5, 16))
    return unit, converted


def test_pairs_are_the_replaced_leaves_at_the_same_path():
    unit, converted = _converted_unit()
    pairs = recovery.layer_pairs([unit], [converted])
    assert [(type(a), type(b)) for a, b in pairs] == [
        (nn.LayerNorm, iabn.InPlaceLayerNorm), (nn.GELU, iabn.InPlaceGELU)]


def test_unit_cost_sums_its_pairs_on_the_inputs_they_received(monkeypatch):
    seen = []

    def fixed(replaced, layer, x, repeats=recovery.REPEATS):
        seen.append((type(replaced).__name__, tuple(x.shape)))
        return {"LayerNorm": 0.25, "GELU": 1.0}[type(replaced).__name__]

    monkeypatch.setattr(recovery, "pair_seconds", fixed)
    unit, converted = _converted_unit()
    cost = recovery.unit_recovery_seconds([unit], [converted], (torch.randn(2, 5, 16),))
    assert cost == 1.25
    assert seen == [("LayerNorm", (2, 5, 16)), ("GELU", (2, 5, 64))]


def test_a_faster_converted_unit_costs_nothing(monkeypatch):
    monkeypatch.setattr(recovery, "pair_seconds", lambda *args, **kwargs: -1.0)
    unit, converted = _converted_unit()
    assert recovery.unit_recovery_seconds([unit], [converted], (torch.randn(2, 5, 16),)) == 0


@pytest.mark.slow  # 12 s on 2 cores: a plan of the model; the sums are checked by default
def test_the_planner_charges_each_in_place_unit_its_measured_cost(monkeypatch):
    monkeypatch.setattr(recovery, "pair_seconds", lambda *args, **kwargs: 0.5)
    planner = Planner(_model(), (torch.randn(2, 5, 8),), "lossless", ["inplace"])
    # a unit converted on its own keeps its norm (its input is the unit's input, which the
    # caller keeps): the GELU is the block's one pair
    assert planner.recovery == {1: 0.5, 2: 0.5}
    in_place = {c.units: c.seconds for c in planner.candidates if c.choice == INPLACE}
    assert in_place == {(1,): 0.5, (2,): 0.5}
    smallest = iabn.plan(_model(), torch.randn(2, 5, 8), 1.0, allow=["inplace"])[1].smallest
    report = iabn.plan(_model(), torch.randn(2, 5, 8), smallest, allow=["inplace"])[1]
    assert report.counts.get("inplace") == 2
    assert report.predicted_overhead_ms == pytest.approx(1000.0)


@pytest.mark.slow  # 5 s on 2 cores: a second plan of the model
def test_a_compiled_plan_charges_nothing_for_in_place(monkeypatch):
    monkeypatch.setattr(recovery, "pair_seconds", lambda *args, **kwargs: 0.5)
    planner = Planner(_model(), (torch.randn(2, 5, 8),), "lossless", ["inplace"],
                      compiled=True)
    assert planner.recovery == {}


@pytest.mark.measured_recovery
def test_a_real_timing_is_measured_once():
    recovery._MEASURED.clear()
    x = torch.randn(4, 32, 64)
    first = recovery.pair_seconds(nn.GELU(), iabn.InPlaceGELU(), x, repeats=2)
    assert len(recovery._MEASURED) == 1
    assert recovery.pair_seconds(nn.GELU(), iabn.InPlaceGELU(), x, repeats=2) == first


@pytest.mark.slow  # 5 s on 2 cores: a second plan of the model
def test_a_unit_whose_timing_fails_is_charged_nothing_and_noted(monkeypatch):
    from iabn.planning import planner as planner_module

    def fails(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(planner_module, "unit_recovery_seconds", fails)
    planner = Planner(_model(), (torch.randn(2, 5, 8),), "lossless", ["inplace"])
    assert planner.recovery == {}
    assert {c.seconds for c in planner.candidates if c.choice == INPLACE} == {0.0}
    assert any("timing its converted layers failed (RuntimeError: no kernel)" in note
               for note in planner.notes)


@pytest.mark.measured_recovery
def test_each_forward_and_backward_starts_from_evicted_caches_outside_the_timing(monkeypatch):
    """The caches are emptied before every timed forward and every timed backward, of both
    layers, and the emptying is not timed."""
    events = []
    clock = iter(range(10_000))

    class Recorded(nn.Module):
        def __init__(self, name, inner):
            super().__init__()
            self.name, self.inner = name, inner

        def forward(self, x):
            events.append(("forward", self.name))
            out = self.inner(x)
            out.register_hook(lambda g: events.append(("backward", self.name)))
            return out

    monkeypatch.setattr(caches, "evict", lambda device: events.append(("evict",)))
    def read_clock():
        events.append(("clock",))
        return next(clock)

    monkeypatch.setattr(caches.time, "perf_counter", read_clock)
    recovery._MEASURED.clear()
    repeats = 2
    recovery.pair_seconds(Recorded("given", nn.GELU()), Recorded("ours", iabn.InPlaceGELU()),
                          torch.randn(2, 8), repeats=repeats)
    recovery._MEASURED.clear()
    expected = [e for _ in range(repeats + 1) for name in ("given", "ours")
                for e in (("evict",), ("clock",), ("forward", name), ("clock",),
                          ("evict",), ("clock",), ("backward", name), ("clock",))]
    assert events == expected
