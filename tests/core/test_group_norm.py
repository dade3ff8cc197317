"""iabn.GroupNormAct and iabn.InPlaceGroupNormAct against nn.GroupNorm + the torch.nn
activation (the independent reference), in float64, float32 and bfloat16; the bytes the
in-place layer keeps for backward, counted by hand from the shapes; the in-place contract;
bad arguments."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import iabn
from iabn.kernels import common as kernels_parts
from iabn.measure import traffic
from iabn.memory import saved_tensor_bytes

from helpers import torch_activation

# (input shape, num_groups, activation, activation_param, affine)
CASES = [
    ((4, 8, 6, 6), 4, "leaky_relu", 0.01, True),
    ((2, 16, 9), 8, "elu", 1.0, True),
    ((8, 6), 3, "identity", 0.0, False),
    ((2, 12, 3, 4, 4), 6, "leaky_relu", 0.1, True),
    ((3, 32, 5, 5), 32, "leaky_relu", 0.2, True),  # one channel per group (instance norm)
    ((3, 32, 5, 5), 1, "elu", 0.5, False),          # one group (layer norm over C, H, W)
    ((1, 4, 7, 3), 2, "identity", 0.0, True),       # batch of one: GN needs no batch
]


def reference(num_groups, channels, activation, param, affine, dtype=torch.float64):
    """nn.GroupNorm + the activation with random affine parameters."""
    norm = nn.GroupNorm(num_groups, channels, affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.copy_(torch.empty(channels).uniform_(0.5, 1.5)
                              * torch.where(torch.rand(channels) < 0.3, -1.0, 1.0))
            norm.bias.normal_()
    return nn.Sequential(norm, torch_activation(activation, param))


def layer_like(ref, num_groups, activation, param, in_place):
    cls = iabn.InPlaceGroupNormAct if in_place else iabn.GroupNormAct
    norm = ref[0]
    layer = cls(num_groups, norm.num_channels, norm.eps, norm.affine, activation, param,
                dtype=next(iter(norm.parameters()), torch.empty(0, dtype=torch.float64)).dtype)
    layer.load_state_dict(norm.state_dict())
    return layer


def step(model, x, w, dtype, channels_last=False):
    """Output and gradients (input, then parameters) of ``sum(model(h) * w)``, where ``h`` is
    a computed copy of ``x`` (the in-place layer may overwrite it)."""
    leaf = x.to(dtype).detach().requires_grad_()
    h = leaf * 1
    if channels_last:
        h = h.contiguous(memory_format=torch.channels_last)
    out = model(h)
    grads = torch.autograd.grad((out.float() * w).sum(), [leaf, *model.parameters()])
    return [out.detach().double(), *(g.double() for g in grads)]


def max_errors(got, exact):
    return [float((g - e).abs().max()) for g, e in zip(got, exact, strict=True)]


@pytest.mark.parametrize("in_place", [True, False], ids=["inplace", "not_inplace"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-G{c[1]}-{c[2]}-affine{c[4]}")
def test_matches_group_norm_float64(case, in_place):
    shape, groups, activation, param, affine = case
    torch.manual_seed(0)
    ref = reference(groups, shape[1], activation, param, affine)
    layer = layer_like(ref, groups, activation, param, in_place)
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    w = torch.randn(shape, dtype=torch.float64)
    exact = step(ref, x, w, torch.float64)
    got = step(layer, x, w, torch.float64)
    assert len(got) == len(exact) == (4 if affine else 2)
    for g, e in zip(got, exact, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-11)


def test_channels_last_and_abs_mode_float64():
    """A channels-last input, and gamma_mode='abs' (scale |weight| + eps, compared with
    nn.GroupNorm given that weight; d|w|/dw = sign, +1 at 0)."""
    torch.manual_seed(1)
    ref = reference(4, 8, "leaky_relu", 0.1, True)
    x = torch.randn(3, 8, 5, 4, dtype=torch.float64)
    w = torch.randn(3, 8, 5, 4, dtype=torch.float64)
    layer = layer_like(ref, 4, "leaky_relu", 0.1, True)
    exact = step(ref, x, w, torch.float64)
    for g, e in zip(step(layer, x, w, torch.float64, channels_last=True), exact, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-11)

    for cls in (iabn.InPlaceGroupNormAct, iabn.GroupNormAct):
        layer = cls(4, 8, activation="leaky_relu", activation_param=0.1, gamma_mode="abs",
                    dtype=torch.float64)
        layer.load_state_dict(ref[0].state_dict())
        abs_ref = copy.deepcopy(ref)
        with torch.no_grad():
            abs_ref[0].weight.copy_(ref[0].weight.abs() + ref[0].eps)
        got = step(layer, x, w, torch.float64)
        want = step(abs_ref, x, w, torch.float64)
        want[2] = want[2] * torch.where(ref[0].weight < 0, -1.0, 1.0).double()
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-11)


def test_signed_mode_clamps_tiny_weights_like_in_place_abn():
    """|weight| < eps is clamped to eps (with its sign) by the in-place layer, whose backward
    divides by the scale; the gradient passes straight through. GroupNormAct uses the weight
    as it is."""
    torch.manual_seed(2)
    ref = reference(2, 4, "leaky_relu", 0.1, True)
    with torch.no_grad():
        ref[0].weight[1] = 0.0
        ref[0].weight[2] = -1e-7
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    clamped = copy.deepcopy(ref)
    with torch.no_grad():
        clamped[0].weight[1] = ref[0].eps
        clamped[0].weight[2] = -ref[0].eps
    for in_place, want_model in ((True, clamped), (False, ref)):
        layer = layer_like(ref, 2, "leaky_relu", 0.1, in_place)
        got = step(layer, x, w, torch.float64)
        for g, e in zip(got, step(want_model, x, w, torch.float64), strict=True):
            torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)
        assert torch.isfinite(torch.cat([g.flatten() for g in got])).all()


#: Measured on CPU (torch 2.14.1) on this test's data: the in-place layer's largest error
#: from float64 (output, input, weight or bias gradient) is at most 2.5x nn.GroupNorm +
#: activation's in float32 (the (2, 16, 9) elu case) and 0.85x in bfloat16.
BOUND = {torch.float32: 4.0, torch.bfloat16: 4.0}


#: Half-precision backward works on parts of whole samples (N >= 16) or of whole groups of a
#: sample (iabn.layers.group_norm._grads_in_parts): these cut along samples, and into one-sample
#: parts.
PARTS_CASES = [((20, 6, 5), 3, "elu", 1.0, True), CASES[5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES[:5] + PARTS_CASES,
                         ids=lambda c: f"{c[0]}-G{c[1]}-{c[2]}")
def test_low_precision_error_within_a_multiple_of_group_norm(case, dtype):
    """Outputs and gradients of both in ``dtype`` (parameters too), each compared with the
    float64 reference; the in-place layer's error is at most BOUND times nn.GroupNorm's (or
    of dtype's epsilon times the values' size, where nn.GroupNorm happens to be exact)."""
    shape, groups, activation, param, affine = case
    torch.manual_seed(3)
    ref = reference(groups, shape[1], activation, param, affine)
    layer = layer_like(ref, groups, activation, param, True)
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    w = torch.randn(shape, dtype=torch.float32)
    exact = step(ref, x, w.double(), torch.float64)
    theirs = max_errors(step(copy.deepcopy(ref).to(dtype), x, w, dtype), exact)
    ours = max_errors(step(copy.deepcopy(layer).to(dtype), x, w, dtype), exact)
    eps = torch.finfo(dtype).eps
    for name, mine, pytorch, e in zip(("output", "input grad", "weight grad", "bias grad"),
                                      ours, theirs, exact, strict=False):
        floor = eps * float(e.abs().max())
        assert mine <= BOUND[dtype] * max(pytorch, floor), (name, mine, pytorch)


def test_bfloat16_input_with_float32_parameters():
    """A bfloat16 input into a float32 layer, as nn.GroupNorm accepts it: the error from
    float64 within BOUND times nn.GroupNorm's; parameter gradients stay float32."""
    shape, groups, activation, param, affine = CASES[0]
    torch.manual_seed(9)
    ref = reference(groups, shape[1], activation, param, affine)
    layer = layer_like(ref, groups, activation, param, True)
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    w = torch.randn(shape, dtype=torch.float32)
    exact = step(ref, x, w.double(), torch.float64)
    ref32, layer32 = copy.deepcopy(ref).float(), copy.deepcopy(layer).float()
    theirs = max_errors(step(ref32, x, w, torch.bfloat16), exact)
    ours = max_errors(step(layer32, x, w, torch.bfloat16), exact)
    for mine, pytorch, e in zip(ours, theirs, exact, strict=True):
        floor = torch.finfo(torch.bfloat16).eps * float(e.abs().max())
        assert mine <= BOUND[torch.bfloat16] * max(pytorch, floor), (mine, pytorch)
    h = x.to(torch.bfloat16).requires_grad_()
    layer32(h * 1).float().sum().backward()
    assert layer32.weight.grad.dtype == torch.float32 and h.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", [CASES[0], PARTS_CASES[0], ((2, 32, 4, 4), 16, "elu", 1.0,
                                                             True)],
                         ids=lambda c: f"{c[0]}-G{c[1]}-{c[2]}")
def test_half_backward_makes_no_float32_activation(case, dtype, monkeypatch):
    """A half input (float32 parameters) with 16 or more (sample, group) pairs: the backward
    computes in float32 parts, none the size of the activation, and holds at most one
    activation (in the input's dtype) more than nn.GroupNorm + activation's backward,
    counting every allocation (iabn.measure.traffic)."""
    shape, groups, activation, param, affine = case
    monkeypatch.setattr(kernels_parts, "MIN_PIECE", 1)  # parts at these tiny shapes
    torch.manual_seed(4)
    ref = reference(groups, shape[1], activation, param, affine, torch.float32)
    layer = layer_like(ref, groups, activation, param, True)
    steps = {}
    for name, module in (("torch", ref), ("iabn", layer)):
        leaf = torch.randn(shape).to(dtype).requires_grad_()
        steps[name] = traffic.count_step(module, leaf, torch.randn(shape).to(dtype))
    backward = steps["iabn"].backward
    assert all(t.dtype == dtype for t in backward.allocations), backward.allocations
    a = leaf.numel() * leaf.element_size()
    assert backward.peak_all_bytes <= steps["torch"].backward.peak_all_bytes + a


def test_strided_and_empty_inputs():
    """A view with strides (every other element of an intermediate) is normalised and
    written in place as nn.GroupNorm computes it; an empty batch gives an empty output and
    zero parameter gradients, as nn.GroupNorm does."""
    torch.manual_seed(10)
    ref = reference(2, 4, "elu", 1.0, True)
    layer = layer_like(ref, 2, "elu", 1.0, True)
    x = torch.randn(3, 4, 10, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    results = []
    for model in (layer, ref):
        big = x * 1
        out = model(big[:, :, ::2])
        grads = torch.autograd.grad((out * w).sum(), [x, *model.parameters()])
        results.append([out.detach(), *grads])
        if model is layer:
            assert torch.equal(big[:, :, ::2], out) and out.data_ptr() == big.data_ptr()
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)

    empty = (x * 1)[:0]
    out = layer(empty)
    assert out.shape == (0, 4, 10)
    out.sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros(4, dtype=torch.float64))


def test_saved_bytes_are_one_activation_and_rstd():
    """The in-place layer keeps z and rstd (N, G); nn.GroupNorm + LeakyReLU(inplace=True)
    keeps GN's input, its mean and rstd (N, G), and the activation's output."""
    n, c, h, w, groups = 4, 16, 8, 8, 4
    x = torch.randn(n, c, h, w, requires_grad=True)
    layer = iabn.InPlaceGroupNormAct(groups, c)
    ours = saved_tensor_bytes(lambda t: layer(t.clone()), x, exclude=list(layer.parameters()))
    ref = nn.Sequential(nn.GroupNorm(groups, c), nn.LeakyReLU(0.01, inplace=True))
    theirs = saved_tensor_bytes(lambda t: ref(t.clone()), x, exclude=list(ref.parameters()))
    activation = n * c * h * w * 4
    stats = n * groups * 4
    assert ours == activation + stats == 16_448
    assert theirs == 2 * activation + 2 * stats == 32_896
    # GroupNormAct keeps what nn.GroupNorm + in-place activation keep
    abn = iabn.GroupNormAct(groups, c)
    assert saved_tensor_bytes(lambda t: abn(t.clone()), x,
                              exclude=list(abn.parameters())) == theirs


def test_state_dict_round_trip_with_group_norm():
    torch.manual_seed(4)
    norm = reference(4, 8, "identity", 0.0, True, dtype=torch.float32)[0]
    for cls in (iabn.GroupNormAct, iabn.InPlaceGroupNormAct):
        layer = cls(4, 8)
        assert list(layer.state_dict()) == list(norm.state_dict()) == ["weight", "bias"]
        layer.load_state_dict(norm.state_dict())
        back = nn.GroupNorm(4, 8)
        back.load_state_dict(layer.state_dict())
        for key, value in norm.state_dict().items():
            assert torch.equal(back.state_dict()[key], value)
    bare = iabn.InPlaceGroupNormAct(2, 4, affine=False)
    assert list(bare.state_dict()) == list(nn.GroupNorm(2, 4, affine=False).state_dict()) == []
    layer = iabn.GroupNormAct(2, 4)
    with torch.no_grad():
        layer.weight.mul_(3)
    layer.reset_parameters()
    assert torch.equal(layer.weight, torch.ones(4)) and torch.equal(layer.bias, torch.zeros(4))
    assert repr(iabn.InPlaceGroupNormAct(2, 4, activation="elu", activation_param=0.5)) == (
        "InPlaceGroupNormAct(2, 4, eps=1e-05, affine=True, activation=elu, "
        "activation_param=0.5)")


def test_abs_state_into_signed_layer_warns(monkeypatch):
    import iabn.layers.options

    monkeypatch.setattr(iabn.layers.options, "_warned_abs_into_signed", False)
    trained = nn.Sequential(nn.Conv2d(3, 4, 1), iabn.InPlaceGroupNormAct(2, 4, gamma_mode="abs"))
    state = trained.state_dict()
    with pytest.warns(iabn.layers.options.GammaModeWarning, match=r"^1: .*gamma_mode='abs'"):
        nn.Sequential(nn.Conv2d(3, 4, 1), iabn.GroupNormAct(2, 4)).load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nn.Sequential(nn.Conv2d(3, 4, 1), iabn.GroupNormAct(2, 4)).load_state_dict(state)
        iabn.GroupNormAct(2, 4, gamma_mode="abs").load_state_dict(trained[1].state_dict())
        nn.GroupNorm(2, 4).load_state_dict(trained[1].state_dict())


@pytest.mark.parametrize("args, kwargs, error, words", [
    ((3, 8), {}, ValueError, "num_channels=8 is not divisible by num_groups=3"),
    ((0, 8), {}, ValueError, "num_groups=0"),
    ((2.0, 8), {}, TypeError, "num_groups=2.0"),
    ((2, True), {}, TypeError, "num_channels=True"),
    ((2, 8), {"activation": "relu"}, ValueError, "activation='relu' is not invertible"),
    ((2, 8), {"activation": "swish"}, ValueError, "unknown activation='swish'"),
    ((2, 8), {"activation_param": 0.0}, ValueError, "activation_param=0.0"),
    ((2, 8), {"eps": 0.0}, ValueError, "eps=0.0"),
    ((2, 8), {"gamma_mode": "positive"}, ValueError, "gamma_mode='positive'"),
])
def test_bad_constructor_arguments(args, kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        iabn.InPlaceGroupNormAct(*args, **kwargs)
    if kwargs.get("activation") != "relu":  # the not-in-place layer takes it
        with pytest.raises(error):
            iabn.GroupNormAct(*args, **kwargs)


def test_relu_only_in_the_not_in_place_layer():
    torch.manual_seed(5)
    ref = reference(2, 4, "relu", 0.0, True)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    layer = layer_like(ref, 2, "relu", 0.0, in_place=False)
    for g, e in zip(step(layer, x, w, torch.float64), step(ref, x, w, torch.float64),
                    strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-11)
    built = iabn.InPlaceGroupNormAct(2, 4)
    with pytest.raises(ValueError, match="not invertible"):
        built.activation = "relu"
    with pytest.raises(ValueError, match="not divisible"):
        built.num_groups = 3
    assert built.activation == "leaky_relu" and built.num_groups == 2


@pytest.mark.parametrize("make, error, words", [
    (lambda: torch.randn(2, 6, 5), ValueError, "input has 6 channels .* num_channels=8"),
    (lambda: torch.randn(8), ValueError, "got a 1-D tensor"),
    (lambda: torch.randn(2, 8, 0), ValueError, "empty spatial size"),
    (lambda: torch.randint(0, 3, (2, 8, 5)), TypeError, "dtype torch.int64"),
    (lambda: torch.randn(2, 8, 5, requires_grad=True), RuntimeError, "leaf tensor"),
    (lambda: torch.randn(2, 8, 1).expand(2, 8, 5), ValueError, "share memory"),
])
def test_bad_inputs_are_refused_before_anything_is_written(make, error, words):
    layer = iabn.InPlaceGroupNormAct(4, 8)
    x = make()
    before = x.detach().clone()
    with pytest.raises(error, match=words):
        layer(x)
    assert torch.equal(x.detach(), before)
    with torch.inference_mode():
        made = torch.randn(2, 8, 5)
    with pytest.raises(ValueError, match="inference tensor"):
        layer(made)


def test_in_place_contract():
    """Returns its input, overwritten; a tensor another node saved is caught by autograd at
    backward; double backward is refused; without grad nothing is recorded."""
    torch.manual_seed(6)
    layer = iabn.InPlaceGroupNormAct(2, 4)
    x = torch.randn(2, 4, 5, requires_grad=True)
    h = x * 2
    out = layer(h)
    assert out is h
    expected = nn.functional.leaky_relu(nn.functional.group_norm(x.detach() * 2, 2), 0.01)
    torch.testing.assert_close(out.detach(), expected)

    h = x * 2
    kept = h.sin()  # sin saved h for its own backward
    out = layer(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + kept.sum()).backward()

    out = layer(x * 2)
    with pytest.raises(RuntimeError, match=r"does not support double backward.*GroupNormAct"):
        torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)

    with torch.no_grad():
        h = x.detach() * 2
        out = layer(h)
    assert out is h and out.grad_fn is None
    torch.testing.assert_close(out, expected)


def test_debug_mode_finds_a_read_of_the_overwritten_input():
    layer = iabn.InPlaceGroupNormAct(2, 4)
    x = torch.randn(2, 4, 5, requires_grad=True)
    with iabn.debug.poison_overwritten():
        h = x * 2
        out = layer(h)
        with pytest.raises(iabn.debug.OverwrittenTensorError, match="InPlaceGroupNormAct"):
            out + h


def test_forward_ad_and_torch_func_compose():
    """Under forward-mode AD and torch.func the layer is computed by composition: the
    Jacobian-vector product equals nn.GroupNorm + LeakyReLU's."""
    torch.manual_seed(7)
    ref = reference(2, 4, "leaky_relu", 0.1, True)
    layer = layer_like(ref, 2, "leaky_relu", 0.1, True)
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    v = torch.randn(3, 4, 5, dtype=torch.float64)
    _, want = torch.func.jvp(lambda t: ref(t), (x,), (v,))
    _, got = torch.func.jvp(lambda t: layer(t * 1), (x,), (v,))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("activation, param", [("elu", 0.5), ("silu", 0.0), ("gelu", 0.0)])
def test_compiled_gradients_equal_eager_float64(activation, param):
    """torch.compile (aot_eager, fullgraph) of conv -> layer -> conv gives the eager outputs
    and gradients: Dynamo traces the autograd Function (with silu and gelu, the bits' packing
    and the Newton recovery too)."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1),
                          iabn.InPlaceGroupNormAct(4, 8, activation=activation,
                                                   activation_param=param),
                          nn.Conv2d(8, 4, 1)).double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.normal_()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    reference_model = nn.Sequential(model[0], nn.GroupNorm(4, 8).double(),
                                    torch_activation(activation, param), model[2])
    reference_model[1].load_state_dict(model[1].state_dict())

    def run(m):
        out = m(x)
        return [out, *torch.autograd.grad((out ** 2).sum(), [x, *m.parameters()])]

    eager = run(model)
    compiled = run(torch.compile(copy.deepcopy(model), backend="aot_eager", fullgraph=True))
    # bit for bit, but where the compiled recovery's polynomial steps are plain multiply-adds
    # (eager: addcmul, branch._polynomial_): with gelu one element of a 216-element gradient
    # a rounding apart (relative 2.1e-16 and 3.0e-16 in two runs); allowed 4 epsilons
    rtol = 0 if activation == "elu" else 4 * torch.finfo(torch.float64).eps
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, rtol=rtol, atol=0)
    for e, r in zip(eager, run(reference_model), strict=True):
        torch.testing.assert_close(e, r, rtol=1e-10, atol=1e-11)

    # compiled alone, the layer's input is the graph's input: it works on a copy there
    layer = model[1]
    h = torch.randn(2, 8, 6, 6, dtype=torch.float64, requires_grad=True)

    def alone(m):
        given = h * 1
        out = m(given)
        return given, [out, *torch.autograd.grad((out ** 3).sum(), [h, *m.parameters()])]

    _, eager = alone(layer)
    given, compiled = alone(torch.compile(copy.deepcopy(layer), backend="aot_eager",
                                          fullgraph=True))
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    torch.testing.assert_close(given, h * 1, rtol=0, atol=0)
