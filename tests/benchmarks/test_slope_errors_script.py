"""Smoke run of benchmarks/slope_errors.py on CPU (the Triton rows under the interpreter): a row
per case with every provider's counts, and a usage error (exit 2) for a malformed shape."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# the CPU run, Triton interpreted; on a CUDA machine the script measures the compiled kernels.
pytestmark = pytest.mark.without_gpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "slope_errors.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cpu_smoke_run_writes_a_row_per_case(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "slopes.json"
    done = _run("--shapes", "2x3x8x8", "--dtypes", "float32,float16", "--layouts",
                "nchw,channels_last", "--seeds", "0,1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["torch_version"]
    rows = report["rows"]
    assert len(rows) == 2 * 2 * 2
    assert {(r["dtype"], r["layout"], r["seed"]) for r in rows} == {
        (d, layout, s) for d in ("float32", "float16") for layout in ("nchw", "channels_last")
        for s in (0, 1)}
    for row in rows:
        assert row["elements"] == 2 * 3 * 8 * 8
        for provider in ("triton", "reference", "torch"):
            # 384 values are too few to expect any element near the kink to flip
            assert row[provider]["mismatched"] == 0, row
            assert 0 <= row[provider]["max_scaled_error"] < row["tolerance"]


def test_malformed_shape_is_a_usage_error(tmp_path):
    done = _run("--shapes", "2x3", "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2
    assert "--shapes takes NxCxHxW" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.json").exists()
