"""Smoke run of benchmarks/activation_speed.py on a tiny shape: a row per activation with both
timings, the paired ratio inside its quartiles, the load average, written to the named file."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_speed.py"


def _script():
    spec = importlib.util.spec_from_file_location("activation_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_writes_a_row_per_activation(tmp_path):
    out = tmp_path / "speed.json"
    rows = _script().main(["--shape", "2,3,8", "--repeats", "3", "--names", "gelu,silu",
                           "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [row["name"] for row in saved["rows"]] == ["gelu", "silu"] == [r["name"] for r in rows]
    for row in saved["rows"]:
        assert row["ours_ms"] > 0 and row["torch_ms"] > 0
        low, high = row["ratio_quartiles"]
        assert low <= row["ratio_median"] <= high
        assert len(row["loadavg_before"]) == 3
    assert saved["shape"] == [2, 3, 8] and saved["machine"]["torch_version"]


def test_norm_layers_and_the_left_share(tmp_path):
    """A norm layer's row, and the share of inputs on the left branch: that of torch's norm's
    output for a norm layer (silu's y* = -1.278: about 10 % of a normal sample), of ``scale *
    randn`` for an activation (P(3 Z < -1.278) = P(Z < -0.426) = 0.335)."""
    out = tmp_path / "speed.json"
    rows = _script().main(["--shape", "4,32,16,16", "--repeats", "3", "--names",
                           "abn_silu,gn_silu,silu", "--json", str(out)])
    assert [row["name"] for row in rows] == ["abn_silu", "gn_silu", "silu"]
    normal = torch.distributions.Normal(0.0, 1.0)
    for row, want in zip(rows, (normal.cdf(torch.tensor(-1.2785)).item(),) * 2 +
                         (normal.cdf(torch.tensor(-1.2785 / 3)).item(),), strict=True):
        # 8192 samples: the share's standard error is below 0.006
        assert abs(row["left_share"] - want) < 0.03, (row, want)


@pytest.mark.parametrize(("args", "message"), [
    (["--names", "relu"], "unknown layer 'relu'"),
    (["--names", "gn_silu", "--shape", "2,30,4,4"], "multiple of 32"),
    (["--names", "abn_silu", "--shape", "2,8,4"], "4-d shape")])
def test_user_errors_exit_2_naming_the_argument(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        _script().main(args)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_a_batch_norm_row_takes_any_channel_count(tmp_path):
    """Only the group norm's rows need channels in multiples of its 32 groups."""
    rows = _script().main(["--shape", "2,6,4,4", "--repeats", "3", "--names", "abn_silu",
                           "--json", str(tmp_path / "speed.json")])
    assert [row["name"] for row in rows] == ["abn_silu"]
