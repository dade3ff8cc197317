"""Offloading on CUDA: copies on a side stream into pinned host memory, and gradients bit for
bit those of training without offloading (cuDNN's deterministic algorithms, so that two runs
can be compared bit for bit). The host-copy logic is tested in tests/memory/test_offload.py."""

import pytest
import torch

from iabn.memory.offloading import OffloadModel
from test_offload import X, _grads, _reference

pytestmark = pytest.mark.gpu


def test_cuda_gradients_bit_identical_and_streams(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    model = _reference().cuda()
    x = X.cuda()
    expected = _grads(model, x, model)
    wrapped = OffloadModel(model, min_bytes=0)
    for _ in range(2):
        loss, grads = _grads(model, x, wrapped)
        assert torch.equal(loss, expected[0])
        assert all(torch.equal(g, e) for g, e in zip(grads, expected[1], strict=True))
    assert wrapped.offloader.pool.buffers[0].is_pinned()
    assert wrapped.stats.offloaded_bytes > 0
    assert wrapped.stats.transferred_bytes == wrapped.stats.offloaded_bytes
