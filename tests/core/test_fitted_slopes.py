"""The fitted slopes of the activations with one minimum (``iabn.kernels.branch``: the left
branch's ``left_slope``, the right branch's ``right_slope`` and their use in the backward,
float32 and half inputs on CPU and under the compiler).

The reference is independent of iabn: torch's own module in float64, inverted on the given
branch by bisection (200 halvings) at the float32 output, and its float64 derivative there
(autograd). Both branches, the tails (down to where float32 outputs underflow) and the
neighbourhood of the minimum.
"""

import pytest
import torch

from iabn.kernels import branch, cpu_loops

from helpers import BRANCH, exact_inverse, torch_activation, torch_minimum

F64 = torch.float64


@pytest.fixture(params=["vector_loop", "loop", "aten"])
def cpu_path(request, monkeypatch):
    """The float32 backward on CPU every way: the 16-lane loop over the slope tables where the
    CPU has AVX-512 (``kernels/vector_loops.py``), Numba's scalar loop over the fitted slopes
    (``kernels/numba_loops.py``) and, where Numba is missing, ATen's chunks (forced here by
    refusing the loops)."""
    if request.param != "aten" and not cpu_loops.available():
        pytest.skip("Numba is not installed")
    if request.param == "vector_loop" and not cpu_loops._vector_loops().supported():
        pytest.skip("the CPU has no AVX-512")
    if request.param == "aten":
        monkeypatch.setattr(cpu_loops, "runs_on", lambda *tensors: False)
    else:
        monkeypatch.setattr(cpu_loops, "VECTOR_LOOP", request.param == "vector_loop")
    return request.param


def _exact_slope(z32, left, name):
    """float64 ``phi'(y)`` at the ``y`` with torch's ``phi(y) = z32`` on the given branch."""
    y = exact_inverse(z32, left, name).requires_grad_()
    (slope,) = torch.autograd.grad(torch_activation(name)(y).sum(), y)
    return slope


def _outputs(name, left):
    """float32 outputs of float64 inputs on one branch: 0.05 .. 100 from y* (left: to where
    the output underflows), log-spaced, plus uniform ones across the first 6."""
    y_star = torch_minimum(name)
    offsets = torch.cat([torch.logspace(-1.3, 2, 3000, dtype=F64),
                         torch.linspace(0.05, 6, 3000, dtype=F64)])
    y = y_star - offsets if left else y_star + offsets
    z32 = torch_activation(name)(y).float()
    keep = z32 < 0 if left else torch.ones_like(z32, dtype=torch.bool)
    return y[keep], z32[keep]


#: Largest |left_slope - exact slope at the float32 output| farther than 0.05 from y*,
#: measured on this data (CPU, Horner's steps as addcmul): silu 6.8e-8, gelu 5.4e-8,
#: gelu_tanh 5.5e-8, mish 5.3e-8 (9.2e-8, 7.3e-8, 8.9e-8, 8.2e-8 as mul_ then add_;
#: benchmarks/fit_inverse.py, on its own samples: 9.8e-8, 7.5e-8, 8.8e-8, 7.9e-8). The
#: slopes lie in [-0.11, 0]; float32's eps is 1.2e-7. Asserted: 1.5 x 1e-7.
LEFT_BOUND = 1.5e-7


@pytest.mark.parametrize("name", BRANCH)
def test_left_slope_against_torch_in_float64(name):
    _, z32 = _outputs(name, left=True)
    exact = _exact_slope(z32, torch.ones_like(z32, dtype=torch.bool), name)
    got = branch.left_slope(z32, name)
    assert got.dtype == torch.float32
    error = (got.double() - exact).abs().max().item()
    assert error <= LEFT_BOUND, error


#: Largest |right_slope - exact slope at the float32 output| farther than 0.05 from y* (to
#: 100 beyond, where the slope is 1), measured on this data (CPU): silu 2.0e-7, gelu 1.7e-7,
#: gelu_tanh 1.7e-7, mish 1.8e-7 (benchmarks/fit_inverse.py, on its own samples: 2.2e-7,
#: 2.0e-7, 2.0e-7, 2.2e-7). The slopes lie in [0, 1.13]; float32 rounds those above 1 in
#: steps of 1.2e-7. Asserted: 1.5x the largest.
RIGHT_BOUND = 1.5 * 2.0e-7


@pytest.mark.parametrize("name", BRANCH)
def test_right_slope_against_torch_in_float64(name):
    _, z32 = _outputs(name, left=False)
    exact = _exact_slope(z32, torch.zeros_like(z32, dtype=torch.bool), name)
    got = branch.right_slope(z32, name)
    assert got.dtype == torch.float32
    error = (got.double() - exact).abs().max().item()
    assert error <= RIGHT_BOUND, error


@pytest.mark.parametrize("name", BRANCH)
def test_right_slope_at_and_below_the_minimum_and_far_out(name):
    """Below ``z*`` (a rounding) the slope is held at 0, the slope at ``y*``; far out it is 1
    to float32 rounding; infinite outputs give 1."""
    _, z_star, _ = branch.minimum(name)
    z = torch.tensor([z_star - 1e-3, z_star - 1e-7, 50.0, 1e4, 3e38, float("inf")])
    got = branch.right_slope(z, name)
    assert torch.equal(got[:2], torch.zeros(2)), got
    assert (got[2:] - 1).abs().max() <= torch.finfo(torch.float32).eps, got


def test_fitted_slope_takes_each_branch_exactly():
    """The float weight of ``lerp`` (the CPU path) and the bool of ``where`` choose the same
    branch's value bit for bit."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4096, generator=g) * 0.1 - 0.1
    left = torch.rand(4096, generator=g) < 0.5
    by_where = branch.fitted_slope(z, left, "silu")
    by_lerp = branch.fitted_slope(z, left.float(), "silu")
    assert torch.equal(by_where, by_lerp)
    assert torch.equal(by_where[left], branch.left_slope(z, "silu")[left])
    assert torch.equal(by_where[~left], branch.right_slope(z, "silu")[~left])


@pytest.mark.parametrize("name", BRANCH)
def test_left_slope_of_an_underflowed_output_is_zero(name):
    z = torch.tensor([0.0, -0.0, -1e-45, -1e-38], dtype=torch.float32)
    got = branch.left_slope(z, name)
    assert torch.isfinite(got).all() and got.abs().max() <= 1e-37


#: Largest |slope - exact slope at the float32 output| of both branches through
#: ``activation_grad`` (the fitted slopes, no Newton step) farther than 0.05 from y*, as a
#: multiple of eps = 1.19e-7 (slopes up to 1.13), measured on this data (CPU): ATen's chunks
#: silu 1.69, gelu 1.46, gelu_tanh 1.45, mish 1.52; Numba's loop 1.32, 1.26, 1.53, 1.35; all
#: on the right branch (left: at most 0.57); one Newton step from the fitted start gave silu
#: 8.1, gelu 1.3, gelu_tanh 1.7, mish 4.7, the four steps from the plain start 8.1, 1.1, 1.9,
#: 4.7. Asserted: 1.5x the larger, rounded up.
BOTH_BOUND_EPS = {"silu": 2.6, "gelu": 2.2, "gelu_tanh": 2.3, "mish": 2.3}


@pytest.mark.parametrize("name", BRANCH)
def test_activation_grad_float32_both_branches_and_tails(name, cpu_path):
    ys, zs, lefts = [], [], []
    for left in (True, False):
        y, z32 = _outputs(name, left)
        ys.append(y), zs.append(z32), lefts.append(torch.full_like(z32, left, dtype=torch.bool))
    z32, left = torch.cat(zs), torch.cat(lefts)
    exact = _exact_slope(z32, left, name)
    dz = torch.ones_like(z32)
    got = branch.activation_grad(z32, dz, branch.pack_bits(left), name)
    error = (got.double() - exact).abs().max().item()
    assert error <= BOTH_BOUND_EPS[name] * torch.finfo(torch.float32).eps, error


@pytest.mark.parametrize("name", BRANCH)
def test_activation_grad_float32_at_the_minimum(name, cpu_path):
    """At and within 1e-9 .. 1e-2 of y*, both branches: the stored output's rounding moves y
    by sqrt(2 eps |z*| / c), so the slope by sqrt(2 c eps |z*|) ~ 1e-4; measured at most
    1.0x the exact slope at the stored output's error against float64 torch + 1e-5,
    asserted 2x + 1e-5."""
    y_star = torch_minimum(name)
    offsets = torch.tensor([0.0, 1e-9, 1e-7, 1e-5, 1e-4, 1e-3, 1e-2], dtype=F64)
    y = torch.cat([y_star - offsets, y_star + offsets])
    left = y < y_star
    z32 = torch_activation(name)(y).float()
    leaf = y.clone().requires_grad_()
    (truth,) = torch.autograd.grad(torch_activation(name)(leaf).sum(), leaf)
    exact_from_z = _exact_slope(z32, left, name)
    got = branch.activation_grad(z32, torch.ones_like(z32), branch.pack_bits(left), name)
    error = (got.double() - truth).abs().max().item()
    inherent = (exact_from_z - truth).abs().max().item()
    assert error <= 2 * inherent + 1e-5, (error, inherent)


def test_log1p_from_log2_against_float64():
    """``branch._log1p_`` (log2 plus the rounding of ``1 + u``) over 1e-12 .. 1e3 and 0:
    measured within 1.3 eps relative of float64 ``log1p`` (torch's float32 ``log1p``: 0.5);
    asserted 2 eps."""
    u = torch.cat([torch.logspace(-12, 3, 20001), torch.zeros(1)])
    got = branch._log1p_(u.clone())
    exact = torch.log1p(u.double())
    assert got[-1] == 0
    relative = ((got.double() - exact) / exact)[:-1].abs().max().item()
    assert relative <= 2 * torch.finfo(torch.float32).eps, relative


#: The reference backward of the layer at 4x33x48 float32 (one chunk), counted by
#: iabn.measure.traffic: launches, bytes of activation-sized tensors in activations, and the
#: peak of those alive. Numba's loop: one launch reading z and dz, writing dx (the bits, 1/32
#: of z, not counted). ATen's chunks: both fitted slopes on every element, Horner's steps as
#: one addcmul each (the right one's Newton step on gathered elements, not counted, was 149
#: launches and 111.5 before); the four Newton steps on both branches were 487 launches (GELU,
#: benchmarks/transformer_traffic.py --quick).
COUNTS = {"vector_loop": (1, 3.0, 1.0), "loop": (1, 3.0, 1.0), "aten": (85, 218.0, 6.0)}


@pytest.mark.parametrize("name", BRANCH)
def test_reference_backward_launches_and_bytes(name, cpu_path):
    import iabn
    from iabn.measure import traffic

    layers = {"gelu": lambda: iabn.InPlaceGELU(), "gelu_tanh": lambda: iabn.InPlaceGELU("tanh"),
              "silu": lambda: iabn.InPlaceSiLU(), "mish": lambda: iabn.InPlaceMish()}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 33, 48, generator=g) * 3
    step = traffic.count_step(layers[name](), x.requires_grad_(), torch.randn(x.shape, generator=g))
    activation = x.numel() * x.element_size()
    backward = step.backward
    assert (len(backward.launches), backward.moved / activation,
            backward.peak_bytes / activation) == COUNTS[cpu_path]


def _both_branches(name):
    zs, lefts = [], []
    for left in (True, False):
        _, z32 = _outputs(name, left)
        zs.append(z32), lefts.append(torch.full_like(z32, left, dtype=torch.bool))
    return torch.cat(zs), torch.cat(lefts)


@pytest.mark.parametrize("name", BRANCH)
@pytest.mark.parametrize("extra", [0, 3], ids=["multiple-of-8", "not-a-multiple-of-8"])
def test_compiled_activation_grad_float32(name, extra, cpu_path):
    """Under the compiler (aot_eager, fullgraph) on CPU the backward is the operator
    ``iabn::fitted_activation_grad`` (the eager loop or chunks): the eager bound."""
    torch._dynamo.reset()
    z32, left = _both_branches(name)
    size = z32.numel() // 8 * 8 - 8 + extra
    z32, left = z32[:size], left[:size]
    exact = _exact_slope(z32, left, name)
    grad = torch.compile(lambda z, dz, bits: branch.activation_grad(z, dz, bits, name),
                         backend="aot_eager", fullgraph=True)
    got = grad(z32, torch.ones_like(z32), branch.pack_bits(left))
    error = (got.double() - exact).abs().max().item()
    assert error <= BOTH_BOUND_EPS[name] * torch.finfo(torch.float32).eps, error


@pytest.mark.parametrize("name", BRANCH)
def test_rows_of_eight_form_float32(name):
    """The compiler's form off the CPU (rows of eight elements, a byte of bits each), run
    eagerly here (Horner's steps as addcmul): the eager bound (measured: silu 1.69, gelu 1.46,
    gelu_tanh 1.45, mish 1.52 eps; traced, as mul then add, 1.69, 1.46, 1.51, 1.60)."""
    z32, left = _both_branches(name)
    size = z32.numel() // 8 * 8
    z32, left = z32[:size], left[:size]
    exact = _exact_slope(z32, left, name)
    got = branch._fitted_grad_rows(z32, torch.ones_like(z32), branch.pack_bits(left), name)
    error = (got.double() - exact).abs().max().item()
    assert error <= BOTH_BOUND_EPS[name] * torch.finfo(torch.float32).eps, error


def test_fitted_operator_opcheck():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1001, generator=g)
    bits = branch.pack_bits(torch.rand(1001, generator=g) < 0.5)
    torch.library.opcheck(branch._fitted_grad_op, (z, torch.randn(1001, generator=g), bits,
                                                   "gelu"))


def test_compiled_pack_bits_equals_eager():
    """Under the compiler the bits are packed as shifted ORs, eagerly as a weighted row sum:
    the same bytes (sizes with and without a padded last byte)."""
    torch._dynamo.reset()
    packed = torch.compile(branch.pack_bits, backend="aot_eager", fullgraph=True)
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 1001):
        mask = torch.rand(n, generator=g) < 0.5
        assert torch.equal(packed(mask), branch.pack_bits(mask))
        assert torch.equal(branch.unpack_bits(packed(mask), mask.shape), mask)
