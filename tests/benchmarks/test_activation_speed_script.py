"""Smoke run of benchmarks/activation_speed.py on a tiny shape: a row per activation with both
timings, the paired ratio inside its quartiles, the load average, written to the named file."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_speed.py"


def _script():
    spec = importlib.util.spec_from_file_location("activation_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_a_row_per_activation(tmp_path):
    out = tmp_path / "speed.json"
    rows = _script().main(["--shape", "2,3,8", "--repeats", "3", "--names", "gelu,silu",
                           "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [row["name"] for row in saved["rows"]] == ["gelu", "silu"] == [r["name"] for r in rows]
    for row in saved["rows"]:
        assert row["ours_ms"] > 0 and row["torch_ms"] > 0
        low, high = row["ratio_quartiles"]
        assert low <= row["ratio_median"] <= high
        assert len(row["loadavg_before"]) == 3
    assert saved["shape"] == [2, 3, 8] and saved["machine"]["torch_version"]
