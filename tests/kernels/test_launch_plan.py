"""The ATen calls one training step of a layer makes on the reference backend: the launch plan
of docs/design.md, "The in-place contract" (its "Host cost" paragraph), held exactly.

Every call costs host time (about 1-2 µs on CPU, a kernel launch on CUDA), so this is the
number that must stay at the minimum the math needs. Counted with a ``TorchDispatchMode``,
which sees each ATen operator call once; allocations (``empty``) and autograd's ``detach`` of
saved tensors are left out, as they launch nothing. ``nn.BatchNorm2d`` + ``LeakyReLU`` is
counted alongside, as the baseline the layer replaces.
"""

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import iabn

NOT_LAUNCHES = ("aten.empty", "aten.detach")


class _CountCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not name.startswith(NOT_LAUNCHES):
            self.calls.append(name.rsplit(".", 1)[0])  # drop the overload name
        return func(*args, **(kwargs or {}))


def _calls_per_step(layer: nn.Module) -> tuple[list[str], list[str]]:
    leaf = torch.randn(2, 8, 4, 4, requires_grad=True)
    x = leaf.clone()
    with _CountCalls() as forward:
        out = layer(x)
    grad = torch.randn(2, 8, 4, 4)
    with _CountCalls() as backward:
        out.backward(grad)
    return forward.calls, backward.calls


def test_in_place_layer_makes_the_minimal_calls(monkeypatch):
    monkeypatch.setenv("IABN_BACKEND", "reference")
    forward, backward = _calls_per_step(iabn.InPlaceABN(8))
    assert forward == [
        "aten.abs", "aten.clamp_", "aten.copysign_",  # g = sign(w) max(|w|, eps): invertible
        "aten.native_batch_norm",    # statistics, running stats, normalise into x
        "aten.leaky_relu_",          # activation in place
        "aten.add_",                 # num_batches_tracked += 1, once the call has succeeded
    ]
    assert backward == [
        "aten.leaky_relu",           # y = phi^-1(z)
        "aten.leaky_relu_backward",  # dy = phi'(y) dz, from z
        "aten.reciprocal", "aten.mul", "aten.mul_",  # (C,) 1/g and g^2 invstd of the identity
        "aten.native_batch_norm_backward",  # dx, dg, dbeta from y in one call
    ]


def test_batch_norm_baseline_calls():
    """What the layer is compared with: 3 calls forward, 2 backward (the in-place layer adds
    the |g| clamp, the inversion and three per-channel operations: 12 against 5)."""
    forward, backward = _calls_per_step(
        nn.Sequential(nn.BatchNorm2d(8), nn.LeakyReLU(0.01, inplace=True))
    )
    assert forward == ["aten.add_", "aten.native_batch_norm", "aten.leaky_relu_"]
    assert backward == ["aten.leaky_relu_backward", "aten.native_batch_norm_backward"]
