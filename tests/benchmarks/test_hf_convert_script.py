"""Smoke run of benchmarks/hf_convert.py on one family: the plain conversion keeps fewer bytes
than the original and within 0.03 of the hand swap; an unknown family exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the benchmark's Hugging Face models")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_convert.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_one_family_run(tmp_path):
    out = tmp_path / "hf.json"
    done = _run("--families", "vit", "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(out.read_text())["families"]["vit"]["pixels"]
    assert row["plain"] < 1 and abs(row["plain"] - row["hand_swap"]) <= 0.03
    # ViT's 4 layer norms and 2 GELUs (its final norm, whose output the model returns, stays)
    assert row["replaced_plain"] == row["replaced_hand_swap"] == 6
    assert "load average" in done.stdout


@pytest.mark.slow
def test_an_unknown_family_exits_2(tmp_path):
    done = _run("--families", "nope", "--json", str(tmp_path / "x.json"))
    assert done.returncode == 2 and "nope" in done.stderr
    assert not (tmp_path / "x.json").exists()
