"""benchmarks/suite_log.py: the log of a test run carries what it ran on and pytest's result,
and the script exits with pytest's exit code. The runs are of one-test files written here: the
script passes pytest's arguments through, whichever tests they name."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "suite_log.py"


def _run(log, *pytest_args):
    return subprocess.run([sys.executable, str(SCRIPT), "--log", str(log), "--", *pytest_args],
                          capture_output=True, text=True, timeout=300)


def test_log_has_the_header_and_the_result(tmp_path):
    passing = tmp_path / "test_passes.py"
    passing.write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    log = tmp_path / "suite.log"
    done = _run(log, "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(passing))
    assert done.returncode == 0, done.stdout[-3000:]
    text = log.read_text()
    assert f"torch: {torch.__version__}" in text
    for key in ("date_utc:", "commit:", "device:", "command:"):
        assert key in text
    assert "1 passed" in text and text.rstrip().endswith("exit code: 0")


@pytest.mark.slow
def test_failing_run_exits_with_pytest_code(tmp_path):
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert 1 == 2\n")
    log = tmp_path / "suite.log"
    done = _run(log, "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(failing))
    assert done.returncode == 1
    assert "1 failed" in log.read_text() and log.read_text().rstrip().endswith("exit code: 1")
