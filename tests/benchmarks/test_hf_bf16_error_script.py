"""Smoke run of benchmarks/hf_bf16_error.py on one family and two seeds: the norms' conversion
computes the original's forward (output error ratio exactly 1), every figure is a positive
ratio, the bytes kept are fewer than the original's; an unknown family exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the benchmark's Hugging Face models")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_bf16_error.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_one_family_run(tmp_path):
    out = tmp_path / "bf16.json"
    done = _run("--families", "bert", "--seeds", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())["families"]["bert"]
    assert set(row["summary"]) == {"norms", "activations", "both"}
    for seed in row["seeds"]:
        # the output-only layer norms compute PyTorch's forward bit for bit
        assert seed["norms"]["output"] == seed["original"]["output"] > 0
    for conversion in row["summary"].values():
        for figures in conversion.values():
            assert 0 < figures["min"] <= figures["median"] <= figures["max"]
    assert 0 < row["saved_bytes"]["both"] < row["saved_bytes"]["norms"] < 1
    assert "load average" in done.stdout


@pytest.mark.slow
def test_an_unknown_family_exits_2(tmp_path):
    done = _run("--families", "nope", "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "nope" in done.stderr
    assert not (tmp_path / "x.json").exists()
