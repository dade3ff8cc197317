"""Smoke run of benchmarks/host_overhead.py on CPU: a row per shape with every provider's time
and its ratio to BatchNorm + activation, side by side from one run; usage errors exit 2."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "host_overhead.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_quick_cpu_run_writes_times_and_ratios(tmp_path):
    out = tmp_path / "host.json"
    done = _run("--device", "cpu", "--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["torch_version"] and report["device"] == "cpu"
    assert [row["shape"] for row in report["rows"]] == [[2, 8, 4, 4], [8, 64, 8, 8]]
    for row in report["rows"]:
        assert set(row["us_per_call"]) == {"bn", "iabn", "noop_function"}
        assert all(len(v) == 3 for v in row["samples_ms"].values())  # --quick: 3 repeats
        for name, us in row["us_per_call"].items():
            assert us > 0
            assert row["ratio_to_bn"][name] == us / row["us_per_call"]["bn"]
        assert "x" in done.stdout


def test_bad_repeats_is_a_usage_error(tmp_path):
    done = _run("--device", "cpu", "--repeats", "0", "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert not (tmp_path / "x.json").exists()
