"""Smoke run of benchmarks/host_overhead.py on CPU: a row per shape with every provider's time
and its ratio to BatchNorm + activation, side by side from one run; usage errors exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_overhead.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_quick_cpu_run_writes_times_and_ratios(tmp_path):
    out = tmp_path / "host.json"
    done = _run("--device", "cpu", "--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["torch_version"] and report["device"] == "cpu"
    assert [row["shape"] for row in report["rows"]] == [[2, 8, 4, 4], [8, 64, 8, 8]]
    for row in report["rows"]:
        assert set(row["us_per_call"]) == {"bn", "iabn", "abn", "noop_function", "bare_function"}
        assert all(len(v) == 3 for v in row["samples_ms"].values())  # --quick: 3 repeats
        for name, us in row["us_per_call"].items():
            assert us > 0
            assert row["ratio_to_bn"][name] == us / row["us_per_call"]["bn"]
        # each layer against its floor, repeat by repeat: the median of the 3 paired ratios
        samples = row["samples_ms"]
        for name, floor in (("iabn", "bare_function"), ("abn", "bn")):
            ratios = sorted(t / f for t, f in zip(samples[name], samples[floor], strict=True))
            got = row["ratio_to_floor"][name]
            assert got["floor"] == floor and got["median"] == pytest.approx(ratios[1])
            assert ratios[0] <= got["q1"] <= got["median"] <= got["q3"] <= ratios[2]
        assert "x" in done.stdout and "iabn/bare_function" in done.stdout


@pytest.mark.parametrize("args", [("--repeats", "0"),
                                  pytest.param(("--threads", "0"), marks=pytest.mark.slow)])
def test_bad_counts_are_usage_errors(tmp_path, args):
    done = _run("--device", "cpu", *args, "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert args[0] in done.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args", [("--threads", "1"), ("--clock", "thread")])
def test_one_thread_runs(tmp_path, args):
    """``--threads 1``, and ``--clock thread``, which implies it (the thread clock counts only
    the timing thread's work)."""
    out = tmp_path / "host.json"
    done = _run("--device", "cpu", "--quick", *args, "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["machine"]["torch_threads"] == 1
    assert report["clock"] == ("thread" if "--clock" in args else "wall")


@pytest.mark.slow
def test_thread_clock_with_more_threads_is_a_usage_error(tmp_path):
    done = _run("--device", "cpu", "--clock", "thread", "--threads", "2",
                "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--clock thread" in done.stderr and not (tmp_path / "x.json").exists()


def test_bare_function_does_the_layers_work():
    """The floor it stands for is only a floor if it computes what the layer computes: a
    training step equal to BatchNorm2d + LeakyReLU(0.01) in float64 (outputs, all gradients,
    running statistics)."""
    torch.manual_seed(0)
    bare = load_script(SCRIPT).BareFunctionLayer(5).double()
    bn = nn.BatchNorm2d(5).double()
    weight, bias = torch.rand(5) + 0.5, torch.randn(5)
    with torch.no_grad():
        for layer in (bare, bn):
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
    leaf = torch.randn(3, 5, 4, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(3, 5, 4, 4, dtype=torch.float64)
    expected = nn.functional.leaky_relu(bn(leaf * 1), 0.01)
    expected.backward(grad)
    expected_grads = [t.grad.clone() for t in (leaf, bn.weight, bn.bias)]
    leaf.grad = None
    out = bare(leaf * 1)
    out.backward(grad)
    got = [leaf.grad, bare.weight.grad, bare.bias.grad]
    # float64 rounding only: the largest difference measured is 1.8e-15 (weight gradient);
    # the bound is about 50x that
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-13)
    for g, e in zip(got, expected_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-13)
    torch.testing.assert_close(bare.running_mean, bn.running_mean, rtol=0, atol=1e-13)
    torch.testing.assert_close(bare.running_var, bn.running_var, rtol=0, atol=1e-13)
    assert int(bare.num_batches_tracked) == 1
