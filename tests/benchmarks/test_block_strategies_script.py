"""Smoke run of benchmarks/block_strategies.py (the paper's Fig. 4 analogue) on CPU: every
strategy runs at every ResNeXt-101 stage shape and its exact saved bytes are reported; the
CUDA mode refuses a machine without a GPU instead of overwriting the CPU figures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iabn.memory.bn_act_conv import STRATEGIES

# a CPU smoke run, and the error of --device cuda where CUDA is missing.
pytestmark = pytest.mark.without_gpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "block_strategies.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_cpu_smoke_run_reports_every_strategy_and_shape(tmp_path):
    out = tmp_path / "blocks.json"
    done = _run("--batch", "1", "--repeats", "1", "--iters", "1", "--threads", "1", "--quiet",
                "--json", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [row["shape"][1:] for row in report["shapes"]] == [
        [256, 56, 56], [512, 28, 28], [1024, 14, 14], [2048, 7, 7]]
    for row in report["shapes"]:
        assert list(row["saved_bytes"]) == list(STRATEGIES)
        assert all(ms > 0 for ms in row["median_ms"].values())
        # standard keeps the block input and the activation output (2 tensors of the input's
        # size); every other strategy one. The rest are per-channel vectors (C floats each).
        per_channel = row["shape"][1] * 4
        activation = row["activation_bytes"]
        for strategy, saved in row["saved_bytes"].items():
            tensors = 2 if strategy == "standard" else 1
            assert 0 <= saved - tensors * activation <= 4 * per_channel, (strategy, saved)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_mode_refuses_without_a_gpu(tmp_path):
    done = _run("--device", "cuda", "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert not (tmp_path / "x.json").exists()
