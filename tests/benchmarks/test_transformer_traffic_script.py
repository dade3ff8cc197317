"""Smoke run of benchmarks/transformer_traffic.py: a row per layer kind, provider and dtype
with its launches, bytes moved and backward peak, counted on CPU; a bad size exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "transformer_traffic.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_quick_run_counts_every_layer(tmp_path):
    out = tmp_path / "traffic.json"
    done = _run("--quick", "--tokens", "5", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    kinds = {(r["kind"], r["provider"]) for r in rows}
    assert kinds == {(k, p) for k in ("layer_norm", "rms_norm")
                     for p in ("torch", "iabn_output_only", "iabn_in_place", "iabn_triton")} | {
        (k, p) for k in ("gelu", "gelu_tanh", "silu")
        for p in ("torch", "iabn_in_place", "iabn_triton")}
    for row in rows:
        if row["provider"] == "iabn_triton":  # the backward: one launch, and the copies
            kernel = "row_norm_grad" if "norm" in row["kind"] else "activation_grad"
            assert f"triton.{kernel}_kernel" in row["backward_ops"]
    for row in rows:
        assert row["shape"] == [2, 5, 384 if "norm" in row["kind"] else 1536]
        assert row["launches"] == row["launches_forward"] + row["launches_backward"] > 0
        assert row["activations_moved"] > 0 and row["backward_ops"]


def test_a_bad_size_exits_2(tmp_path):
    done = _run("--tokens", "0", "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "--tokens 0" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_unknown_kinds_exit_2(tmp_path):
    done = _run("--kinds", "layer_norm,batch_norm", "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "batch_norm" in done.stderr
    assert not (tmp_path / "x.json").exists()
