"""SiLU and GELU in the Triton kernels, beyond the shared accuracy tests of
tests/core/test_branch_activation.py (which run every backend): the hand-written ``erfcx`` the
GELU kernels use, and the branch bits forward writes.

The kernels run on ``TRITON_DEVICE`` (see conftest.py): interpreted on CPU, compiled on CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from iabn.kernels import branch
from iabn.kernels.common import LayerConfig, new_bits

from helpers import BRANCH, TRITON_DEVICE, runs_triton

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from iabn.kernels import triton_backend, triton_kernels  # noqa: E402

#: Measured largest relative errors of ``_erfcx`` over t in [0, 30] and 1e-6 .. 1e4 against
#: mpmath at 40 digits: float64 6.6e-16 (25 terms), float32 2.3e-7 (16 terms, float32
#: arithmetic; PyTorch's own float32 erfc: 7e-8). Asserted: twice these.
ERFCX_ERROR = {torch.float64: 1.4e-15, torch.float32: 4.6e-7}


def test_erfcx_series_is_the_chebyshev_interpolant():
    """The committed coefficients are the interpolant of ``(1 + 2t) erfcx(t)`` at 25
    Chebyshev nodes in ``s = (t - 3.75) / (t + 3.75)``, recomputed here with mpmath."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40
    n, k = len(triton_backend.ERFCX_SERIES), mp.mpf("3.75")

    def q(s):
        t = k * (1 + s) / (1 - s)
        return (1 + 2 * t) * mp.exp(t * t) * mp.erfc(t)

    nodes = [mp.cos(mp.pi * (i + mp.mpf(1) / 2) / n) for i in range(n)]
    values = [q(s) for s in nodes]
    for j, committed in enumerate(triton_backend.ERFCX_SERIES):
        exact = 2 * mp.fsum(v * mp.cos(mp.pi * j * (i + mp.mpf(1) / 2) / n)
                            for i, v in enumerate(values)) / n
        exact = exact / 2 if j == 0 else exact
        assert committed == pytest.approx(float(exact), rel=1e-15, abs=1e-30), j


@triton.jit
def _erfcx_kernel(t_ptr, out_ptr, consts_ptr, n, CHEB: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    t = tl.load(t_ptr + i, mask=i < n, other=0.0)
    tl.store(out_ptr + i, triton_kernels._erfcx(t, consts_ptr, CHEB), mask=i < n)


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_erfcx_within_its_measured_error(dtype):
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 40
    t = torch.cat([torch.linspace(0, 30, 901, dtype=torch.float64),
                   torch.logspace(-6, 4, 120, dtype=torch.float64)]).to(dtype)
    consts = triton_backend.branch_constants(branch.MINIMA["gelu"], branch.TAYLOR["gelu"],
                                             dtype, dtype, TRITON_DEVICE)
    out = torch.empty_like(t, device=TRITON_DEVICE)
    _erfcx_kernel[(1,)](t.to(TRITON_DEVICE), out, consts, t.numel(),
                        CHEB=triton_backend._ERFCX_TERMS[dtype],
                        BLOCK=triton.next_power_of_2(t.numel()))
    worst = 0.0
    for ti, got in zip(t.tolist(), out.cpu().tolist(), strict=True):
        exact = mp.exp(mp.mpf(ti) ** 2) * mp.erfc(mp.mpf(ti))
        worst = max(worst, abs(float((mp.mpf(got) - exact) / exact)))
    assert worst <= ERFCX_ERROR[dtype], worst


@runs_triton
@pytest.mark.parametrize("activation", BRANCH)
@pytest.mark.parametrize("shape,channels_last", [
    ((3, 5, 7, 3), False),   # 315 elements: bytes straddle channels, a part byte at the end
    ((3, 5, 7, 3), True),    # channels-last: memory order differs from logical order
    ((37, 3), False),        # (N, C)
], ids=str)
def test_the_bits_are_the_branch_of_each_element_in_memory_order(monkeypatch, activation,
                                                                 shape, channels_last):
    """Forward's bits are ``y < y*`` of the float64 batch norm, element by element, eight
    consecutive memory offsets to a byte; with tiles of 16 elements the 315 elements take 20
    programs, the last one partial."""
    monkeypatch.setattr(triton_backend, "_TILE", 16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 - 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    w = torch.rand(shape[1], generator=g, dtype=torch.float64) + 0.5
    b = torch.rand(shape[1], generator=g, dtype=torch.float64) * 2 - 2
    y = F.batch_norm(x, None, None, w, b, True, 0.0, 1e-5)
    y_star = branch.MINIMA[activation][0]
    work = x.to(TRITON_DEVICE)
    config = LayerConfig(True, 0.1, 1e-5, activation, 0.0, "signed")
    packed = new_bits(work, config)
    triton_backend.forward_(work, w.to(TRITON_DEVICE), b.to(TRITON_DEVICE), None, None, config,
                            packed)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(x.numel() / 8)
    bits = ((packed.cpu().unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).bool()
    # y in memory order: the strides of x, read as a flat buffer
    flat_y = torch.empty(x.numel(), dtype=torch.float64).as_strided(x.shape, x.stride())
    flat_y.copy_(y)
    in_memory = flat_y.as_strided((x.numel(),), (1,))
    assert torch.equal(bits.reshape(-1)[: x.numel()], in_memory < y_star)
    assert not bits.reshape(-1)[x.numel():].any()  # the padding of the last byte
    torch.testing.assert_close(work.cpu(), branch.value(y, activation), rtol=1e-14, atol=1e-15)


# ------------------------------------------------------------------ activations without a norm


@runs_triton
@pytest.mark.parametrize("name", BRANCH)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_activation_grad_kernel_equals_the_reference_backend(name, dtype):
    """The one-launch backward of the activation layers without a norm
    (``triton_backend.activation_grad``) against torch's module's gradient in float64: within
    4x the reference backend's own error plus a rounding of the result (both run the same
    Newton steps, Triton's in registers with its own erfc; measured under the interpreter: at
    most 2.1x, GELU in float64, where both are below 5e-13). The input is a permuted view,
    which the kernel reads in its logical order, as the bits are packed; values span both
    branches, the far left tail and the minimum."""
    from iabn.kernels import reference

    from helpers import torch_activation

    g = torch.Generator().manual_seed(2)
    y = torch.cat([torch.linspace(-20, 8, 500, dtype=torch.float64),
                   torch.randn(520, dtype=torch.float64, generator=g) * 3])
    y = y.view(4, 17, 15).permute(2, 0, 1)  # 15 x 4 x 17, not contiguous
    dz = torch.randn(y.shape, dtype=torch.float64, generator=g)
    leaf = y.clone().requires_grad_()
    torch_activation(name)(leaf).backward(dz)
    z = torch_activation(name)(y.to(dtype)).to(TRITON_DEVICE)
    z = z.permute(1, 2, 0).contiguous().permute(2, 0, 1)  # z's strides are y's
    bits = branch.pack_bits(y.to(dtype) < branch.minimum(name)[0]).to(TRITON_DEVICE)
    got = triton_backend.activation_grad(z, dz.to(dtype).to(TRITON_DEVICE), bits, name)
    ref = reference.activation_grad(z.cpu(), dz.to(dtype), bits.cpu(), name)
    assert got.shape == z.shape and got.dtype == dtype and got.stride() == z.stride()
    error = (got.cpu().double() - leaf.grad).abs().max()
    ref_error = (ref.double() - leaf.grad).abs().max()
    rounding = torch.finfo(dtype).eps * leaf.grad.abs().max()
    assert error <= 4 * ref_error + rounding, (float(error), float(ref_error))


@runs_triton
def test_the_activation_layers_take_the_triton_backward_when_asked():
    """``IABN_BACKEND=triton`` (``use_backend``) gives the layers' backward the one-launch
    kernel: one Triton launch in that backward, and the reference's gradient within 1e-6
    relative (float32, SiLU; the same Newton steps, measured 1.4e-7)."""
    import iabn
    from iabn.kernels.backends import use_backend
    from iabn.measure import traffic

    x = torch.randn(6, 40, device=TRITON_DEVICE) * 3
    dz = torch.randn_like(x)
    grads = {}
    for backend in ("reference", "triton"):
        leaf = x.clone().requires_grad_()
        with use_backend(backend):
            step = traffic.count_step(iabn.InPlaceSiLU(), leaf, dz)
        grads[backend] = leaf.grad
        kernels = [n for n in step.backward.names() if n.endswith("_kernel")]
        assert kernels == (["triton.activation_grad_kernel"] if backend == "triton" else [])
    scale = grads["reference"].abs().max()
    assert (grads["triton"] - grads["reference"]).abs().max() <= 1e-6 * scale


@runs_triton
@pytest.mark.parametrize("name", BRANCH)
def test_a_view_of_its_whole_base_through_the_triton_backward(name):
    """A linear layer's 3-d output (a view of its 2-d product) is overwritten through its
    base, and the Triton backward then gets ``z`` and ``dz`` in the view's shape: the input,
    weight and bias gradients are those of the same layer on a tensor that is no view."""
    import iabn
    from iabn.kernels.backends import use_backend

    layers = {"silu": iabn.InPlaceSiLU, "gelu": iabn.InPlaceGELU,
              "gelu_tanh": lambda: iabn.InPlaceGELU("tanh"), "mish": iabn.InPlaceMish}
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 8, generator=g) * 2).to(TRITON_DEVICE)
    dz = torch.randn(3, 5, 16, generator=g).to(TRITON_DEVICE)
    lin = torch.nn.Linear(8, 16).to(TRITON_DEVICE)
    results = []
    for view in (True, False):
        leaf = x.clone().requires_grad_()
        lin.zero_grad()
        with use_backend("triton"):
            pre = lin(leaf)
            if not view:
                pre = pre.clone()
            assert pre._is_view() == view
            layers[name]()(pre).backward(dz)
        results.append([leaf.grad, lin.weight.grad.clone(), lin.bias.grad.clone()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
