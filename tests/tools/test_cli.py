"""The ``iabn`` command line: help, argument errors and a tiny ``iabn bench`` run end to end."""

import json
import subprocess
import sys

import pytest

from iabn.tools.bench.blocks import STRATEGIES, CheckResult, format_check
from iabn.tools.cli import main

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu

BATCH, CHANNELS, SIZE, BLOCKS = 2, 8, 8, 2
FLOAT32_BYTES = 4
# One block input (N, C, H, W) and one per-channel (C,) statistic, in bytes.
ACTIVATION = BATCH * CHANNELS * SIZE * SIZE * FLOAT32_BYTES
PER_CHANNEL = CHANNELS * FLOAT32_BYTES

# Per block: (full-size tensors, per-channel tensors) autograd keeps for backward.
#   bn:          BN input, BN output (saved by the out-of-place LeakyReLU), conv input;
#                BN's batch mean and inverse std.
#   bn_inplace:  BN input, the activated BN output (LeakyReLU and conv save the same
#                storage); BN's batch mean and inverse std.
#   checkpoint:  only the block input; everything inside is recomputed in backward.
#   iabn_I/II:   only the layer output, shared with the conv; the inverse std.
SAVED_PER_BLOCK = {
    "bn": (3, 2),
    "bn_inplace": (2, 2),
    "checkpoint": (1, 0),
    "iabn_I": (1, 2),
    "iabn_II": (1, 2),
}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """Run ``python -m iabn bench`` once on a tiny model; return (process, parsed JSON)."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    command = [
        sys.executable, "-m", "iabn", "bench", "--blocks", str(BLOCKS), "--channels",
        str(CHANNELS), "--size", str(SIZE), "--batch", str(BATCH), "--repeats", "3",
        "--iters", "1", "--warmup", "0", "--threads", "1", "--json", str(path),
    ]
    process = subprocess.run(command, capture_output=True, text=True, timeout=120)
    report = json.loads(path.read_text()) if path.exists() else None
    return process, report


def test_no_arguments_prints_help(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: iabn")
    assert "bench" in out


@pytest.mark.parametrize(
    "args", [["bench", "--blocks", "0"], ["bench", "--repeats", "-1"], ["frobnicate"]]
)
def test_bad_arguments_exit_with_one_line(args, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(args)
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("iabn") and ": error: " in err
    assert "--help)" in err  # where the usage is


def test_bench_exits_0_and_prints_the_table(bench_run):
    process, _ = bench_run
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    header = next(line for line in lines if line.startswith("strategy"))
    assert "saved MiB" in header and "step ms" in header
    for name in STRATEGIES:
        assert any(line.startswith(name) for line in lines), name
    assert any(line.startswith("check: OK") for line in lines)
    assert "repeat 3/3" in process.stderr  # progress goes to stderr, not into the table
    # the run states how long it took
    assert any(line.startswith("wall time ") and line.endswith("threads)") for line in lines)


def test_bench_json_has_machine_info_and_arguments(bench_run):
    _, report = bench_run
    assert report["machine"]["torch_threads"] == 1
    assert report["machine"]["torch_version"]
    assert report["args"]["blocks"] == BLOCKS and report["args"]["channels"] == CHANNELS
    assert report["input_shape"] == [BATCH, CHANNELS, SIZE, SIZE]
    assert report["activation_bytes"] == ACTIVATION
    assert report["check"]["passed"]
    for result in report["strategies"].values():
        assert len(result["time_ms_samples"]) == 3
        assert result["time_ms_median"] > 0


def test_bench_time_ratios_are_paired_with_their_spread(bench_run):
    """Each strategy's time over the baseline's in the same repeat: the median of those
    ratios and their quartiles (numpy's, linear interpolation), in the JSON and the table,
    and "within noise" exactly where the quartiles lie on both sides of 1."""
    import numpy as np

    process, report = bench_run
    base = report["strategies"][report["baseline"]]["time_ms_samples"]
    lines = process.stdout.splitlines()
    for name, result in report["strategies"].items():
        ratios = np.array(result["time_ms_samples"]) / np.array(base)
        low, middle, high = np.percentile(ratios, [25, 50, 75])
        assert result["time_vs_baseline"] == pytest.approx(middle, rel=1e-12)
        assert result["time_vs_baseline_quartiles"] == pytest.approx([low, high], rel=1e-12)
        assert result["time_within_noise"] == bool(low < 1 < high)
        if name == report["baseline"]:
            continue
        row = next(line for line in lines if line.startswith(name))
        assert f"{middle:.2f}x ({low:.2f}-{high:.2f})" in row
        assert row.endswith("within noise") == bool(low < 1 < high)


def test_machine_info_names_the_device_measured_on():
    """A benchmark's machine record says which device its figures are from; a CPU's name starts
    with "cpu", which the GPU campaign's summary reads as "not a GPU figure"."""
    import torch

    from iabn.tools.bench import CPU_DEVICE_NAME, machine_info

    assert "device_name" not in machine_info()
    info = machine_info("cpu")
    assert info["device_type"] == "cpu" and info["device_name"] == CPU_DEVICE_NAME
    assert CPU_DEVICE_NAME.startswith("cpu") and "triton_version" in info
    if torch.cuda.is_available():
        info = machine_info(torch.device("cuda"))
        assert info["device_name"] == torch.cuda.get_device_name()
        assert info["cuda_version"] == torch.version.cuda


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bench_saved_bytes_are_exact(bench_run, strategy):
    _, report = bench_run
    result = report["strategies"][strategy]
    full, per_channel = SAVED_PER_BLOCK[strategy]
    shapes = [tuple(s["shape"]) for s in result["saved_storages"]]
    # Nothing is saved but whole activations and per-channel statistics.
    assert shapes.count((BATCH, CHANNELS, SIZE, SIZE)) == full * BLOCKS
    assert shapes.count((CHANNELS,)) == per_channel * BLOCKS
    assert len(shapes) == (full + per_channel) * BLOCKS
    expected = BLOCKS * (full * ACTIVATION + per_channel * PER_CHANNEL)
    assert result["saved_bytes"] == expected
    assert result["saved_activations"] == pytest.approx(expected / ACTIVATION)
    baseline = BLOCKS * (2 * ACTIVATION + 2 * PER_CHANNEL)
    assert result["saved_vs_baseline"] == pytest.approx(expected / baseline)


def test_check_line_names_the_strategies_that_disagree():
    errors = dict.fromkeys(STRATEGIES, 0.0)
    check = CheckResult(loss_error=errors, grad_error={**errors, "iabn_II": 1.0})
    assert not check.passed
    line = format_check(check)
    assert line.startswith("check: MISMATCH") and "iabn_II" in line


# ---- iabn bench on a busy machine: a note naming the load average ----

TINY_BENCH = ["bench", "--blocks", "1", "--channels", "2", "--size", "4", "--batch", "2",
              "--repeats", "1", "--iters", "1", "--warmup", "0", "--threads", "1", "--quiet"]


@pytest.fixture(scope="module")
def tiny_bench_result():
    """One real run of TINY_BENCH's measurements, which the command then reports."""
    from iabn.tools.arguments import BenchConfig
    from iabn.tools.bench.blocks import run_bench

    return run_bench(BenchConfig(batch=2, channels=2, size=4, blocks=1, repeats=1, iters=1,
                                 warmup=0, seed=0), progress=False)


@pytest.mark.parametrize("before, after, busy", [
    (3.0, 3.0, True),    # another job all along: 3 > 1 free core + 0.5
    (0.2, 4.0, True),    # one that started during the run
    (1.5, 1.5, False),   # 1.5 is the 1 free core + 0.5: not above it
    (0.2, 0.3, False),   # a quiet machine
    (None, None, False),  # no load average on this platform
])
def test_bench_notes_a_busy_machine_naming_the_load(tmp_path, capsys, monkeypatch, before,
                                                    after, busy, tiny_bench_result):
    """The 1-minute load average is read before and after the run (monkeypatched here, on
    2 cores with --threads 1: 1 core left free); above the free cores by more than 0.5 the
    run says so on stderr, even with --quiet, and in its JSON. (The run's figures are one
    real run's, measured once for all cases.)"""
    import os

    from iabn.tools.bench import blocks

    monkeypatch.setattr(blocks, "run_bench", lambda config, progress: tiny_bench_result)

    readings = iter([before, after])

    def getloadavg():
        value = next(readings)
        if value is None:
            raise OSError("no load average")
        return (value, 0.0, 0.0)

    monkeypatch.setattr(os, "getloadavg", getloadavg)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    path = tmp_path / "bench.json"
    assert main([*TINY_BENCH, "--json", str(path)]) == 0
    assert next(readings, "done") == "done"  # read twice
    err = capsys.readouterr().err
    load = json.loads(path.read_text())["machine_load"]
    assert (load["load_average_1min_before"], load["load_average_1min_after"]) == (before,
                                                                                  after)
    assert (load["threads"], load["cores"], load["free_cores"]) == (1, 2, 1)
    assert load["busy"] is busy
    if not busy:
        assert err == "" and load["note"] is None
        return
    assert err.count("\n") == 1 and err.startswith("iabn bench: note: the machine was busy: "
                                                   f"1-minute load average {before:.2f} "
                                                   f"before the run and {after:.2f} after")
    assert "1 thread(s) on 2 core(s) leaving 1 free" in err
    assert load["note"] in err


def test_machine_load_takes_away_what_the_run_itself_added():
    """After a run of T seconds, its own threads can have added threads x (1 - exp(-T/60))
    to the load average, the rest is other work."""
    import math

    from iabn.tools.bench import LOAD_MARGIN, MachineLoad

    own = 2 * (1 - math.exp(-1))  # 2 threads for 60 s: 1.26
    alone = MachineLoad(0.1, own, 60.0, 2, 2)  # all cores used, none free
    assert alone.own_at_most == pytest.approx(own) and alone.others == pytest.approx(0.1)
    assert not alone.busy
    shared = MachineLoad(0.1, own + LOAD_MARGIN + 0.01, 60.0, 2, 2)
    assert shared.busy and "2 thread(s) on 2 core(s) leaving 0 free" in shared.note()
    assert not MachineLoad(0.1, own + LOAD_MARGIN - 0.01, 60.0, 2, 2).busy
    assert MachineLoad(None, None, 1.0, 1, 1).others is None
