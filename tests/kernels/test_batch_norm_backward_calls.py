"""The reference backend's calls of ``aten.native_batch_norm_backward`` always pass a weight.

CUDA's kernel needs one even where it computes no ``dx``: with ``weight=None`` it returned an
empty ``grad_weight`` ("invalid gradient at index 1 - got [0]") or failed ("tensor does not have
a device") on an H100, in eval mode and wherever ``dx`` was not wanted, while the CPU kernel
computed both. The calls are recorded here on any device, so the contract is checked on CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import iabn
from iabn.kernels.backends import use_backend

from helpers import BRANCH

BACKWARD = torch.ops.aten.native_batch_norm_backward.default


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.weights = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is BACKWARD:
            self.weights.append(args[2])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("activation", ["leaky_relu", "identity", *BRANCH])
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("input_grad", [True, False], ids=["dx", "no-dx"])
def test_every_batch_norm_backward_call_has_a_weight(activation, variant, training,
                                                     input_grad):
    layer = iabn.InPlaceABN(4, activation=activation, variant=variant).double()
    layer.train(training)
    x = torch.randn(3, 4, 5, 2, dtype=torch.float64, requires_grad=input_grad)
    calls = _Calls()
    with use_backend("reference"), calls:
        layer(x.clone() if input_grad else x.detach().clone()).sum().backward()
    assert calls.weights, "the backward made no batch-norm backward call"
    assert all(isinstance(w, torch.Tensor) for w in calls.weights), calls.weights
    assert layer.weight.grad is not None and layer.weight.grad.shape == (4,)
