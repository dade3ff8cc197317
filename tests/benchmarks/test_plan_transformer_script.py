"""benchmarks/plan_transformer.py: a bad size exits 2 before anything runs or is written (the
measurement itself, minutes of ViT-S/16 planning and steps on a CPU, is the benchmark's)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_transformer.py"


def test_a_bad_batch_exits_2(tmp_path):
    out = tmp_path / "x.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--batch", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--batch 0" in done.stderr
    assert not out.exists()
