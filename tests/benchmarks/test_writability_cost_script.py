"""Smoke run of benchmarks/writability_cost.py: a row per case with both variants' times and
their paired ratio, the rule restored afterwards; a usage error exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two interpreter starts, ~10 s each on the loaded 2-core VM

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "writability_cost.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_quick_run_writes_a_row_per_case(tmp_path):
    out = tmp_path / "cost.json"
    done = _run("--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["case"] for row in report["rows"]] == [
        "InPlaceABN forward+backward", "InPlaceLayerNorm forward+backward",
        "InPlaceGELU no_grad forward"]
    for row in report["rows"]:
        assert row["with_us"] > 0 and row["without_us"] > 0 and row["ratio"] > 0
    assert report["rule_alone_ns"]["computed tensor, with a node"] > 0


def test_a_bad_repeat_count_is_a_usage_error():
    done = _run("--repeats", "0")
    assert done.returncode == 2 and "--repeats" in done.stderr
