"""Smoke run of benchmarks/network_step.py on CPU (the GPU table comes from a lent device): every
cell has each provider's step time, exact saved bytes and largest batch in the budget, with
ratios to BatchNorm from one run; usage errors exit 2 without writing anything."""

import functools
import importlib.util
import json
import math
from pathlib import Path

import pytest

from helpers import load_script

# a CPU smoke run; on a CUDA machine the script would pick CUDA and add the peak search.
pytestmark = pytest.mark.without_gpu

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "network_step.py"


@functools.cache
def _load():
    return load_script(SCRIPT)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_quick_cpu_run_writes_every_cell(tmp_path, capsys):
    network_step = _load()
    out = tmp_path / "step.json"
    quick = ["--device", "cpu", "--quick", "--threads", "1", "--json", str(out)]
    assert network_step.main([*quick, "--layouts", "channels_last"]) == 0
    first = json.loads(out.read_text())
    # a run split in two: --resume keeps the measured cell and adds the missing one
    assert network_step.main([*quick, "--layouts", "channels_last,nchw", "--resume"]) == 0
    report = json.loads(out.read_text())
    assert report["cells"][0] == first["cells"][0]
    assert report["settings"]["layouts"] == ["channels_last", "nchw"]
    assert report["complete"] and report["device"] == "cpu"
    assert report["machine"]["device_name"].startswith("cpu")
    assert report["machine"]["torch_version"] and report["machine"]["date_utc"]
    assert report["settings"]["providers"] == ["bn", "iabn"]  # no Triton, no original on CPU
    cells = report["cells"]
    assert [(c["model"], c["batch"], c["layout"], c["mode"]) for c in cells] == [
        ("resnet50", 2, "channels_last", "eager"), ("resnet50", 2, "nchw", "eager")]
    for cell in cells:
        assert set(cell["providers"]) == {"bn", "iabn"}
        for name, result in cell["providers"].items():
            assert _positive(result["ms"]) and len(result["samples_ms"]) == 2  # --quick
            assert all(_positive(ms) for ms in result["samples_ms"])
            assert result["peak_step_bytes"] is None  # no allocator peak on CPU
            assert _positive(result["saved_bytes"]) and _positive(result["largest_batch_saved"])
            assert (result["saved_bytes"]
                    == result["saved_bytes_fixed"] + 2 * result["saved_bytes_per_image"])
            ratios = cell["ratio_to_bn"][name]
            assert ratios["step_time"] == result["ms"] / cell["providers"]["bn"]["ms"]
            assert _positive(ratios["saved_bytes"]) and _positive(ratios["largest_batch_saved"])
        # in-place layers keep fewer bytes, so more images fit the same budget
        assert cell["ratio_to_bn"]["iabn"]["saved_bytes"] < 1
        assert cell["ratio_to_bn"]["iabn"]["largest_batch_saved"] > 1
    # the step-time target is reported for each eager cell (memory targets: other models)
    assert len(report["targets"]) == 2
    assert all(t["provider"] == "iabn" and t["limit"] == "<= 0.95" for t in report["targets"])
    # the PNG beside the JSON, when matplotlib is installed (it is no dependency)
    assert out.with_suffix(".png").exists() or importlib.util.find_spec("matplotlib") is None
    printed = capsys.readouterr().out
    assert "iabn_triton skipped" in printed and ("PASS" in printed or "FAIL" in printed)
    assert "resuming" in printed and "of 2 targets met" in printed
    # resuming a file made with other settings is a usage error, and leaves it alone
    assert network_step.main([*quick, "--repeats", "3", "--resume"]) == 2
    assert json.loads(out.read_text()) == report


@pytest.mark.parametrize("argv", [
    ["--repeats", "0"], ["--models", "vgg19"], ["--dtypes", "float16"],
    ["--layouts", "nhwc"], ["--modes", "jit"], ["--providers", "cudnn"], ["--batch", "1"],
    ["--budget-gib", "0"], ["--device", "tpu"], ["--image-size", "16"], ["--repeats", "x"],
])
def test_bad_arguments_exit_2_without_writing(tmp_path, argv, capsys):
    network_step = _load()
    out = tmp_path / "x.json"
    assert network_step.main(["--device", "cpu", "--quick", *argv, "--json", str(out)]) == 2
    assert not out.exists()
    assert "error" in capsys.readouterr().err


def test_cuda_without_cuda_is_a_usage_error(tmp_path, capsys):
    network_step = _load()
    if network_step.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert network_step.main(["--device", "cuda", "--json", str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line


def test_largest_fitting_finds_the_last_fitting_batch_from_any_guess():
    network_step = _load()
    for answer in (0, 2, 3, 7, 64, 100):
        for guess in (2, 5, 64, 99, 300):
            calls = []

            def fits(batch, answer=answer, calls=calls):
                calls.append(batch)
                return batch <= answer

            assert network_step.largest_fitting(fits, guess) == answer
            assert min(calls) >= 2 and len(calls) <= 2 * math.log2(300) + 2


def test_compiled_modes_pass_their_torch_compile_options(monkeypatch):
    """``--modes reduce_overhead`` is ``torch.compile(mode="reduce-overhead")`` (CUDA graphs on
    a GPU), ``compile`` the default compile, ``eager`` no compile at all."""
    network_step = _load()
    args = network_step.parse_args(["--device", "cpu", "--quick", "--modes",
                                    "eager,compile,reduce_overhead"])
    assert args.modes == ["eager", "compile", "reduce_overhead"]
    calls = []

    def fake_compile(model, **options):
        calls.append(options)
        return model

    monkeypatch.setattr(network_step.torch, "compile", fake_compile)
    weights = network_step.build_model("bn", "resnet50").state_dict()
    for mode, expected in (("eager", []), ("compile", [{}]),
                           ("reduce_overhead", [{"mode": "reduce-overhead"}])):
        calls.clear()
        cell = network_step.Cell("resnet50", 2, 32, "float32", "channels_last", mode)
        runner = network_step.make_runner("bn", cell, network_step.torch.device("cpu"), weights)
        assert calls == expected, mode
        assert runner.forward is runner.model  # fake_compile returned the model itself
