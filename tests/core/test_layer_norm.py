"""iabn.InPlaceLayerNorm, iabn.InPlaceRMSNorm and iabn.InPlaceLayerNorm2d against PyTorch's own
nn.LayerNorm and nn.RMSNorm and timm's LayerNorm2d (the independent references): float64
outputs and gradients in both modes and several shapes and strides; weights at or near zero;
float32 and bfloat16 errors counted against PyTorch's own; the bytes kept for backward; the
in-place contract; state_dict; bad arguments; torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import iabn
import iabn.kernels.row_norm as layer_norm
from iabn.kernels import common as kernels_parts
from iabn.memory import saved_tensor_bytes

#: float64: every output and gradient's largest error relative to the largest reference value
#: was at most 3.4e-16 on this file's data (CPU, torch 2.14.1); the bound is ~300x that.
TOL64 = 1e-13


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.abs().max()) if want.numel() else 1.0
    return float((got.double() - want.double()).abs().max()) / max(scale, 1e-300) \
        if want.numel() else 0.0


def randomise_(norm: nn.Module, weight=(0.5, 1.5), bias_std=1.0) -> nn.Module:
    """Weights of both signs, uniform in magnitude; a normal bias."""
    with torch.no_grad():
        if getattr(norm, "weight", None) is not None:
            w = torch.empty(norm.weight.shape).uniform_(*weight)
            sign = torch.where(torch.rand(norm.weight.shape) < 0.3, -1.0, 1.0)
            norm.weight.copy_(w * sign)
        if getattr(norm, "bias", None) is not None:
            norm.bias.normal_(0.0, bias_std)
    return norm


def like(ref: nn.Module, overwrite_input: bool) -> nn.Module:
    """The iabn layer of ``ref``'s class and configuration, with its state."""
    dtype = next(iter(ref.parameters()), torch.empty(0, dtype=torch.float64)).dtype
    if isinstance(ref, nn.RMSNorm):
        layer = iabn.InPlaceRMSNorm(ref.normalized_shape, ref.eps, ref.elementwise_affine,
                                    dtype=dtype, overwrite_input=overwrite_input)
    elif type(ref).__name__ == "LayerNorm2d":
        layer = iabn.InPlaceLayerNorm2d(ref.normalized_shape[0], ref.eps, ref.elementwise_affine,
                                        overwrite_input=overwrite_input).to(dtype)
    else:
        layer = iabn.InPlaceLayerNorm(ref.normalized_shape, ref.eps, ref.elementwise_affine,
                                      ref.bias is not None, dtype=dtype,
                                      overwrite_input=overwrite_input)
    layer.load_state_dict(ref.state_dict())
    return layer


def step(model, x, g, dtype, prepare=lambda h: h):
    """Output and gradients (input, then parameters) of ``sum(model(prepare(h)) * g)``, ``h``
    a computed copy of ``x`` in ``dtype`` (the layer may overwrite it)."""
    leaf = x.to(dtype).detach().requires_grad_()
    out = model(prepare(leaf * 1))
    grads = torch.autograd.grad((out.float() * g.float()).sum() if dtype != torch.float64
                                else (out * g).sum(), [leaf, *model.parameters()])
    return [out.detach().double(), *(t.double() for t in grads)]


def channels_last_view(h):
    return h.permute(0, 2, 3, 1)


def nhwc(h):
    return h.contiguous(memory_format=torch.channels_last)


def timm_layer_norm_2d(c, **kwargs):
    timm_layers = pytest.importorskip("timm.layers")
    return timm_layers.LayerNorm2d(c, **kwargs)


# (name, reference module factory, input shape, prepare)
CASES = [
    ("ln-N-D", lambda: nn.LayerNorm(24), (6, 24), None),
    ("ln-B-T-D", lambda: nn.LayerNorm(16), (3, 5, 16), None),
    ("ln-2dims", lambda: nn.LayerNorm((4, 6)), (3, 2, 4, 6), None),
    ("ln-permuted-NHWC", lambda: nn.LayerNorm(8), (2, 8, 5, 3), channels_last_view),
    ("ln-no-affine", lambda: nn.LayerNorm(12, elementwise_affine=False), (4, 3, 12), None),
    ("ln-bias-False", lambda: nn.LayerNorm(12, bias=False), (4, 3, 12), None),
    ("rms-N-D", lambda: nn.RMSNorm(24), (6, 24), None),
    ("rms-B-T-D-eps", lambda: nn.RMSNorm(16, eps=1e-6), (3, 5, 16), None),
    ("rms-2dims", lambda: nn.RMSNorm((4, 6)), (3, 2, 4, 6), None),
    ("rms-permuted-NHWC", lambda: nn.RMSNorm(8), (2, 8, 5, 3), channels_last_view),
    ("rms-no-affine", lambda: nn.RMSNorm(12, elementwise_affine=False), (4, 3, 12), None),
    ("ln2d-NCHW", lambda: timm_layer_norm_2d(8), (2, 8, 5, 3), None),
    ("ln2d-channels_last", lambda: timm_layer_norm_2d(8), (2, 8, 5, 3), nhwc),
    ("ln2d-no-affine", lambda: timm_layer_norm_2d(6, affine=False), (2, 6, 4, 4), None),
]
IDS = [c[0] for c in CASES]


def make(case, dtype=torch.float64, seed=0):
    _, factory, shape, prepare = case
    torch.manual_seed(seed)
    ref = randomise_(factory()).to(dtype)
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    if prepare is not None:
        g = torch.randn(prepare(x).shape, dtype=torch.float64)
    else:
        g = torch.randn(shape, dtype=torch.float64)
    return ref, x, g, prepare or (lambda h: h)


@pytest.mark.parametrize("overwrite_input", [True, False], ids=["overwrite", "output_only"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_pytorch_float64(case, overwrite_input):
    ref, x, g, prepare = make(case)
    layer = like(ref, overwrite_input)
    exact = step(ref, x, g, torch.float64, prepare)
    got = step(layer, x, g, torch.float64, prepare)
    assert len(got) == len(exact) == 2 + len(list(ref.parameters()))
    # the forward is PyTorch's own kernel: bit for bit
    assert torch.equal(got[0], exact[0])
    for a, b in zip(got, exact, strict=True):
        assert rel_err(a, b) <= TOL64


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6], CASES[12]],
                         ids=[IDS[0], IDS[3], IDS[6], IDS[12]])
def test_memory_layout_and_strides_of_the_output(case):
    """Overwrite mode writes into the input (any strides) and returns it; output-only mode
    returns a tensor with the reference's shape and strides."""
    ref, x, _, prepare = make(case)
    want = ref(prepare(x))
    h = prepare(x * 1)
    out = like(ref, True)(h)
    assert out is h and torch.equal(out, want)
    h = prepare(x * 1)
    before = h.clone()
    out = like(ref, False)(h)
    assert torch.equal(h, before) and torch.equal(out, want)
    assert out.stride() == want.stride()


# ------------------------------------------------------------ weights at or near zero

def _zero_cases():
    d = 16

    def some_zero(norm):
        with torch.no_grad():
            norm.weight[[1, 5, 6]] = 0.0
        return norm

    def all_zero(norm):
        with torch.no_grad():
            norm.weight.zero_()
        return norm

    def tiny(norm):
        with torch.no_grad():
            norm.weight[[0, 3]] = 1e-30
            norm.weight[7] = -1e-300
        return norm

    def small_with_bias(norm):
        with torch.no_grad():
            norm.weight.uniform_(1e-3, 2e-3)
            norm.weight[::2] = 1.0
            if getattr(norm, "bias", None) is not None:
                norm.bias.normal_(1.0, 0.2)
        return norm

    return d, {"some_zero": some_zero, "all_zero": all_zero, "tiny": tiny,
               "small_weight_bias_1": small_with_bias}


D_ZERO, ZERO_EDITS = _zero_cases()
ZERO_REFS = {
    "ln": lambda: nn.LayerNorm(D_ZERO),
    "ln-bias-False": lambda: nn.LayerNorm(D_ZERO, bias=False),
    "rms": lambda: nn.RMSNorm(D_ZERO),
}


@pytest.mark.parametrize("overwrite_input", [True, False], ids=["overwrite", "output_only"])
@pytest.mark.parametrize("edit", list(ZERO_EDITS))
@pytest.mark.parametrize("kind", list(ZERO_REFS))
def test_zero_and_tiny_weights_float64(kind, edit, overwrite_input):
    """Outputs equal PyTorch's bit for bit, gradients within TOL64, whatever the weights."""
    torch.manual_seed(1)
    ref = ZERO_EDITS[edit](randomise_(ZERO_REFS[kind]())).double()
    layer = like(ref, overwrite_input)
    x = torch.randn(5, 3, D_ZERO, dtype=torch.float64) * 2 - 1
    g = torch.randn(5, 3, D_ZERO, dtype=torch.float64)
    exact = step(ref, x, g, torch.float64)
    got = step(layer, x, g, torch.float64)
    assert torch.equal(got[0], exact[0])
    for a, b in zip(got, exact, strict=True):
        assert torch.isfinite(a).all()
        assert rel_err(a, b) <= TOL64, (rel_err(a, b))


def test_the_rule_is_what_keeps_zero_weights_exact(monkeypatch):
    """Without the kept columns (every feature rebuilt from the output), a zero weight gives
    non-finite gradients: the test above depends on the rule."""
    monkeypatch.setattr(layer_norm, "kept_index", lambda *args: None)
    ref = ZERO_EDITS["some_zero"](randomise_(nn.LayerNorm(D_ZERO))).double()
    got = step(like(ref, True), torch.randn(4, D_ZERO).double(), torch.randn(4, D_ZERO).double(),
               torch.float64)
    assert not torch.isfinite(got[1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("edit", list(ZERO_EDITS))
def test_zero_and_tiny_weights_low_precision(edit, dtype):
    """In float32 (1e-30 is a normal float32; -1e-300 rounds to -0) and bfloat16: the output
    equals nn.LayerNorm's bit for bit and the errors from float64 stay within BOUND times
    PyTorch's own."""
    torch.manual_seed(2)
    ref = ZERO_EDITS[edit](randomise_(nn.LayerNorm(D_ZERO))).double()
    layer = like(ref, True)
    x = torch.randn(8, 4, D_ZERO, dtype=torch.float64) * 2 - 1
    g = torch.randn(8, 4, D_ZERO, dtype=torch.float32)
    low_ref = copy.deepcopy(ref).to(dtype)
    exact = step(low_ref.double(), x.to(dtype).double(), g.double(), torch.float64)
    theirs = step(copy.deepcopy(ref).to(dtype), x, g, dtype)
    ours = step(copy.deepcopy(layer).to(dtype), x, g, dtype)
    assert torch.equal(ours[0], theirs[0])
    _assert_within(ours, theirs, exact, dtype, BOUND[dtype])


def test_kept_columns_follow_the_rule():
    """Which features are kept: |w| below finfo(stored dtype).tiny, or |b| >= K |w|."""
    k = layer_norm.BIAS_RATIO
    w = torch.tensor([1.0, 0.0, 1e-30, 1e-3, 1e-3, -2.0, 1e-39])
    b = torch.tensor([0.0, 0.0, 0.0, 0.99 * k * 1e-3, 1.01 * k * 1e-3, -2.0 * k, 0.0])
    assert layer_norm.kept_index(w, b, torch.float32).tolist() == [1, 4, 5, 6]
    assert layer_norm.kept_index(w, None, torch.float32).tolist() == [1, 6]
    # float16's tiny is 6.1e-5: the 1e-3 weights are rebuilt there, 1e-30 is not
    assert layer_norm.kept_index(w, None, torch.float16).tolist() == [1, 2, 6]
    assert layer_norm.kept_index(torch.ones(3), torch.zeros(3), torch.float32) is None
    assert layer_norm.kept_index(None, torch.ones(3), torch.float32) is None


# ------------------------------------------------------------ float32 and bfloat16

#: The largest ratio of the iabn layer's error from float64 to PyTorch's module's (each of
#: output, input, weight and bias gradients; or dtype's epsilon times the values' size where
#: PyTorch happens to be exact), measured on CPU (torch 2.14.1) on this file's data:
#: float32 1.29 (an input gradient of CASES; 1.04 with zero and tiny weights, 1.23 with every
#: bias just under K times its weight), bfloat16 1.00 (0.68 over CASES; 1.00 with tiny
#: weights), a bfloat16 input with float32 parameters 0.68, and RMS norm's eps=None on tiny
#: bfloat16 inputs 1.00. Outputs are equal bit for bit in all of them.
BOUND = {torch.float32: 2.0, torch.bfloat16: 1.5}
MIXED_BOUND = 1.5


def _assert_within(ours, theirs, exact, dtype, bound):
    eps = torch.finfo(dtype).eps
    names = ("output", "input grad", "weight grad", "bias grad")
    for name, mine, pytorch, e in zip(names, ours, theirs, exact, strict=False):
        floor = eps * float(e.abs().max())
        mine_err = float((mine - e).abs().max())
        theirs_err = float((pytorch - e).abs().max())
        assert mine_err <= bound * max(theirs_err, floor), (name, mine_err, theirs_err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_low_precision_error_within_a_multiple_of_pytorch(case, dtype):
    """Everything in ``dtype`` (parameters too); the float64 reference runs on the same
    rounded input and parameters."""
    ref, x, g, prepare = make(case, seed=3)
    layer = like(ref, True)
    low_ref = copy.deepcopy(ref).to(dtype)
    exact = step(copy.deepcopy(low_ref).double(), x.to(dtype).double(), g.float().double(),
                 torch.float64, prepare)
    theirs = step(low_ref, x, g, dtype, prepare)
    ours = step(copy.deepcopy(layer).to(dtype), x, g, dtype, prepare)
    assert torch.equal(ours[0], theirs[0])
    _assert_within(ours, theirs, exact, dtype, BOUND[dtype])


def test_bias_at_k_times_the_weight_float32():
    """The worst rebuilt feature: |b| just under K |w| for every feature (all rebuilt)."""
    torch.manual_seed(4)
    ref = randomise_(nn.LayerNorm(64)).double()
    with torch.no_grad():
        ref.bias.copy_(ref.weight.abs() * layer_norm.BIAS_RATIO * 0.999
                       * torch.where(torch.rand(64) < 0.5, -1.0, 1.0))
    assert layer_norm.kept_index(ref.weight.float(), ref.bias.float(), torch.float32) is None
    x = torch.randn(32, 64, dtype=torch.float64) * 3 + 1
    g = torch.randn(32, 64)
    low = copy.deepcopy(ref).float()
    exact = step(copy.deepcopy(low).double(), x.float().double(), g.double(), torch.float64)
    _assert_within(step(like(ref, True).float(), x, g, torch.float32),
                   step(low, x, g, torch.float32), exact, torch.float32, BOUND[torch.float32])


@pytest.mark.parametrize("case", [CASES[1], CASES[7], CASES[11]],
                         ids=[IDS[1], IDS[7], IDS[11]])
def test_bfloat16_input_with_float32_parameters(case):
    """A bfloat16 input into a float32 layer (what autocast and FSDP give): outputs equal
    PyTorch's, errors within MIXED_BOUND times PyTorch's; gradients in the parameters' and
    the input's dtypes."""
    ref, x, g, prepare = make(case, seed=5)
    ref32 = copy.deepcopy(ref).float()
    layer32 = like(ref32, True)
    xb = x.to(torch.bfloat16)
    exact = step(copy.deepcopy(ref32).double(), xb.double(), g.float().double(), torch.float64,
                 prepare)
    theirs = step(ref32, xb, g, torch.bfloat16, prepare)
    ours = step(layer32, xb, g, torch.bfloat16, prepare)
    assert torch.equal(ours[0], theirs[0])
    _assert_within(ours, theirs, exact, torch.bfloat16, MIXED_BOUND)
    h = xb.clone().requires_grad_()
    layer32(prepare(h * 1)).float().sum().backward()
    assert layer32.weight.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_half_backward_in_parts_equals_whole(kind, monkeypatch):
    """bfloat16 backward on parts of the rows (forced at this size) gives the input gradient
    of the whole computation bit for bit and the parameter gradients within float32
    rounding of their sums."""
    torch.manual_seed(6)
    ref = randomise_(ZERO_REFS[kind]())
    with torch.no_grad():
        ref.weight[2] = 0.0
    x = torch.randn(40, D_ZERO)
    g = torch.randn(40, D_ZERO)
    whole = step(like(ref, True).bfloat16(), x, g, torch.bfloat16)
    monkeypatch.setattr(kernels_parts, "MIN_PIECE", 1)
    assert kernels_parts.part_count(40 * D_ZERO) == kernels_parts.PIECES
    parts = step(like(ref, True).bfloat16(), x, g, torch.bfloat16)
    assert torch.equal(parts[0], whole[0]) and torch.equal(parts[1], whole[1])
    for a, b in zip(parts[2:], whole[2:], strict=True):
        torch.testing.assert_close(a, b, rtol=0.01, atol=0.01)


def test_rms_eps_none_on_tiny_bfloat16_inputs():
    """eps=None is float32's epsilon for bfloat16 inputs, as torch.rms_norm takes it: on rows
    whose mean square is of that order, the gradients follow nn.RMSNorm's."""
    torch.manual_seed(7)
    ref = randomise_(nn.RMSNorm(16))
    x = torch.randn(8, 16).double() * 3e-4
    g = torch.randn(8, 16)
    exact = step(copy.deepcopy(ref).double(), x.to(torch.bfloat16).double(), g.double(),
                 torch.float64)
    _assert_within(step(like(ref, True), x, g, torch.bfloat16),
                   step(ref, x, g, torch.bfloat16), exact, torch.bfloat16, MIXED_BOUND)


# ------------------------------------------------------------ saved tensors

def _saved(fn, x):
    """The tensors autograd keeps while ``fn(x)`` runs."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    return out, kept


@pytest.mark.parametrize("overwrite_input", [True, False], ids=["overwrite", "output_only"])
@pytest.mark.parametrize("kind", ["ln", "rms", "ln2d"])
def test_keeps_its_output_and_statistics_not_its_input(kind, overwrite_input):
    n, t, d = 4, 8, 32
    if kind == "ln2d":
        layer = iabn.InPlaceLayerNorm2d(d, overwrite_input=overwrite_input)
        x = torch.randn(n, d, t, 1, requires_grad=True)
    else:
        cls = iabn.InPlaceLayerNorm if kind == "ln" else iabn.InPlaceRMSNorm
        layer = cls(d, overwrite_input=overwrite_input)
        x = torch.randn(n, t, d, requires_grad=True)
    params = list(layer.parameters())
    h = x * 1
    before = h.detach().clone()
    out, kept = _saved(layer, h)
    storages = {s.untyped_storage().data_ptr() for s in kept}
    assert out.untyped_storage().data_ptr() in storages
    if overwrite_input:
        assert out is h
    else:
        assert h.untyped_storage().data_ptr() not in storages
        assert torch.equal(h, before)
    activation, rows = n * t * d * 4, n * t
    assert saved_tensor_bytes(lambda a: layer(a * 1), x, exclude=params) == activation + rows * 4

    # a few zero weights: their xhat columns (float32) and the int64 index are kept too
    with torch.no_grad():
        layer.weight[[3, 17]] = 0.0
    assert saved_tensor_bytes(lambda a: layer(a * 1), x, exclude=params) == (
        activation + rows * 4 + rows * 2 * 4 + 2 * 8)


def test_pre_norm_block_keeps_one_activation_fewer():
    """norm -> Linear on a residual stream: nn.LayerNorm keeps its input and the Linear the
    norm's output; the output-only layer keeps that output alone (the Linear's)."""
    n, d = 64, 48
    x = torch.randn(n, d, requires_grad=True)
    ref = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d))
    ours = nn.Sequential(iabn.InPlaceLayerNorm(d, overwrite_input=False), nn.Linear(d, d))
    ours.load_state_dict(ref.state_dict())

    def block(model):
        return lambda a: a + model(a)

    a = n * d * 4
    assert saved_tensor_bytes(block(ref), x * 1, exclude=list(ref.parameters())) == 2 * a + 8 * n
    assert saved_tensor_bytes(block(ours), x * 1, exclude=list(ours.parameters())) == a + 4 * n
    torch.testing.assert_close(block(ours)(x), block(ref)(x), rtol=0, atol=0)


# ------------------------------------------------------------ in-place contract, state

def test_in_place_contract():
    layer = iabn.InPlaceLayerNorm(6)
    x = torch.randn(3, 6, requires_grad=True)
    h = x * 2
    version = h._version
    out = layer(h)
    assert out is h and h._version > version
    assert torch.equal(out, nn.functional.layer_norm(x.detach() * 2, (6,)))
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        layer(x)
    with pytest.raises(RuntimeError, match="view of a leaf tensor"):
        layer(x[1:])
    # output-only: a leaf is fine and left as it was
    layer.overwrite_input = False
    before = x.detach().clone()
    out = layer(x)
    out.sum().backward()
    assert torch.equal(x.detach(), before) and x.grad is not None

    h = x * 2
    kept = h.sin()  # sin saved h for its backward
    layer.overwrite_input = True
    out = layer(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + kept.sum()).backward()
    with pytest.raises(RuntimeError, match="do not support double backward"):
        torch.autograd.grad(layer(x * 2).pow(2).sum(), x, create_graph=True)
    with torch.no_grad():
        h = x.detach() * 2
        out = layer(h)
    assert out is h and out.grad_fn is None
    with torch.inference_mode():
        made = torch.randn(3, 6)
    with pytest.raises(ValueError, match="inference tensor"):
        layer(made)


def test_debug_mode_finds_a_read_of_the_overwritten_input():
    for layer, name in ((iabn.InPlaceLayerNorm(4), "InPlaceLayerNorm"),
                        (iabn.InPlaceRMSNorm(4), "InPlaceRMSNorm"),
                        (iabn.InPlaceLayerNorm2d(4), "InPlaceLayerNorm2d")):
        x = torch.randn(2, 4, 4, requires_grad=True)
        with iabn.debug.poison_overwritten():
            h = x * 2
            out = layer(h)
            assert out is not h
            with pytest.raises(iabn.debug.OverwrittenTensorError, match=name):
                out + h
            out.sum().backward()
        assert torch.isfinite(x.grad).all()
    with iabn.debug.poison_overwritten():  # the output-only mode is not intercepted
        h = torch.randn(2, 4)
        out = iabn.InPlaceLayerNorm(4, overwrite_input=False)(h)
        assert torch.isfinite(h + out).all()


def test_state_dict_and_assigned_parameters():
    timm_layers = pytest.importorskip("timm.layers")
    pairs = [(nn.LayerNorm(8), iabn.InPlaceLayerNorm(8)),
             (nn.LayerNorm((2, 4), bias=False), iabn.InPlaceLayerNorm((2, 4), bias=False)),
             (nn.LayerNorm(8, elementwise_affine=False),
              iabn.InPlaceLayerNorm(8, elementwise_affine=False)),
             (nn.RMSNorm(8), iabn.InPlaceRMSNorm(8)),
             (timm_layers.LayerNorm2d(8), iabn.InPlaceLayerNorm2d(8))]
    for theirs, ours in pairs:
        assert isinstance(ours, type(theirs).__mro__[1] if type(theirs).__name__ ==
                          "LayerNorm2d" else type(theirs))
        assert list(ours.state_dict()) == list(theirs.state_dict())
        randomise_(theirs)
        ours.load_state_dict(theirs.state_dict())
        back = copy.deepcopy(theirs)
        randomise_(ours)
        back.load_state_dict(ours.state_dict())
        for key, value in ours.state_dict().items():
            assert torch.equal(back.state_dict()[key], value)
    layer = iabn.InPlaceLayerNorm(4)
    with torch.no_grad():
        layer.weight.mul_(3)
    layer.reset_parameters()
    assert torch.equal(layer.weight, torch.ones(4)) and torch.equal(layer.bias, torch.zeros(4))
    assert repr(iabn.InPlaceLayerNorm(4, overwrite_input=False)) == (
        "InPlaceLayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True, "
        "overwrite_input=False)")

    # the converter's way: same configuration, the original Parameter objects assigned
    torch.manual_seed(8)
    for old, new in ((randomise_(nn.LayerNorm(6)), iabn.InPlaceLayerNorm(6)),
                     (randomise_(nn.RMSNorm(6)), iabn.InPlaceRMSNorm(6))):
        new.weight = old.weight
        if getattr(old, "bias", None) is not None:
            new.bias = old.bias
        x = torch.randn(5, 6)
        want = old(x)
        want.sum().backward()
        grads = [p.grad.clone() for p in old.parameters()]
        old.zero_grad()
        out = new(x.clone())
        out.sum().backward()
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        for p, want_grad in zip(old.parameters(), grads, strict=True):
            torch.testing.assert_close(p.grad, want_grad)


def test_functional_forms():
    torch.manual_seed(9)
    x = torch.randn(3, 4, 10, dtype=torch.float64)
    w, b = torch.randn(10, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    want = nn.functional.layer_norm(x, (10,), w, b, 1e-6)
    h = x.clone()
    assert iabn.functional.inplace_layer_norm(h, 10, w, b, 1e-6) is h
    assert torch.equal(h, want)
    h = x.clone()
    out = iabn.functional.inplace_layer_norm(h, (10,), w, b, 1e-6, overwrite_input=False)
    assert torch.equal(out, want) and torch.equal(h, x)
    want = nn.functional.rms_norm(x, (4, 10), None, 1e-5)
    h = x.clone()
    assert torch.equal(iabn.functional.inplace_rms_norm(h, [4, 10], None, 1e-5), want)
    assert torch.equal(h, want)


def test_forward_ad_and_torch_func_compose():
    """Under torch.func the layers are computed by composition: the Jacobian-vector products
    equal PyTorch's modules'."""
    torch.manual_seed(12)
    for ref in (randomise_(nn.LayerNorm(6)).double(), randomise_(nn.RMSNorm(6)).double()):
        for overwrite_input in (True, False):
            layer = like(ref, overwrite_input)
            x = torch.randn(3, 6, dtype=torch.float64)
            v = torch.randn(3, 6, dtype=torch.float64)
            _, want = torch.func.jvp(ref, (x,), (v,))
            _, got = torch.func.jvp(lambda t, layer=layer: layer(t * 1), (x,), (v,))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------ errors

@pytest.mark.parametrize("call, x, error, words", [
    (lambda x: iabn.InPlaceLayerNorm(8)(x), torch.randn(2, 6), ValueError,
     r"does not end with normalized_shape=\(8,\)"),
    (lambda x: iabn.InPlaceRMSNorm((2, 8))(x), torch.randn(3, 8), ValueError,
     r"does not end with normalized_shape=\(2, 8\)"),
    (lambda x: iabn.InPlaceLayerNorm2d(8)(x), torch.randn(2, 6, 3, 3), ValueError,
     r"C = num_channels = 8.*iabn.InPlaceLayerNorm\(8\)"),
    (lambda x: iabn.InPlaceLayerNorm(8)(x), torch.randint(0, 3, (2, 8)), TypeError,
     "dtype torch.int64; layer normalisation needs"),
    (lambda x: iabn.InPlaceLayerNorm(8).half()(x), torch.randn(2, 8), TypeError,
     "parameters have dtype torch.float16 but input has torch.float32"),
    (lambda x: iabn.InPlaceLayerNorm(8).double()(x), torch.randn(2, 8), TypeError,
     "parameters have dtype torch.float64 but input has torch.float32"),
    (lambda x: iabn.InPlaceLayerNorm(8)(x), torch.randn(2, 1).expand(2, 8), ValueError,
     "share memory"),
    (lambda x: iabn.functional.inplace_layer_norm(x, 8, torch.ones(7)), torch.randn(2, 8),
     ValueError, r"weight has shape \(7,\) but normalized_shape is \(8,\)"),
    (lambda x: iabn.functional.inplace_layer_norm(x, 8, overwrite_input=1), torch.randn(2, 8),
     TypeError, "overwrite_input=1: must be True or False"),
    (lambda x: iabn.functional.inplace_rms_norm(x, "8"), torch.randn(2, 8), TypeError,
     "normalized_shape='8'"),
    (lambda x: iabn.functional.inplace_rms_norm(x.to_sparse(), 8), torch.randn(2, 8),
     TypeError, "sparse"),
])
def test_bad_inputs_are_refused_before_anything_is_written(call, x, error, words):
    before = x.clone()
    with pytest.raises(error, match=words):
        call(x)
    assert torch.equal(x, before)


def test_overwrite_input_option_is_validated_and_assignable():
    for make_layer in (lambda **k: iabn.InPlaceLayerNorm(4, **k),
                       lambda **k: iabn.InPlaceRMSNorm(4, **k),
                       lambda **k: iabn.InPlaceLayerNorm2d(4, **k)):
        with pytest.raises(TypeError, match="overwrite_input='no': must be True or False"):
            make_layer(overwrite_input="no")
        layer = make_layer()
        with pytest.raises(TypeError, match="overwrite_input=0"):
            layer.overwrite_input = 0
        assert layer.overwrite_input is True
        layer.overwrite_input = False
        x = torch.randn(2, 4, 4)
        assert layer(x) is not x and layer.overwrite_input is False
        layer.overwrite_input = True
        assert layer(x) is x
    with pytest.raises(TypeError, match=r"normalized_shape=\(\)"):
        iabn.InPlaceLayerNorm(())


# ------------------------------------------------------------ torch.compile

COMPILE_LAYERS = {
    "ln": lambda o: iabn.InPlaceLayerNorm(16, overwrite_input=o),
    "rms": lambda o: iabn.InPlaceRMSNorm(16, overwrite_input=o),
    "ln2d": lambda o: iabn.InPlaceLayerNorm2d(16, overwrite_input=o),
    "ln-no-affine": lambda o: iabn.InPlaceLayerNorm(16, elementwise_affine=False,
                                                    overwrite_input=o),
}


def _compiled_equals_eager(kind, overwrite_input, backend):
    torch._dynamo.reset()
    torch.manual_seed(10)
    layer = randomise_(COMPILE_LAYERS[kind](overwrite_input)).double()
    if layer.weight is not None:
        with torch.no_grad():
            layer.weight[5] = 0.0  # one kept column
    shape = (2, 16, 3, 4) if kind == "ln2d" else (2, 3, 16)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)

    def run(m):
        given = x * 1
        out = m(given)
        return given, [out, *torch.autograd.grad((out ** 3).sum(), [x, *m.parameters()])]

    _, eager = run(layer)
    given, compiled = run(torch.compile(copy.deepcopy(layer), backend=backend, fullgraph=True))
    tol = 0 if backend == "aot_eager" else 1e-12
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, rtol=tol, atol=tol)
    # the compiled layer's input comes from outside its graph: the layer works on a copy
    # there (iabn.autograd.call.overwritable), leaving it unchanged in both modes
    torch.testing.assert_close(given, x * 1, rtol=0, atol=0)


@pytest.mark.parametrize("overwrite_input", [True, False], ids=["overwrite", "output_only"])
@pytest.mark.parametrize("kind", list(COMPILE_LAYERS))
def test_compiled_aot_eager_equals_eager_float64(kind, overwrite_input):
    _compiled_equals_eager(kind, overwrite_input, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(COMPILE_LAYERS))
def test_compiled_inductor_equals_eager_float64(kind):
    _compiled_equals_eager(kind, True, "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ln", "rms"])
def test_cuda_matches_pytorch(kind):
    """On CUDA: float32 outputs equal PyTorch's module's, gradients within BOUND times its
    error from float64, with a zero weight."""
    torch.manual_seed(11)
    ref = randomise_(ZERO_REFS[kind]()).cuda()
    with torch.no_grad():
        ref.weight[1] = 0.0
    x = torch.randn(64, 8, D_ZERO, device="cuda")
    g = torch.randn(64, 8, D_ZERO, device="cuda")
    exact = step(copy.deepcopy(ref).double(), x.double(), g.double(), torch.float64)
    theirs = step(ref, x, g, torch.float32)
    ours = step(like(ref, True), x, g, torch.float32)
    assert torch.equal(ours[0], theirs[0])
    _assert_within(ours, theirs, exact, torch.float32, BOUND[torch.float32])
