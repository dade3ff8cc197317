"""Smoke run of benchmarks/plan_anchors.py on a small input: every strategy it compares is
measured and timed, and the plan rows' bytes are iabn.memory's counts within the budget. The
compiled rows compile with ``aot_eager`` (the graphs, without Inductor's code generation).
Also its command line (the GPU campaign's ``plan`` part runs it with ``--device cuda``) and,
on CUDA, its allocator peak of one step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_anchors.py"


@pytest.mark.slow
@pytest.mark.without_gpu
def test_small_run_measures_and_times_every_strategy(tmp_path):
    out = tmp_path / "anchors.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "vgg19_bn", "--size", "32", "--batch", "2",
         "--repeats", "1", "--warmup", "0", "--compile-budgets", "1,0.5", "--plan-budgets",
         "0.5", "--allow", "recompute", "--compile-backend", "aot_eager", "--control",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())["results"][0]
    rows = result["rows"]
    assert list(rows) == ["eager", "checkpoint_sqrt", "compile_1", "compile_1_again",
                          "compile_0.5", "compile_0.5_again", "plan_0.5",
                          "plan_at_checkpoint_sqrt", "plan_at_compile_0.5",
                          "plan_compiled_at_compile_0.5"]
    assert all(r["step_ms"] > 0 for r in rows.values())
    assert rows["eager"]["bytes"] == result["as_given_bytes"]
    assert rows["plan_0.5"]["bytes"] == rows["plan_0.5"]["predicted_bytes"]
    assert rows["plan_0.5"]["bytes"] <= 0.5 * result["as_given_bytes"]
    assert rows["checkpoint_sqrt"]["bytes"] < result["as_given_bytes"]
    # the plan at checkpointing's bytes, and the comparison at the same memory
    at_sqrt = rows["plan_at_checkpoint_sqrt"]
    assert at_sqrt["bytes"] <= rows["checkpoint_sqrt"]["bytes"] == at_sqrt["budget"]
    entries = {e["anchor"]: e for e in result["at_the_same_bytes"]}
    assert list(entries) == ["checkpoint_sqrt", "compile_0.5"]
    entry = entries["checkpoint_sqrt"]
    assert entry["anchor_baseline"] == "eager" and "compiled_plan_overhead" not in entry
    eager = rows["eager"]["step_ms"]
    assert entry["plan_overhead"] == round(at_sqrt["step_ms"] / eager - 1, 4)
    assert entry["anchor_overhead"] == round(rows["checkpoint_sqrt"]["step_ms"] / eager - 1, 4)
    # the compiled plan: its compiled graphs save at most the compile anchor's bytes, and its
    # overhead is over compile_1, as the anchor's
    compiled_plan, anchor = rows["plan_compiled_at_compile_0.5"], rows["compile_0.5"]
    assert 0 < compiled_plan["bytes"] <= anchor["bytes"] < rows["compile_1"]["bytes"]
    assert compiled_plan["first_step_s"] >= 0
    assert compiled_plan["graphs"] >= 1 and compiled_plan["graph_breaks"] == 0
    assert compiled_plan["eager_bytes"] <= compiled_plan["budget"]
    entry = entries["compile_0.5"]
    assert entry["anchor_baseline"] == "compile_1"
    assert entry["compiled_plan_bytes"] == compiled_plan["bytes"]
    base = rows["compile_1"]["step_ms"]
    assert entry["compiled_plan_overhead"] == round(compiled_plan["step_ms"] / base - 1, 4)
    assert entry["anchor_overhead"] == round(anchor["step_ms"] / base - 1, 4)
    # the control: compile_0.5 compiled a second time, the same bytes, its own time
    again = rows["compile_0.5_again"]
    assert again["bytes"] == anchor["bytes"]
    assert entry["control_overhead"] == round(again["step_ms"] / base - 1, 4)
    assert "control_overhead" not in entries["checkpoint_sqrt"]


@pytest.mark.slow
@pytest.mark.without_gpu
def test_without_anchor_plans_only_the_fixed_budgets_are_planned(tmp_path):
    """--no-anchor-plans (the campaign's CPU smoke run): no plan at an anchor's bytes, no
    comparison at the same bytes; the machine record says the figures are a CPU's."""
    out = tmp_path / "anchors.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "vgg19_bn", "--size", "32", "--batch", "2",
         "--repeats", "1", "--warmup", "0", "--compile-budgets=", "--plan-budgets", "0.5",
         "--allow", "recompute", "--no-anchor-plans", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    result = report["results"][0]
    assert list(result["rows"]) == ["eager", "checkpoint_sqrt", "plan_0.5"]
    assert result["at_the_same_bytes"] == []
    assert result["rows"]["plan_0.5"]["bytes"] <= 0.5 * result["as_given_bytes"]
    assert not any("peak_step_bytes" in row for row in result["rows"].values())
    machine = report["machine"]
    assert machine["device_type"] == "cpu" and machine["device_name"].startswith("cpu")


@pytest.mark.parametrize("argv, message", [
    (["--device", "xpu"], "--device: 'xpu'; use cpu or cuda"),
    (["--device", "gpu0"], "--device: 'gpu0' is not a device"),
    (["--models", "resnet18"], "--models: unknown ['resnet18']"),
])
def test_usage_errors_exit_2_naming_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        _load_script().parse_args(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.without_gpu
def test_cuda_on_a_machine_without_it_exits_2(capsys):
    with pytest.raises(SystemExit) as stopped:
        _load_script().parse_args(["--device", "cuda"])
    assert stopped.value.code == 2
    assert "this machine has no CUDA device; use --device cpu" in capsys.readouterr().err


def test_the_default_results_file_is_named_by_the_device_type(tmp_path):
    args = _load_script().parse_args(["--models", "resnet50"])
    assert args.json.name == "plan_anchors_cpu.json" and args.models == ["resnet50"]


@pytest.mark.gpu
def test_peak_step_bytes_is_the_allocator_peak_above_the_start():
    import torch

    device = torch.device("cuda")
    held = torch.empty(2**20, device=device)  # allocated before the step: not counted

    def step():
        torch.empty(2**22, dtype=torch.uint8, device=device)  # 4 MiB, freed at once

    assert _load_script().peak_step_bytes(step, device) == 2**22
    del held


def test_each_compiled_row_compiles_its_own_graphs():
    """Dynamo reuses a graph compiled for another instance of the same class when the backend
    is the same: each compiled anchor must compile its own, under its own budget."""
    import importlib.util

    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    spec = importlib.util.spec_from_file_location("plan_anchors", SCRIPT)
    anchors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(anchors)
    x = torch.randn(2, 3, 8, 8)
    torch._dynamo.reset()
    counters.clear()
    try:
        for budget in (1.0, 0.5):
            model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()).train()
            anchors.compiled(model, budget, "aot_eager")(x).sum().backward()
        assert counters["stats"]["unique_graphs"] == 2
    finally:
        torch._dynamo.reset()


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_anchors_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Planned:
    def __init__(self, eager, compiled):
        self.eager, self.compiled = eager, compiled

    def train(self):
        return self


class _Plans:
    """A scripted planner: a budget gives the fullest of ``plans`` (eager bytes, compiled
    bytes) whose eager bytes fit it, as iabn.plan's bytes are at most its budget."""

    def __init__(self, plans):
        self.plans = sorted(plans)
        self.budgets = []

    def plan(self, model, x, budget, **kwargs):
        import types

        self.budgets.append(budget)
        fitting = [p for p in self.plans if p[0] <= budget]
        if not fitting:
            raise ValueError("budget out of reach")
        eager, compiled = fitting[-1]
        report = types.SimpleNamespace(counts={}, predicted=eager, overhead=0.0,
                                       solver_status="optimal", rows=[])
        return _Planned(eager, compiled), report


@pytest.mark.parametrize("plans, anchor, expected", [
    # compiled bytes below the eager ones: the search goes up to the fullest under the anchor
    ([(100, 80), (120, 98), (123, 101), (130, 110)], 100, (120, 98)),
    # compiled above the eager ones: it goes down
    ([(60, 50), (90, 102), (100, 105)], 100, (60, 50)),
    # the first plan fits exactly: one plan
    ([(100, 100), (150, 120)], 100, (100, 100)),
])
def test_compiled_plan_search_keeps_the_fullest_under_the_anchor(monkeypatch, plans, anchor,
                                                                expected):
    """compiled_plan's search over budgets (iabn.plan and the compiled bytes scripted): the
    plan kept is the one with the most compiled bytes not above the anchor, found within
    PLANS_PER_ANCHOR plans, and no budget is tried at or above the eager bytes of a plan
    found too large."""
    import argparse

    script = _load_script()
    scripted = _Plans(plans)
    monkeypatch.setattr(script.iabn, "plan", scripted.plan)
    monkeypatch.setattr(script, "compiled_saved_bytes", lambda model, x: model.compiled)
    monkeypatch.setattr(script, "saved", lambda model, x: model.eager)
    monkeypatch.setattr(script.torch, "compile", lambda model, backend: model)
    args = argparse.Namespace(allow=("recompute",), time_limit=1.0,
                              compile_backend="aot_eager")
    row, forward = script.compiled_plan(object(), None, anchor, args, lambda text: None)
    assert (row["eager_bytes"], row["bytes"]) == expected
    assert forward is not None and (forward.model.eager, forward.model.compiled) == expected
    assert len(scripted.budgets) <= script.PLANS_PER_ANCHOR
    # the plan each tried budget gave (None: out of reach), in the order tried
    returned = [max((p for p in plans if p[0] <= b), default=None) for b in scripted.budgets]
    for i, budget in enumerate(scripted.budgets):
        too_large = [p[0] for p in returned[:i] if p is not None and p[1] > anchor]
        assert not too_large or budget < min(too_large)
