"""The Numba loops of the activations with one minimum (``iabn.kernels.cpu_loops``): the bit
packing against torch's comparison, the backward against the float64 slope of torch's own
activation (``tests/core/test_fitted_slopes.py`` bounds it over both branches and the
minimum; here the shapes, dtypes, threads and the cases the loops refuse), and their launch
count."""

from __future__ import annotations

import pytest
import torch

from iabn.kernels import branch, cpu_loops
from iabn.kernels.fitted_inverse import INVERSE

from helpers import BRANCH, exact_inverse, torch_activation

pytestmark = pytest.mark.skipif(not cpu_loops.available(), reason="Numba is not installed")
if cpu_loops.available():
    from iabn.kernels import numba_loops
THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True, params=["scalar", "vector"])
def loop(request):
    """Every test both ways where the CPU runs both: :mod:`iabn.kernels.numba_loops`' scalar
    loop and, with AVX-512, :mod:`iabn.kernels.vector_loops`' 16-lane one."""
    vector = request.param == "vector"
    if vector and not cpu_loops._vector_loops().supported():
        pytest.skip("the CPU has no AVX-512")
    saved = cpu_loops.VECTOR_LOOP
    cpu_loops.VECTOR_LOOP = vector
    yield request.param
    cpu_loops.VECTOR_LOOP = saved


def _step_data(name, n, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * scale
    z = torch_activation(name)(x).float()
    left = x < branch.minimum(name)[0]
    return z, left, torch.randn(n, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1001])
def test_pack_below_equals_torch_comparison(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=dtype)
    x[::3] = -0.5  # ties with the threshold: not below it
    got = cpu_loops.pack_below(x, -0.5)
    assert got.dtype == torch.uint8 and got.numel() == (n + 7) // 8
    assert torch.equal(got, branch.pack_bits(x < -0.5))


def test_pack_below_of_a_strided_tensor_packs_its_logical_order():
    x = torch.randn(6, 10).t()  # not contiguous
    assert torch.equal(cpu_loops.pack_below(x, 0.1), branch.pack_bits(x < 0.1))


@pytest.mark.parametrize("split", [-1.0, 2.0], ids=["both-branches", "left-gathered"])
@pytest.mark.parametrize("name", BRANCH)
def test_backward_against_float64_torch(name, split, monkeypatch):
    """Random outputs of both branches: ``dx`` within 2.6 eps of ``|dz|`` times the exact
    slope at the float32 output (measured on this data: 1.75 silu, 1.38 gelu, 1.58
    gelu_tanh, 1.53 mish, the slope's error and the product's rounding; asserted 1.5x the
    largest). Every chunk one way: both branches on every element, or the left branch on
    the left elements gathered (``cpu_loops.SPLIT``)."""
    monkeypatch.setitem(cpu_loops.SPLIT, "activation_grad", split)
    z, left, dz = _step_data(name, 4099)
    y = exact_inverse(z, left, name).requires_grad_()
    (slope,) = torch.autograd.grad(torch_activation(name)(y).sum(), y)
    got = cpu_loops.activation_grad(z, dz, branch.pack_bits(left), name, branch.SLOPES[name])
    assert got.dtype == torch.float32 and got.shape == z.shape
    error = ((got.double() - slope * dz.double()).abs() / dz.double().abs().clamp(min=1e-30))
    assert error.max().item() <= 2.6 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("name", BRANCH)
def test_threads_give_the_same_bits(name, monkeypatch):
    """Cut into ranges run on threads (a grain of 64 elements, 2 threads, a length that is not
    a multiple of 8): bit for bit the single range's result."""
    z, left, dz = _step_data(name, 1000 + 5)
    bits = branch.pack_bits(left)
    whole = cpu_loops.activation_grad(z, dz, bits, name, branch.SLOPES[name])
    monkeypatch.setattr(cpu_loops, "THREAD_GRAIN", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert len(cpu_loops._ranges(z.numel())) == 2
        cut = cpu_loops.activation_grad(z, dz, bits, name, branch.SLOPES[name])
        packed = cpu_loops.pack_below(z, -0.1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cut, whole)
    assert torch.equal(packed, branch.pack_bits(z < -0.1))


def _mixed_chunks(name, chunks, tail, seed=0):
    """Outputs of ``chunks`` whole chunks of the loops and ``tail`` elements more, the chunks'
    shares of left-branch elements rising from none to all: each chunk takes its own way."""
    g = torch.Generator().manual_seed(seed)
    y_star = branch.minimum(name)[0]
    n = chunks * numba_loops.CHUNK + tail
    share = torch.linspace(0, 1, chunks + 1, dtype=torch.float64).repeat_interleave(
        numba_loops.CHUNK)[:n]
    left = torch.rand(n, generator=g, dtype=torch.float64) < share
    distance = torch.rand(n, generator=g, dtype=torch.float64) * 6 + 1e-6
    x = torch.where(left, y_star - distance, y_star + distance)
    return torch_activation(name)(x).float(), x < y_star, torch.randn(n, generator=g)


@pytest.mark.parametrize("name", BRANCH)
def test_both_ways_of_a_chunk_give_the_same_bits(name, monkeypatch):
    """Chunks with 0 % .. 100 % left elements, a tail that is not a whole word of bits, and
    ranges cut over two threads (not starting on a word): the gradient and the recovered
    ``y`` bit for bit the same whichever way each chunk goes (both branches on every element,
    or the left elements gathered, computed and scattered back)."""
    z, left, dz = _mixed_chunks(name, chunks=5, tail=77)
    bits = branch.pack_bits(left)
    inverse = (name, branch.SLOPES[name], INVERSE[name], branch.minimum(name)[1])
    results = []
    for split in (-1.0, 2.0, None):  # every chunk one way, the other way, as measured
        if split is not None:
            monkeypatch.setitem(cpu_loops.SPLIT, "activation_grad", split)
            monkeypatch.setitem(cpu_loops.SPLIT, "invert_and_slope", split)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(cpu_loops, "THREAD_GRAIN", 1000)
            torch.set_num_threads(2)
        try:
            grad = cpu_loops.activation_grad(z, dz, bits, name, branch.SLOPES[name])
            y, dy = cpu_loops.invert_and_slope(z, dz, bits, *inverse)
        finally:
            torch.set_num_threads(THREADS)
        results.append((grad, y, dy))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
    # and the values are the activation's: the gradient against float64 torch
    exact = exact_inverse(z, left, name).requires_grad_()
    (slope,) = torch.autograd.grad(torch_activation(name)(exact).sum(), exact)
    error = (results[0][0].double() - slope * dz.double()).abs() / dz.double().abs()
    assert error.max().item() <= 2.6 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_outputs_are_computed_in_float32(dtype):
    z, left, dz = _step_data("gelu", 515)
    z16, dz16 = z.to(dtype), dz.to(dtype)
    got = cpu_loops.activation_grad(z16, dz16, branch.pack_bits(left), "gelu",
                                    branch.SLOPES["gelu"])
    want = cpu_loops.activation_grad(z16.float(), dz16.float(), branch.pack_bits(left),
                                     "gelu", branch.SLOPES["gelu"]).to(dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_strided_and_shaped_inputs():
    z, left, dz = _step_data("silu", 6 * 35)
    bits = branch.pack_bits(left)
    flat = cpu_loops.activation_grad(z, dz, bits, "silu", branch.SLOPES["silu"])
    # the same logical values, stored transposed: the loop reads them in logical order
    zt = z.view(6, 35).t().contiguous().t()
    dzt = dz.view(6, 35).t().contiguous().t()
    got = cpu_loops.activation_grad(zt, dzt, bits, "silu", branch.SLOPES["silu"])
    assert got.shape == (6, 35) and torch.equal(got.reshape(-1), flat)


def test_the_loops_refuse_what_is_not_a_plain_cpu_tensor():
    x = torch.randn(8)
    assert cpu_loops.runs_on(x, x)
    assert not cpu_loops.runs_on(torch.empty(8, device="meta"))
    assert not cpu_loops.runs_on(torch.nn.Parameter(x))  # a subclass: its own rules
    seen = []
    torch.func.vmap(lambda row: seen.append(cpu_loops.runs_on(row)) or row)(x.view(2, 4))
    assert seen == [False]


def test_activation_layer_through_the_loops_and_without_them(monkeypatch):
    """A training step of InPlaceGELU: the loops' gradient and ATen's chunks' agree within the
    fitted slopes' bounds (each is bounded against float64 torch in test_fitted_slopes.py)."""
    import iabn

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 50, 40, generator=g) * 2
    dz = torch.randn(x.shape, generator=g)

    def grad():
        leaf = x.clone().requires_grad_()
        iabn.InPlaceGELU()(leaf * 1).backward(dz)
        return leaf.grad

    loops = grad()
    monkeypatch.setattr(cpu_loops, "runs_on", lambda *tensors: False)
    chunks = grad()
    error = ((loops - chunks).abs() / dz.abs().clamp(min=1e-30)).max().item()
    assert error <= 2 * 2.6 * torch.finfo(torch.float32).eps


def test_traffic_counts_one_launch_each_way():
    import iabn
    from iabn.measure import traffic

    x = torch.randn(4, 33, 48) * 3
    step = traffic.count_step(iabn.InPlaceSiLU(), x.requires_grad_(), torch.randn(x.shape))
    assert step.forward.names() == ["cpu_loops.pack_below", "aten.silu_"]
    assert step.backward.names() == ["cpu_loops.activation_grad"]
    assert step.backward.moved == 3 * x.numel() * 4  # z, dz read; dx written


def _row_norm_case(kind, d, weight, bias, seed=0):
    import iabn

    g = torch.Generator().manual_seed(seed)
    layer = (iabn.InPlaceLayerNorm(d, elementwise_affine=weight, bias=bias) if kind == "layer"
             else iabn.InPlaceRMSNorm(d, elementwise_affine=weight))
    reference = (torch.nn.LayerNorm(d, elementwise_affine=weight, bias=bias) if kind == "layer"
                 else torch.nn.RMSNorm(d, elementwise_affine=weight)).double()
    with torch.no_grad():
        for ours, theirs in zip(layer.parameters(), reference.parameters(), strict=True):
            ours.copy_(torch.randn(ours.shape, generator=g) * 0.3 + 1.0)
            theirs.copy_(ours)
    x = torch.randn(3, 37, d, generator=g) * 2 + 0.5
    return layer, reference, x, torch.randn(x.shape, generator=g)


def _row_norm_grads(layer, x, dz):
    leaf = x.clone().requires_grad_()
    layer.zero_grad()
    layer(leaf * 1).backward(dz)
    return [leaf.grad] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize(("kind", "weight", "bias"), [
    ("layer", True, True), ("layer", True, False), ("layer", False, False),
    ("rms", True, False), ("rms", False, False)])
def test_row_norm_backward_loop_against_float64_torch(kind, weight, bias, monkeypatch):
    """The loop's gradients (input, weight, bias) against torch's float64 module: no worse
    than ATen's operations (measured at 3x37x64: input within 1.0x of theirs, parameter
    sums in float64 8-10x closer); asserted 1.5x theirs."""
    layer, reference, x, dz = _row_norm_case(kind, 64, weight, bias)
    loop = _row_norm_grads(layer, x, dz)
    monkeypatch.setattr(cpu_loops, "runs_on", lambda *tensors: False)
    aten = _row_norm_grads(layer, x, dz)
    leaf = x.double().requires_grad_()
    reference(leaf).backward(dz.double())
    exact = [leaf.grad] + [p.grad for p in reference.parameters()]
    assert len(loop) == len(exact)
    for ours, theirs, truth in zip(loop, aten, exact, strict=True):
        ours_error = (ours.double() - truth).abs().max().item()
        aten_error = (theirs.double() - truth).abs().max().item()
        assert ours_error <= 1.5 * aten_error + 1e-12, (ours_error, aten_error)


def test_row_norm_backward_threads_and_counts(monkeypatch):
    """Rows cut over two threads give the single range's input gradient bit for bit (its
    parameter sums add per range, within float64 rounding); one launch moves activation
    bytes, 3 passes (the others are per-feature: -b / w, the float64 sums' total)."""
    from iabn.measure import traffic

    layer, _, x, dz = _row_norm_case("layer", 48, True, True)
    whole = _row_norm_grads(layer, x, dz)
    monkeypatch.setattr(cpu_loops, "THREAD_GRAIN", 48 * 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cut = _row_norm_grads(layer, x, dz)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cut[0], whole[0])
    for a, b in zip(cut[1:], whole[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    step = traffic.count_step(layer, x.requires_grad_(), dz)
    moving = [launch.name for launch in step.backward.launches if launch.read or launch.written]
    assert moving == ["cpu_loops.row_norm_backward"]
    assert step.backward.moved == 3 * x.numel() * 4


def test_tensors_that_require_grad_are_read_too():
    """Saved outputs of a step may still say ``requires_grad``; the loops read their values
    (numpy refuses such tensors unless detached)."""
    z, left, dz = _step_data("silu", 64)
    want = cpu_loops.activation_grad(z, dz, branch.pack_bits(left), "silu",
                                     branch.SLOPES["silu"])
    got = cpu_loops.activation_grad(z.clone().requires_grad_(), dz.clone().requires_grad_(),
                                    branch.pack_bits(left), "silu", branch.SLOPES["silu"])
    assert torch.equal(got, want)
    x = torch.randn(65, requires_grad=True)
    assert torch.equal(cpu_loops.pack_below(x, 0.0), branch.pack_bits(x.detach() < 0))
    rows, grads = torch.randn(4, 8), torch.randn(4, 8)
    args = (None, None, torch.ones(4, 1), True)
    want = cpu_loops.row_norm_backward(rows, grads, *args)
    got = cpu_loops.row_norm_backward(rows.clone().requires_grad_(), grads, *args)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 31, 33, 100])
def test_any_length_gives_each_element_its_own_gradient(n):
    """A length that is not a whole number of the vector loop's 16 lanes (its last elements
    run as a padded block) or of bytes of bits: each element's gradient bit for bit the one
    it has inside a longer tensor."""
    z, left, dz = _step_data("gelu", 160, seed=n)
    whole = cpu_loops.activation_grad(z, dz, branch.pack_bits(left), "gelu",
                                      branch.SLOPES["gelu"])
    part = cpu_loops.activation_grad(z[:n], dz[:n], branch.pack_bits(left[:n]), "gelu",
                                     branch.SLOPES["gelu"])
    assert torch.equal(part, whole[:n])


@pytest.mark.parametrize("name", BRANCH)
def test_outputs_at_the_ends_of_each_branch(name):
    """Right branch: below ``z*`` (a rounding) the slope is 0, the slope at ``y*``; far out
    and at infinity it is 1 to float32's rounding. Left branch: below ``z*`` 0 to within the
    uncertainty any float32 output has there (``sqrt(2 c eps |z*|)``, about 1e-4: the scalar
    loop's fitted ratio gives 3.3e-8 for SiLU, 6.9e-5 for Mish; the vector loop 0); an
    output that underflowed (0, -0, subnormal) or nearly (-1e-38) has a slope of 0 to within
    its size."""
    _, z_star, _ = branch.minimum(name)
    right = torch.tensor([z_star - 1e-3, z_star - 1e-7, 50.0, 1e4, 3e38, float("inf")])
    left = torch.tensor([z_star - 1e-3, z_star - 1e-7, 0.0, -0.0, -1e-45, -1e-38])
    z = torch.cat([right, left])
    is_left = torch.arange(12) >= 6
    got = cpu_loops.activation_grad(z, torch.ones(12), branch.pack_bits(is_left), name,
                                    branch.SLOPES[name])
    assert torch.isfinite(got).all(), got
    assert torch.equal(got[:2], torch.zeros(2)), got
    assert got[6:8].abs().max() <= 1e-4, got
    assert (got[2:6] - 1).abs().max() <= torch.finfo(torch.float32).eps, got
    assert got[8:].abs().max() <= 1e-37, got


@pytest.mark.parametrize("name", BRANCH)
def test_a_nan_output_gets_a_nan_gradient(name):
    """As torch's backward from a NaN input: NaN on either branch, the other elements as
    without it."""
    z, left, dz = _step_data(name, 48)
    clean = cpu_loops.activation_grad(z, dz, branch.pack_bits(left), name, branch.SLOPES[name])
    z[[3, 20, 33]] = float("nan")
    left[[3, 20]] = torch.tensor([True, False])
    got = cpu_loops.activation_grad(z, dz, branch.pack_bits(left), name, branch.SLOPES[name])
    nan = torch.isnan(z)
    assert torch.isnan(got[nan]).all() and torch.equal(got[~nan], clean[~nan])
