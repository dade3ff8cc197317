"""Smoke run of benchmarks/transformer_step.py on CPU: the Llama-style decoder as given,
converted and converted without its activations, timed side by side, with the exact saved
bytes of each; usage errors exit 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "transformer_step.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_quick_cpu_run_writes_times_ratios_and_bytes(tmp_path):
    out = tmp_path / "steps.json"
    done = _run("--quick", "--models", "decoder", "--threads", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    (cell,) = report["cells"]
    assert (cell["model"], cell["mode"], cell["dtype"]) == ("decoder", "eager", "float32")
    assert set(cell["step_ms"]) == {"given", "converted", "norms_only"}
    assert all(len(t) == 2 for t in cell["step_ms_all"].values())  # --quick: 2 repeats
    for provider in ("converted", "norms_only"):
        ratios = [c / g for c, g in zip(cell["step_ms_all"][provider],
                                        cell["step_ms_all"]["given"], strict=True)]
        assert cell["ratio"][provider] == sum(ratios) / 2
    # the conversion frees the RMSNorms' and the SiLUs' inputs; without activations, the
    # RMSNorms' only
    saved = cell["saved_bytes"]
    assert saved["converted"] < saved["norms_only"] < saved["given"]
    assert cell["saved_ratio"]["converted"] == saved["converted"] / saved["given"]
    assert cell["layers"] == {"InPlaceRMSNorm": 1, "InPlaceRMSNorm(overwrite_input=False)": 4,
                              "InPlaceSiLU": 2}
    assert cell["peak_step_bytes"] == dict.fromkeys(("given", "converted", "norms_only"))  # CPU


@pytest.mark.slow  # 7.5 s on 2 cores: one child process per bad argument
def test_usage_errors_exit_2(tmp_path):
    for args in (["--models", "resnet"], ["--modes", ""], ["--batch", "0"]):
        done = _run(*args, "--json", str(tmp_path / "x.json"))
        assert done.returncode == 2, args
        assert "usage" in done.stderr
        assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # 20 s on 2 cores: EfficientNet-B0 at 32x32, three providers
def test_efficientnet_is_converted_to_in_place_abn_with_silu(tmp_path):
    """Asked for by name (not in the default list), torchvision's EfficientNet-B0: its batch
    norms with SiLU become InPlaceABN, and the conversion keeps fewer bytes."""
    out = tmp_path / "steps.json"
    done = _run("--quick", "--models", "efficientnet_b0", "--threads", "1", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["model"] == "efficientnet_b0"
    assert any(name.startswith("InPlaceABN") for name in cell["layers"])
    assert cell["saved_bytes"]["converted"] < cell["saved_bytes"]["given"]
