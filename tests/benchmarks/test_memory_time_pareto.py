"""Smoke run of benchmarks/memory_time_pareto.py on CPU: every strategy of the GPU benchmark
runs a training step (the times and peak memory it reports are only meaningful on a GPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

# a CPU smoke run of a GPU script; its Triton rows need the interpreter.
pytestmark = pytest.mark.without_gpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_time_pareto.py"


@pytest.mark.slow
def test_cpu_smoke_run_times_every_strategy(tmp_path):
    out = tmp_path / "pareto.json"
    strategies = "eager,offload_all,offload_half,checkpoint_2,save_on_cpu"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--models",
         "mobilenet_v2:bn", "--strategies", strategies, "--json", str(out), "--png",
         str(tmp_path / "pareto.png")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert list(row["results"]) == strategies.split(",")
    assert all(r["ms"] > 0 and r["peak_mib"] is None for r in row["results"].values())
    assert "failed" not in row


def test_refuses_cuda_without_a_gpu(tmp_path):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
