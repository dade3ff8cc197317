"""Smoke run of benchmarks/plan_anchors.py on a small input: every strategy it compares is
measured and timed, and the plan rows' bytes are iabn.memory's counts within the budget."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.without_gpu

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_anchors.py"


def test_small_run_measures_and_times_every_strategy(tmp_path):
    out = tmp_path / "anchors.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--models", "vgg19_bn", "--size", "32", "--batch", "2",
         "--repeats", "1", "--warmup", "0", "--compile-budgets", "", "--plan-budgets", "0.5",
         "--allow", "recompute", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())["results"][0]
    rows = result["rows"]
    assert list(rows) == ["eager", "checkpoint_sqrt", "plan_0.5", "plan_at_checkpoint_sqrt"]
    assert all(r["step_ms"] > 0 for r in rows.values())
    assert rows["eager"]["bytes"] == result["as_given_bytes"]
    assert rows["plan_0.5"]["bytes"] == rows["plan_0.5"]["predicted_bytes"]
    assert rows["plan_0.5"]["bytes"] <= 0.5 * result["as_given_bytes"]
    assert rows["checkpoint_sqrt"]["bytes"] < result["as_given_bytes"]
    # the plan at checkpointing's bytes, and the comparison at the same memory
    at_sqrt = rows["plan_at_checkpoint_sqrt"]
    assert at_sqrt["bytes"] <= rows["checkpoint_sqrt"]["bytes"] == at_sqrt["budget"]
    [entry] = result["at_the_same_bytes"]
    assert entry["anchor"] == "checkpoint_sqrt" and entry["anchor_baseline"] == "eager"
    eager = rows["eager"]["step_ms"]
    assert entry["plan_overhead"] == round(at_sqrt["step_ms"] / eager - 1, 4)
    assert entry["anchor_overhead"] == round(rows["checkpoint_sqrt"]["step_ms"] / eager - 1, 4)
