"""The in-place activation layers without a norm (iabn.InPlaceGELU, InPlaceSiLU, InPlaceMish):
the output plus one packed branch bit per element.

References are PyTorch's own modules (``nn.GELU()``, ``nn.GELU(approximate="tanh")``,
``nn.SiLU()``, ``nn.Mish()``) in float64, and for the low-precision bounds an exact float64
inversion of the stored output by bisection on torch's module (not iabn code), which does not
move with the CPU's vector code path as PyTorch's own low-precision error does.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from iabn import functional as IF

from helpers import exact_inverse, torch_minimum

F64 = torch.float64
#: (id, registry name, our layer, torch's module)
LAYERS = {
    "gelu": (lambda **kw: iabn.InPlaceGELU(**kw), lambda: nn.GELU()),
    "gelu_tanh": (lambda **kw: iabn.InPlaceGELU("tanh", **kw),
                  lambda: nn.GELU(approximate="tanh")),
    "silu": (lambda **kw: iabn.InPlaceSiLU(**kw), lambda: nn.SiLU()),
    "mish": (lambda **kw: iabn.InPlaceMish(**kw), lambda: nn.Mish()),
}
NAMES = tuple(LAYERS)
Y_STAR = {name: torch_minimum(name) for name in NAMES}


def _values(shape, name, seed=0, dtype=F64):
    """Values over both branches, the far left tail (to -30) and near ``y*`` (1e-9 .. 1e-2
    on either side), shuffled, and ``dz``."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    y_star = Y_STAR[name]
    near = y_star + torch.tensor([0.0, 1e-9, -1e-9, 1e-6, -1e-6, 1e-4, -1e-4, 1e-2, -1e-2],
                                 dtype=F64)
    spread = torch.cat([near, torch.linspace(-30, 10, 64, dtype=F64),
                        torch.randn(numel, generator=g, dtype=F64) * 3])[:numel]
    x = spread[torch.randperm(numel, generator=g)].view(shape)
    dz = torch.randn(shape, generator=g, dtype=F64)
    return x.to(dtype), dz.to(dtype)


def _views(kind, x):
    """``(base, view)``: the tensor the layer is given, a view of a computed ``base``."""
    if kind == "plain":
        return x, x
    if kind == "chunk":  # timm's GluMlp: fc1(x).chunk(2, -1), the second half
        return x, x.chunk(2, dim=-1)[1]
    if kind == "permuted":
        return x, x.permute(2, 0, 1)
    raise ValueError(kind)


def run_ours(name, x, dz, kind="plain", overwrite=True):
    """``(out, dx of the whole x)``: the layer on ``kind``'s view of a computed copy of ``x``."""
    leaf = x.clone().requires_grad_()
    base = leaf * 1
    _, view = _views(kind, base)
    out = LAYERS[name][0](overwrite_input=overwrite)(view)
    out.backward(_views(kind, dz)[1])
    return out.detach(), leaf.grad


def run_torch(name, x, dz, kind="plain"):
    leaf = x.clone().requires_grad_()
    _, view = _views(kind, leaf)
    out = LAYERS[name][1]()(view)
    out.backward(_views(kind, dz)[1])
    return out.detach(), leaf.grad if leaf.grad is not None else torch.zeros_like(x)


# ------------------------------------------------------------------ float64


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape,kind", [
    ((64, 12), "plain"), ((4, 9, 16), "plain"), ((2, 6, 5, 7), "plain"),
    ((8, 5, 24), "chunk"), ((6, 5, 8), "permuted"),
])
@pytest.mark.parametrize("overwrite", [True, False])
def test_float64_equals_torch(name, shape, kind, overwrite):
    """Outputs equal torch's module bit for bit (the same torch function). Input gradients,
    measured over all these cases: farther than 1e-3 from y*, 4.5e-15 of the largest
    (asserted 2e-14); within it (elements at y* and 1e-9 .. 1e-4 from it), 2.6e-9 of the
    largest |dz| (asserted 1e-8): a rounding of z* moves y by sqrt(2 eps |z*| / c) there,
    so dx = phi'(y) dz by sqrt(2 c eps |z*|) |dz| ~ 6e-9 |dz|."""
    x, dz = _values(shape, name)
    out, dx = run_ours(name, x, dz, kind, overwrite)
    ref_out, ref_dx = run_torch(name, x, dz, kind)
    assert torch.equal(out, ref_out)
    far = (x - Y_STAR[name]).abs() > 1e-3
    assert (dx - ref_dx)[far].abs().max() <= 2e-14 * ref_dx.abs().max()
    assert (dx - ref_dx)[~far].abs().max() <= 1e-8 * dz.abs().max()


@pytest.mark.parametrize("name", NAMES)
def test_overwrites_its_input_or_leaves_it(name):
    x, _ = _values((16, 8), name)
    given = x.clone()
    out = LAYERS[name][0]()(given)
    assert out is given and torch.equal(given, LAYERS[name][1]()(x))
    given = x.clone()
    out = LAYERS[name][0](overwrite_input=False)(given)
    assert torch.equal(given, x) and out.data_ptr() != given.data_ptr()


# ------------------------------------------------------------------ low precision


def _grad_from_stored_output(z, x, dz, name):
    """The input gradient an exact float64 computation gets from the stored ``z`` and the
    branch of each element: what any method keeping only these can reach."""
    y = exact_inverse(z, x.double() < Y_STAR[name], name, lowest=-60.0).requires_grad_()
    (slope,) = torch.autograd.grad(LAYERS[name][1]()(y).sum(), y)
    return slope * dz.double()


#: The largest input-gradient error over the 4 seeds below (values randn * 3 with elements at
#: and near y* and down to -30; against float64), as a multiple of that of the exact float64
#: inversion of the stored output (:func:`_grad_from_stored_output`: what any method keeping
#: only the output and the branch can reach). Both come from the same stored output, so the
#: multiple does not move with the CPU's vector code path, where PyTorch's own error does.
#: Measured under ATEN_CPU_CAPABILITY=avx512 (this AVX-512 machine's own path), avx2 and
#: default, the largest of the three; all elements / elements farther than 0.05 from y*:
#:   float32:  gelu 1.003 / 1.004, gelu_tanh 1.000 / 1.044, silu 1.000 / 1.697,
#:             mish 2.188 / 1.400 (avx512 and avx2; default 1.020 / 1.315)
#:   bfloat16: gelu 1.000 / 1.000, gelu_tanh 1.002 / 1.008, silu 1.003 / 1.002,
#:             mish 1.052 / 1.000
#:   float16:  gelu 1.000 / 1.008, gelu_tanh 1.000 / 1.002, silu 1.000 / 1.001,
#:             mish 1.000 / 1.001
#: Near y* the inverse is ill-conditioned (a rounding of z moves y by sqrt(2 dz / c)), and
#: the stored output's rounding sets both errors there; float32 Mish's 2.2x is its float32
#: inversion (at most 3.7e-7 relative, iabn.kernels.branch). Asserted: 1.5x the largest
#: measured multiple, rounded up (float32 Mish 3.3 / 2.1, SiLU far 2.6, the rest 1.6).
#: For the record, PyTorch's own float32 error moves with the path: ours over it was gelu 80
#: / 19, gelu_tanh 37 / 1.0, silu 112 / 1.1, mish 54 / 1.0 under avx512 and avx2 here,
#: gelu_tanh 66 and mish 160 under default, and gelu 644 on an AMD EPYC with AVX2 alone
#: (bounded at 120 then, which failed there); it is not asserted.
RATIO_TO_STORED = {
    torch.float32: {"gelu": (1.6, 1.6), "gelu_tanh": (1.6, 1.6), "silu": (1.6, 2.6),
                    "mish": (3.3, 2.1)},
    torch.bfloat16: {"gelu": (1.6, 1.6), "gelu_tanh": (1.6, 1.6), "silu": (1.6, 1.6),
                     "mish": (1.6, 1.6)},
    torch.float16: {"gelu": (1.6, 1.6), "gelu_tanh": (1.6, 1.6), "silu": (1.6, 1.6),
                    "mish": (1.6, 1.6)},
}
#: Farther than 0.05 from y*, the largest distance of our input gradient from the exact
#: inversion of the same stored output, in units of the dtype's eps x max |dz| (measured,
#: largest over the three paths above: float32 silu 2.97 (3.54e-7 x max |dz|), bfloat16
#: gelu_tanh 0.42, float16 gelu 0.45): an absolute bound, asserted at 1.5x (4.5, 0.65, 0.67).
FAR_FROM_STORED_EPS = {torch.float32: 4.5, torch.bfloat16: 0.65, torch.float16: 0.67}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_against_the_exact_inversion_of_the_stored_output(name, dtype):
    ratios = []
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(64, 512, generator=g) * 3).to(dtype)
        dz = torch.randn(64, 512, generator=g).to(dtype)
        out, dx = run_ours(name, x, dz)
        theirs_out, _ = run_torch(name, x, dz)
        _, ref_dx = run_torch(name, x.double(), dz.double())
        assert out.dtype == dtype and torch.equal(out, theirs_out)
        from_z = _grad_from_stored_output(out, x, dz, name)
        far = (x.double() - Y_STAR[name]).abs() > 0.05

        def err(a, mask=None, ref_dx=ref_dx):
            d = (a.double() - ref_dx).abs()
            return (d if mask is None else d[mask]).max().item()

        ratios.append((err(dx) / err(from_z), err(dx, far) / err(from_z, far)))
        distance = (dx.double() - from_z).abs()[far].max().item()
        eps = torch.finfo(dtype).eps * dz.double().abs().max().item()
        assert distance <= FAR_FROM_STORED_EPS[dtype] * eps, (seed, distance / eps)
    bound, bound_far = RATIO_TO_STORED[dtype][name]
    assert max(r[0] for r in ratios) <= bound, ratios
    assert max(r[1] for r in ratios) <= bound_far, ratios


# ------------------------------------------------------------------ what is kept


def _saved(fn):
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("numel", [1, 8, 77])
@pytest.mark.parametrize("overwrite", [True, False])
def test_saves_the_output_and_the_bits_only(name, numel, overwrite):
    x, _ = _values((numel,), name)
    base = x.clone().requires_grad_() * 1
    given = base.detach().clone()
    out, kept = _saved(lambda: LAYERS[name][0](overwrite_input=overwrite)(base))
    z, bits = kept
    assert z.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert torch.equal(z, out) and z.dtype == x.dtype
    assert bits.dtype == torch.uint8 and bits.numel() == (numel + 7) // 8
    if overwrite:
        assert out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    else:
        assert torch.equal(base, given)  # the input is untouched, and not kept
        assert all(t.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                   for t in kept)
    # torch's module keeps its input instead
    _, theirs = _saved(lambda: LAYERS[name][1]()(x.clone().requires_grad_() * 1))
    assert [t.numel() for t in theirs] == [numel]


# ------------------------------------------------------------------ in models


def test_swiglu_gate_gradients_equal_float64_reference():
    """``silu(gate) * up`` (SwiGLU): gradients of both linear layers and the input."""
    torch.manual_seed(0)
    w_gate, w_up = nn.Linear(12, 20).double(), nn.Linear(12, 20).double()
    x = torch.randn(6, 5, 12, dtype=F64) * 2

    def grads(act):
        leaf = x.clone().requires_grad_()
        out = act(w_gate(leaf)) * w_up(leaf)
        params = [*w_gate.parameters(), *w_up.parameters()]
        return [out.detach(), *torch.autograd.grad((out * out).sum(), [leaf, *params])]

    ours, ref = grads(iabn.InPlaceSiLU()), grads(nn.SiLU())
    assert torch.equal(ours[0], ref[0])
    for a, b in zip(ours[1:], ref[1:], strict=True):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_glu_mlp_chunk_gradients_equal_float64_reference(approximate):
    """timm's GluMlp: ``x, gates = fc1(x).chunk(2, -1); x * act(gates)``. Autograd refuses
    to let a chunk be overwritten (and, were it written through another view, to read the
    other half afterwards), so the layer computes such a view as with
    ``overwrite_input=False``: the gates are left as they are."""
    torch.manual_seed(1)
    fc1, fc2 = nn.Linear(10, 32).double(), nn.Linear(16, 10).double()
    x = torch.randn(4, 7, 10, dtype=F64) * 2

    def grads(act):
        leaf = x.clone().requires_grad_()
        h = fc1(leaf)
        value, gates = h.chunk(2, dim=-1)
        before = gates.detach().clone()
        out = fc2(value * act(gates))
        assert torch.equal(gates, before)
        params = [*fc1.parameters(), *fc2.parameters()]
        return [out.detach(), *torch.autograd.grad((out * out).sum(), [leaf, *params])]

    ours = grads(iabn.InPlaceGELU(approximate))
    ref = grads(nn.GELU(approximate=approximate))
    assert torch.equal(ours[0], ref[0])
    for a, b in zip(ours[1:], ref[1:], strict=True):
        assert (a - b).abs().max() <= 1e-12 * b.abs().max()


# ------------------------------------------------------------------ functional, half, misc


@pytest.mark.parametrize("call,module", [
    (lambda x, **kw: IF.inplace_gelu(x, **kw), nn.GELU()),
    (lambda x, **kw: IF.inplace_gelu(x, "tanh", **kw), nn.GELU(approximate="tanh")),
    (lambda x, **kw: IF.inplace_silu(x, **kw), nn.SiLU()),
    (lambda x, **kw: IF.inplace_mish(x, **kw), nn.Mish()),
])
def test_functional_forms(call, module):
    x = torch.randn(5, 7, dtype=F64) * 3
    leaf = x.clone().requires_grad_()
    given = leaf * 1
    out = call(given)
    assert out is given and torch.equal(out, module(x))
    out.sum().backward()
    ref = x.clone().requires_grad_()
    module(ref).sum().backward()
    assert (leaf.grad - ref.grad).abs().max() <= 1e-12
    kept = x.clone()
    assert torch.equal(call(kept, overwrite_input=False), module(x)) and torch.equal(kept, x)


@pytest.mark.parametrize("name", NAMES)
def test_no_grad_and_empty_inputs(name):
    x, _ = _values((9, 4), name)
    given = x.clone()
    with torch.no_grad():
        assert LAYERS[name][0]()(given) is given
    assert torch.equal(given, LAYERS[name][1]()(x))
    empty = torch.empty(0, 3).requires_grad_() * 1
    out = LAYERS[name][0]()(empty)
    out.sum().backward()
    assert out.shape == (0, 3)


def test_double_backward_is_refused():
    x = torch.randn(4, dtype=F64).requires_grad_()
    out = iabn.InPlaceSiLU()(x * 1)
    with pytest.raises(RuntimeError, match=r"double backward.*nn.SiLU"):
        torch.autograd.grad(out.sum(), x, create_graph=True)


def test_forward_mode_ad_composes():
    import torch.autograd.forward_ad as fwAD

    x, t = torch.randn(6, dtype=F64), torch.randn(6, dtype=F64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.clone(), t.clone())  # copy_ writes the tangent too
        out = iabn.InPlaceMish()(dual)
        tangent = fwAD.unpack_dual(out).tangent
    _, expected = torch.func.jvp(F.mish, (x,), (t,))
    torch.testing.assert_close(tangent, expected, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("name", NAMES)
def test_refuses_a_leaf_that_requires_grad(name):
    leaf = torch.randn(3, 4).requires_grad_()
    before = leaf.detach().clone()
    with pytest.raises(RuntimeError,
                       match=r"leaf tensor that requires grad.*overwrite_input=False"):
        LAYERS[name][0]()(leaf)
    with pytest.raises(RuntimeError, match="view of a leaf tensor"):
        LAYERS[name][0]()(leaf[1:])
    assert torch.equal(leaf.detach(), before)
    out = LAYERS[name][0](overwrite_input=False)(leaf)  # the output-only mode takes it
    out.sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.detach(), before)


def test_argument_errors_name_the_argument_and_the_fix():
    with pytest.raises(TypeError, match=r"input has dtype torch.int64.*input\.float\(\)"):
        iabn.InPlaceSiLU()(torch.arange(4))
    with pytest.raises(TypeError, match="overwrite_input='yes': must be True"):
        iabn.InPlaceGELU(overwrite_input="yes")
    with pytest.raises(TypeError, match="overwrite_input=1: must be True"):
        IF.inplace_mish(torch.randn(3), overwrite_input=1)
    layer = iabn.InPlaceMish()
    with pytest.raises(TypeError, match="overwrite_input=None"):
        layer.overwrite_input = None
    with pytest.raises(ValueError, match=r"approximate='erf': must be 'none'.*or 'tanh'"):
        iabn.InPlaceGELU("erf")
    with pytest.raises(ValueError, match="approximate='fast'"):
        IF.inplace_gelu(torch.randn(3), "fast")
    layer = iabn.InPlaceGELU()
    layer.approximate = "bad"  # nn.GELU's attribute, checked on every call
    x = torch.randn(3)
    before = x.clone()
    with pytest.raises(ValueError, match="approximate='bad'"):
        layer(x)
    expanded = torch.randn(1, 3).expand(4, 3)
    with pytest.raises(ValueError, match=r"share memory.*overwrite_input=False"):
        iabn.InPlaceSiLU()(expanded)
    assert torch.equal(x, before)


def test_repr_and_attributes():
    assert repr(iabn.InPlaceGELU("tanh", overwrite_input=False)) == (
        "InPlaceGELU(approximate='tanh', overwrite_input=False)")
    assert repr(iabn.InPlaceSiLU()) == "InPlaceSiLU()"
    silu = iabn.InPlaceSiLU()
    assert isinstance(silu, nn.SiLU) and silu.inplace is False and silu.overwrite_input
    assert isinstance(iabn.InPlaceMish(), nn.Mish) and isinstance(iabn.InPlaceGELU(), nn.GELU)


def test_debug_mode_poisons_the_overwritten_input():
    """As the other in-place layers: the layer runs on a copy, the input is filled with NaN and
    a later read of it raises, naming the layer; outputs and gradients are unchanged."""
    source = torch.randn(4, 5, dtype=F64)
    leaf = source.clone().requires_grad_()
    x = leaf * 1
    with iabn.debug.poison_overwritten():
        out = iabn.InPlaceSiLU()(x)
        with pytest.raises(iabn.debug.OverwrittenTensorError, match="InPlaceSiLU"):
            x + 1
    assert torch.isnan(x).all() and torch.equal(out, F.silu(source))
    out.sum().backward()
    ref = source.clone().requires_grad_()
    F.silu(ref).sum().backward()
    assert (leaf.grad - ref.grad).abs().max() <= 1e-12


# ------------------------------------------------------------------ torch.compile


# every activation overwriting; the output-only mode, the same Function without the dirty mark,
# for silu by default and the others in the slow run (4 s a case on the loaded 2 cores)
@pytest.mark.parametrize(("name", "overwrite"), [
    *[(n, True) for n in NAMES],
    *[(n, False) if n == "silu" else pytest.param(n, False, marks=pytest.mark.slow)
      for n in NAMES]], ids=lambda v: str(v))
def test_compiled_aot_eager_equals_eager(name, overwrite):
    torch._dynamo.reset()
    lin = nn.Linear(8, 16).double()
    act = LAYERS[name][0](overwrite_input=overwrite)
    model = nn.Sequential(lin, act, nn.Linear(16, 3).double())
    x, _ = _values((10, 8), name)

    def step(m):
        leaf = x.clone().requires_grad_()
        out = m(leaf)
        grads = torch.autograd.grad((out * out).sum(), [leaf, *model.parameters()])
        return [out.detach(), *grads]

    eager = step(model)
    compiled = step(torch.compile(model, backend="aot_eager", fullgraph=True))
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
def test_compiled_inductor_equals_eager():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(8, 16), iabn.InPlaceGELU("tanh"), nn.Linear(16, 3)).double()
    x, _ = _values((10, 8), "gelu_tanh")
    results = []
    for m in (model, torch.compile(model, backend="inductor")):
        leaf = x.clone().requires_grad_()
        out = m(leaf)
        results.append([out.detach(), *torch.autograd.grad((out * out).sum(),
                                                           [leaf, *model.parameters()])])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


# ------------------------------------------------------------------ the gelu_tanh record


@pytest.mark.parametrize("training", [True, False])
def test_inplace_abn_takes_gelu_tanh(training):
    """InPlaceABN(activation="gelu_tanh") equals nn.BatchNorm2d + nn.GELU(approximate="tanh")
    (float64; measured: outputs 2e-16, gradients 1e-15 of their largest)."""
    torch.manual_seed(3)
    bn = nn.BatchNorm2d(5).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-2, 1)
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2)
    layer = iabn.InPlaceABN(5, activation="gelu_tanh").double()
    layer.load_state_dict(bn.state_dict())
    bn.train(training)
    layer.train(training)
    x = torch.randn(4, 5, 6, 7, dtype=F64) * 2

    def step(m, params, clone):
        leaf = x.clone().requires_grad_()
        out = m(leaf.clone() if clone else leaf)
        return [out.detach(), *torch.autograd.grad((out * out).sum(), [leaf, *params])]

    ours = step(layer, [layer.weight, layer.bias], True)
    ref = step(nn.Sequential(bn, nn.GELU(approximate="tanh")), [bn.weight, bn.bias], False)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=1e-14)
    for a, b in zip(ours[1:], ref[1:], strict=True):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max()


def _graph_names(tensor):
    """The names of the autograd nodes ``tensor``'s graph reaches."""
    names, seen, stack = [], set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_a_view_of_its_whole_base_is_overwritten_through_the_base(name, dtype):
    """A linear layer's 3-d output is a view of its 2-d product: the layer overwrites that
    base in the view's place, so autograd records no ``CopySlices`` (whose backward copies
    the gradient into a tensor of the base's size and back), and the gradients are those of
    the same layer on a tensor that is no view, bit for bit (float64 and float32); a view of
    part of a base (a slice) still takes ``CopySlices``, with the same gradients too."""
    x, dz = _values((3, 5, 8), name, dtype=dtype)
    lin = nn.Linear(8, 16).to(dtype)
    layer = LAYERS[name][0]()
    dz = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1), dtype=dtype)

    def grads(view_of_whole: bool):
        leaf = x.clone().requires_grad_()
        pre = lin(leaf)
        if not view_of_whole:
            pre = pre.clone()  # no view
        assert pre._is_view() == view_of_whole
        out = layer(pre)
        assert out.shape == (3, 5, 16) and out.data_ptr() == pre.data_ptr()
        names = _graph_names(out)
        out.backward(dz)
        return names, [leaf.grad, lin.weight.grad.clone(), lin.bias.grad.clone()]

    lin.zero_grad()
    names, through_base = grads(True)
    assert "CopySlices" not in names and "InPlaceActivationFunctionBackward" in names
    lin.zero_grad()
    _, plain = grads(False)
    for a, b in zip(through_base, plain, strict=True):
        assert torch.equal(a, b)
    # a slice of a base: CopySlices, the same gradient as on a copy (the layer's own; the
    # linear layer's sums its rows in another order on the base's layout)
    part = lin(x.clone().requires_grad_())[:, 1:]
    out = layer(part)
    assert "CopySlices" in _graph_names(out)
    (through_slices,) = torch.autograd.grad(out, part, dz[:, 1:])
    copy = lin(x.clone().requires_grad_())[:, 1:].clone()
    (on_copy,) = torch.autograd.grad(LAYERS[name][0]()(copy), copy, dz[:, 1:])
    assert torch.equal(through_slices, on_copy)


@pytest.mark.parametrize("grad_kind", ["sum", "broadcast row", "transposed"])
def test_whole_base_takes_any_layout_of_the_gradient(grad_kind):
    """The gradient reaching a layer that overwrote a view's base comes in the base's shape,
    in whatever layout autograd hands it (expanded by ``sum``, broadcast, transposed): the
    input gradient is that of the layer on a tensor that is no view, bit for bit."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 8, generator=g, dtype=F64)
    lin = nn.Linear(8, 16).double()
    grads = {"sum": None,
             "broadcast row": torch.randn(3, 1, 16, generator=g, dtype=F64).expand(3, 5, 16),
             "transposed": torch.randn(16, 5, 3, generator=g, dtype=F64).permute(2, 1, 0)}
    results = []
    for as_view in (True, False):
        leaf = x.clone().requires_grad_()
        pre = lin(leaf) if as_view else lin(leaf).clone()
        out = iabn.InPlaceSiLU()(pre)
        if grads[grad_kind] is None:
            out.sum().backward()
        else:
            out.backward(grads[grad_kind])
        results.append(leaf.grad)
    assert torch.equal(*results)
