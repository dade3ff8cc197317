"""The output-only layer and RMS norms' backward on the Triton backend
(``triton_backend.row_norm_backward``: one launch of ``row_norm_grad_kernel`` and one sum of its
partials), against PyTorch's own modules (``nn.LayerNorm``, ``nn.RMSNorm``, ``F.layer_norm``
on dim 1 for the 2d layer) in float64, and against their error in float32 and bfloat16.

The kernels run on ``TRITON_DEVICE`` (see conftest.py): interpreted on CPU, compiled on CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from iabn.kernels.backends import use_backend
from iabn.measure import traffic

from helpers import TRITON_DEVICE, runs_triton

pytest.importorskip("triton")

F64 = torch.float64
#: float64: measured largest relative difference from the modules 5.7e-16 (this file's cases,
#: CPU interpreter); asserted 1e-13 as tests/core/test_layer_norm.py.
F64_BOUND = 1e-13
#: float32/bfloat16: the largest ratio of the layer's error from float64 to the module's own,
#: tests/core/test_layer_norm.py's BOUND (measured here: see test_low_precision_*).
LOW_BOUND = {torch.float32: 2.0, torch.bfloat16: 1.5}


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: the norm over dim 1 of (N, C, H, W)."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight,
                            self.bias, self.eps).permute(0, 3, 1, 2)


def _pair(kind, shape, dtype=F64):
    if kind == "layer":
        ref, ours = nn.LayerNorm(shape, dtype=dtype), iabn.InPlaceLayerNorm(shape, dtype=dtype)
    elif kind == "rms":
        ref = nn.RMSNorm(shape, eps=1e-6, dtype=dtype)
        ours = iabn.InPlaceRMSNorm(shape, eps=1e-6, dtype=dtype)
    elif kind == "rms_no_weight":
        ref = nn.RMSNorm(shape, eps=1e-6, elementwise_affine=False, dtype=dtype)
        ours = iabn.InPlaceRMSNorm(shape, eps=1e-6, elementwise_affine=False, dtype=dtype)
    else:
        ours = iabn.InPlaceLayerNorm2d(shape).to(dtype)
        ref = LayerNorm2d(shape, eps=ours.eps, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if ref.weight is not None:
            ref.weight.copy_(torch.rand(ref.weight.shape, generator=g, dtype=dtype) + 0.5)
        if getattr(ref, "bias", None) is not None:
            ref.bias.copy_(0.3 * torch.randn(ref.bias.shape, generator=g, dtype=dtype))
    ours.load_state_dict(ref.state_dict())
    return ref.to(TRITON_DEVICE), ours.to(TRITON_DEVICE)


def _grads(module, x, dz, backend):
    leaf = x.clone().requires_grad_()
    with use_backend(backend):
        out = module(leaf * 1)
        wanted = [p for p in module.parameters() if p.requires_grad]
        got = torch.autograd.grad(out, [leaf, *wanted], dz)
    return out.detach(), *got


CASES = [  # (kind, normalized shape, input shape)
    ("layer", 24, (3, 7, 24)),
    ("layer", 384, (2, 5, 384)),
    ("layer", (6, 5), (4, 6, 5)),
    ("layer", 1000, (37, 1000)),  # one row per tile, rows spread over the programs
    ("rms", 384, (2, 5, 384)),
    ("rms", 33, (70, 33)),
    ("rms_no_weight", 64, (9, 64)),
    ("2d", 8, (2, 8, 3, 5)),
]
IDS = [f"{k}-{s}" for k, _, s in CASES]


@runs_triton
@pytest.mark.parametrize("kind, shape, x_shape", CASES, ids=IDS)
def test_float64_equals_pytorch_s_module(kind, shape, x_shape):
    ref, ours = _pair(kind, shape)
    torch.manual_seed(2)
    x = torch.randn(x_shape, dtype=F64, device=TRITON_DEVICE) * 2 + 0.5
    dz = torch.randn(x_shape, dtype=F64, device=TRITON_DEVICE)
    theirs = _grads(ref, x, dz, "reference")
    mine = _grads(ours, x, dz, "triton")
    for got, want in zip(mine, theirs, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert (got - want).abs().max() <= F64_BOUND * want.abs().max()


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind, shape, x_shape", [CASES[1], CASES[4], CASES[7]],
                         ids=[IDS[1], IDS[4], IDS[7]])
def test_low_precision_error_within_a_multiple_of_pytorch_s(kind, shape, x_shape, dtype):
    ref64, _ = _pair(kind, shape)
    ref, ours = (copy.deepcopy(m).to(dtype) for m in _pair(kind, shape))
    torch.manual_seed(3)
    x = (torch.randn(x_shape, device=TRITON_DEVICE) * 2 + 0.5).to(dtype)
    dz = torch.randn(x_shape, device=TRITON_DEVICE).to(dtype)
    exact = _grads(ref64.to(dtype).double(), x.double(), dz.double(), "reference")
    theirs = _grads(ref, x, dz, "reference")
    mine = _grads(ours, x, dz, "triton")
    eps = torch.finfo(dtype).eps
    for got, want, e in zip(mine, theirs, exact, strict=True):
        floor = eps * float(e.abs().max())
        mine_err = float((got.double() - e).abs().max())
        theirs_err = float((want.double() - e).abs().max())
        assert mine_err <= LOW_BOUND[dtype] * max(theirs_err, floor), (mine_err, theirs_err)


def _count(layer, x_shape, dtype=torch.float32):
    torch.manual_seed(0)
    leaf = torch.randn(x_shape, device=TRITON_DEVICE).to(dtype).requires_grad_()
    grad = torch.randn(x_shape, device=TRITON_DEVICE).to(dtype)
    with use_backend("triton"):
        step = traffic.count_step(layer, leaf, grad)
    return step, leaf.numel() * leaf.element_size()


@runs_triton
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_is_one_kernel_and_one_sum(kind):
    """Reads y and dy, writes dx: 3 activations; the weight (and bias) gradients are one
    ``sum`` of the (programs, D) partials (not full-size)."""
    _, layer = _pair(kind, 384, torch.float32)
    step, a = _count(layer, (2, 5, 384))
    assert step.backward.names() == ["triton.row_norm_grad_kernel", "aten.sum"]
    assert step.backward.moved == 3 * a
    assert step.backward.peak_bytes == a  # dx


@runs_triton
def test_kept_columns_go_to_the_reference_and_match_pytorch():
    """A zero and a NaN weight keep their xhat columns: the reference runs that backward
    (no Triton launch), with PyTorch's results (finite where PyTorch's are)."""
    ref, ours = _pair("layer", 16)
    with torch.no_grad():
        for m in (ref, ours):
            m.weight[3] = 0.0
    torch.manual_seed(4)
    x = torch.randn(5, 16, dtype=F64, device=TRITON_DEVICE)
    dz = torch.randn(5, 16, dtype=F64, device=TRITON_DEVICE)
    for got, want in zip(_grads(ours, x, dz, "triton"), _grads(ref, x, dz, "reference"),
                         strict=True):
        assert (got - want).abs().max() <= F64_BOUND * want.abs().max()
    step, _ = _count(ours.float(), (5, 16))
    assert not any(name.startswith("triton.") for name in step.backward.names())


@runs_triton
def test_only_the_wanted_gradients():
    """No weight gradient asked for (frozen parameters): dx only, equal to the module's."""
    ref, ours = _pair("layer", 24)
    for m in (ref, ours):
        m.requires_grad_(False)
    torch.manual_seed(5)
    x = torch.randn(3, 24, dtype=F64, device=TRITON_DEVICE)
    dz = torch.randn(3, 24, dtype=F64, device=TRITON_DEVICE)
    got, want = _grads(ours, x, dz, "triton")[1], _grads(ref, x, dz, "reference")[1]
    assert (got - want).abs().max() <= F64_BOUND * want.abs().max()
