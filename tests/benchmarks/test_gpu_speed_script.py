"""Smoke run of benchmarks/gpu_speed.py on CPU (the GPU figures come from a lent device):
every (shape, dtype, layout, provider, mode) gets a row, and every provider computes the
same layer as float64 ``nn.BatchNorm2d`` + LeakyReLU."""

import json
from pathlib import Path

import pytest

from helpers import load_script

# a CPU smoke run of a GPU script; its Triton rows need the interpreter.
pytestmark = pytest.mark.without_gpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_speed.py"


@pytest.mark.slow
def test_cpu_smoke_run_writes_every_row(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("IABN_BACKEND", "reference")  # restored after the script sets it
    gpu_speed = load_script(SCRIPT)
    out, table = tmp_path / "speed.json", tmp_path / "speed.csv"
    assert gpu_speed.main(["--device", "cpu", "--quick", "--repeats", "1", "--dtypes",
                           "float32", "--layouts", "nchw,channels_last", "--providers",
                           "eager,reference,triton", "--json", str(out), "--csv",
                           str(table)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert len(rows) == len(gpu_speed.QUICK_SHAPES) * 2 * 3 * len(gpu_speed.MODES)
    assert report["machine"]["device_name"].startswith("cpu")
    for row in rows:
        assert row["median_ms"] > 0
        # float32 against float64: a few float32 roundings of values of order 1
        assert row["output_rel_err"] < 1e-5 and row["grad_rel_err"] < 1e-5, row
    assert len(table.read_text().splitlines()) == len(rows) + 1


def test_refuses_to_run_without_cuda_unless_asked_for_cpu():
    gpu_speed = load_script(SCRIPT)
    if gpu_speed.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        gpu_speed.main([])
