"""The suite on both kinds of machine (see conftest.py): tests that model a machine without
CUDA run, where CUDA is visible, in a subprocess that cannot see it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import HAS_CUDA

TESTS = Path(__file__).resolve().parents[1]  # tests/, every room


@pytest.mark.skipif(not HAS_CUDA, reason="without CUDA the without_gpu tests run in this "
                                         "process")
def test_without_gpu_tests_pass_where_cuda_is_hidden():
    env = {k: v for k, v in os.environ.items()
           if k not in ("IABN_BACKEND", "IABN_TEST_INTERPRET", "TRITON_INTERPRET")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
               "without_gpu", str(TESTS)]
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]
    done = subprocess.run(command, env=env, cwd=TESTS.parent, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, (done.stdout[-8000:], done.stderr[-3000:])
