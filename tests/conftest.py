import os

import pytest
import torch

import triton_interpreter

# Triton reads TRITON_INTERPRET when a kernel is defined, so it is set before anything imports
# iabn's kernels: on machines without CUDA the Triton kernels run under its CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    triton_interpreter.install()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    """Run the test once per kernel backend (IABN_BACKEND); Triton is skipped when missing."""
    if request.param == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("IABN_BACKEND", request.param)
    return request.param
