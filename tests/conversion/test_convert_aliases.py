"""iabn.convert where values alias or escape the traced graph.

Two classes of models an in-place layer would break:

- an operation returns the norm's output itself or a view of it (``dropout`` in eval mode or
  with ``p=0``, torchvision's stochastic depth, ``nn.Identity``, ``.type()``, ``nn.Flatten``...)
  and a later ``+=`` writes into it: the in-place layer and ``ABN`` keep that output for
  backward, so backward would fail (eval mode included);
- something outside the graph keeps the conv output that an in-place layer overwrites (a
  module attribute, a list or dict on a module, a hook, a global), or the norm's own output
  that fusing the activation removes.

For each model: conversion does not raise; outputs, input and parameter gradients (training
and eval mode, loss = sum of outputs squared) equal the original model's (float64, plain
PyTorch layers); the tensors kept outside the graph equal the original's; and the report
names the reason.
"""

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils._pytree import tree_leaves

import iabn

C = 6
# Conversion computes the same float64 operations in another order. The largest difference
# measured over these models (outputs, gradients, kept tensors; torch 2.14.1, CPU) is 2.8e-14,
# most are exactly 0 (the norms stay or become ABN): 1e-12 is ~35x that, as in test_convert.py.
TOL = 1e-12


# Every model here is checked on both ways to a graph: fx's trace and a recorded run
# (the fixture ``analysis``, tests/conversion/conftest.py).
pytestmark = pytest.mark.usefixtures("analysis")


def _x(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 5, 5, dtype=torch.float64, generator=generator)


def _randomise(model):
    """Non-trivial norm parameters and statistics (a wrong layer shows), float64."""
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.weight.data = torch.rand(m.weight.shape, generator=g) + 0.5
            m.bias.data = torch.randn(m.bias.shape, generator=g)
            m.running_mean.data = torch.randn(m.running_mean.shape, generator=g)
            m.running_var.data = torch.rand(m.running_var.shape, generator=g) + 0.5
    return model.double()


def _step(model, x, training, kept):
    """Outputs, gradients of sum(outputs**2) w.r.t. the input and every parameter, and the
    tensors ``kept(model)`` returns after forward, in one mode with fixed randomness."""
    model.train(training)
    x = x.clone().requires_grad_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        outputs = [t for t in tree_leaves(model(x)) if isinstance(t, torch.Tensor)]
    held = [t.detach().clone() for t in kept(model)]
    names, weights = zip(*model.named_parameters(), strict=True)
    loss = sum((t ** 2).sum() for t in outputs)
    grads = torch.autograd.grad(loss, [x, *weights], allow_unused=True)
    return ([t.detach() for t in outputs], dict(zip(["input", *names], grads, strict=True)),
            held)


def _copy(model):
    """deepcopy, sharing the non-leaf tensors a forward left on the modules (deepcopy refuses
    them; each copy's own forward replaces them)."""
    memo = {}
    for m in model.modules():
        for t in tree_leaves([v for k, v in vars(m).items() if k not in ("_parameters",
                                                                          "_buffers")]):
            if isinstance(t, torch.Tensor) and not t.is_leaf:
                memo[id(t)] = t
    return copy.deepcopy(model, memo)


def _difference(original, converted, x, kept):
    """Largest absolute difference between the two models over outputs, gradients and kept
    tensors, in training and eval mode (each step on fresh copies)."""
    worst = 0.0
    for training in (True, False):
        expected = _step(_copy(original), x, training, kept)
        got = _step(_copy(converted), x, training, kept)
        assert len(got[0]) == len(expected[0]) and len(got[2]) == len(expected[2])
        assert got[1].keys() == expected[1].keys()
        pairs = [*zip(got[0], expected[0], strict=True), *zip(got[2], expected[2], strict=True),
                 *((got[1][k], expected[1][k]) for k in expected[1])]
        for a, b in pairs:
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape
                worst = max(worst, float((a - b).abs().max()))
    return worst


def _convert_and_compare(model, kept=lambda m: []):
    model = _randomise(model)
    x = _x()
    converted, report = iabn.convert(model, x)
    worst = _difference(model, converted, x, kept)
    print(f"largest difference {worst:.3g}")
    assert worst <= TOL, worst
    return converted, {row.name: row for row in report.rows}


# ---------------------------------------------------------------- operations that may alias


class StochasticDepthBlock(nn.Module):
    """torchvision's EfficientNet (V2) block ending: ``result = self.stochastic_depth(result);
    result += input``; stochastic depth returns its input in eval mode and when p == 0."""

    def __init__(self, p):
        super().__init__()
        from torchvision.ops import StochasticDepth

        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C),
                                  nn.LeakyReLU(0.1))
        self.block = nn.Sequential(nn.Conv2d(C, C, 3, padding=1), nn.BatchNorm2d(C),
                                   nn.ELU(), nn.Conv2d(C, C, 1), nn.BatchNorm2d(C))
        self.stochastic_depth = StochasticDepth(p, "row")
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        h = self.stem(x)
        result = self.block(h)
        result = self.stochastic_depth(result)
        result += h
        return self.head(result)


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_stochastic_depth_block_backward_in_both_modes(p, analysis):
    pytest.importorskip("torchvision", reason="torchvision's StochasticDepth")
    _, rows = _convert_and_compare(StochasticDepthBlock(p))
    row = rows["block.4"]
    assert row.decision == "untouched"
    # fx sees the wrapped function; a run sees what it returned: the norm's output itself
    # (eval mode, or p == 0), which `+=` writes into
    words = ("stochastic_depth, which iabn cannot vet" if analysis == "torch.fx" else
             ".add_() writes into the norm's output in place")
    assert words in row.reason


def _type_same(y):
    return y.type(torch.float64)


class Passthrough(nn.Module):
    """A module from outside PyTorch that the tracer does not look inside (registered as
    timm's "do not trace" module, which iabn's tracer honours)."""

    def forward(self, y):
        return y


def _third_party(y):
    return y


# a function of a package whose name starts with "torch" (torchvision, torchaudio...)
_third_party.__module__ = "torchextras.layers"
_third_party = fx.wrap(_third_party)


# (name, operation after the norm's activation, words the reason must contain); where a
# recorded run words it otherwise, RECORDED_WORDS has its words

ALIASING = {
    "Dropout(0)": (nn.Dropout(0.0), "output of Dropout, which may return"),
    "Dropout(0.1)": (nn.Dropout(0.1), "output of Dropout, which may return"),
    "Dropout2d(0.1)": (nn.Dropout2d(0.1), "output of Dropout2d, which may return"),
    "AlphaDropout(0.1)": (nn.AlphaDropout(0.1), "output of AlphaDropout, which may return"),
    "F.dropout": (lambda y: F.dropout(y, 0.1, training=False),
                  "output of dropout, which may return"),
    "Identity": (nn.Identity(), "output of Identity, which may return"),
    ".type(same)": (_type_same, "output of .type(), which may return"),
    ".cpu()": (lambda y: y.cpu(), "output of .cpu(), which may return"),
    "+y": (lambda y: +y, "output of pos, which may return"),
    "Flatten/Unflatten": (nn.Sequential(nn.Flatten(), nn.Unflatten(1, (C, 5, 5))),
                          "output of Unflatten, which may return"),
    "broadcast_to": (lambda y: torch.broadcast_to(y, y.shape),
                     "output of broadcast_to, which may return"),
    "einsum": (lambda y: torch.einsum("nchw->nchw", y), "output of einsum, which may return"),
    ".contiguous()": (lambda y: y.contiguous(), "output of .contiguous(), which may return"),
    ".to(same dtype)": (lambda y: y.to(torch.float64), "output of .to(), which may return"),
    "reshape": (lambda y: y.reshape(y.shape), "output of .reshape(), which may return"),
    "view/flatten": (lambda y: torch.flatten(y, 1).view(y.shape),
                     "output of .view(), which may return"),
    "unknown module": (Passthrough(), "goes to Passthrough, which iabn cannot vet"),
    # through the module's global name, which fx.wrap patches while tracing
    "torch-named package": (lambda y: _third_party(y),
                            "goes to _third_party, which iabn cannot vet"),
}


RECORDED_WORDS = {
    "+y": "output of .positive(), which may return",
    # the function returns its input: the run sees `+=` write into the norm's output itself
    "torch-named package": ".add_() writes into the norm's output in place",
}


class WrittenThroughAlias(nn.Module):
    """conv -> norm -> LeakyReLU -> op -> ``+= shortcut``: the write reaches the norm's output
    where ``op`` returns its input."""

    def __init__(self, op):
        super().__init__()
        self.conv, self.side = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(3, C, 1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.1)
        self.op = op
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        y = self.op(self.act(self.bn(self.conv(x))))
        y += self.side(x)
        return self.head(y)


class WrittenThroughAliasNoActivation(WrittenThroughAlias):
    """The same with nothing to fuse: in place would have been InPlaceABN(identity)."""

    def forward(self, x):
        y = self.op(self.bn(self.conv(x)))
        y += self.side(x)
        return self.head(y)


@pytest.mark.parametrize("activation", [True, False], ids=["LeakyReLU", "none"])
@pytest.mark.parametrize("name", list(ALIASING))
def test_a_write_through_an_operation_that_may_return_its_input(name, activation, analysis):
    op, words = ALIASING[name]
    if analysis == "recorded run":
        words = RECORDED_WORDS.get(name, words)
    if isinstance(op, Passthrough):
        timm = pytest.importorskip("timm", reason="registers the module as not traced")
        timm.layers.register_notrace_module(Passthrough)
    model = (WrittenThroughAlias if activation else WrittenThroughAliasNoActivation)(op)
    _, rows = _convert_and_compare(model)
    assert rows["bn"].decision == "untouched", rows["bn"]
    if name == "Identity" and not activation:  # the Identity is the activation fused
        words = ("iadd" if analysis == "torch.fx" else ".add_()") + (
            " writes into the norm's output in place")
    assert words in rows["bn"].reason, rows["bn"].reason


# ---------------------------------------------------------------- values kept outside the graph

KEPT_GLOBALLY = []


class Escaping(nn.Module):
    """conv -> norm -> LeakyReLU -> conv, where ``how`` keeps the first conv's output (the
    norm's input, which an in-place layer would overwrite) outside the graph."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.1)
        self.head = nn.Conv2d(C, 2, 1)
        self.cache = {}

    def forward(self, x):
        h = self.conv(x)
        if self.how == "attribute":
            self.features = h
        elif self.how == "view":
            self.transposed = h.mT
        elif self.how == "list":
            self.kept = [x, h]
        elif self.how == "dict":
            self.cache["h"] = h
        elif self.how == "global":
            KEPT_GLOBALLY[:] = [h]
        return self.head(self.act(self.bn(h)))


def _hooked(where, kind):
    """A model whose ``where`` module has a ``kind`` hook that keeps what it gets in a dict
    (as Grad-CAM or feature-extraction code does), and the function reading that dict."""
    model, store = Escaping("hook"), {}

    def forward_hook(module, inputs, output):
        store["in"], store["out"] = inputs[0], output

    def pre_hook(module, inputs):
        store["in"] = inputs[0]

    module = model.get_submodule(where)
    if kind == "forward":
        module.register_forward_hook(forward_hook)
    else:
        module.register_forward_pre_hook(pre_hook)
    return model, lambda m: list(store.values())


def _keeping(how, kept):
    return lambda: (Escaping(how), kept)


ESCAPES = {
    # name: (builder of (model, kept(model)), expected decision of bn, words in the reason)
    "attribute": (_keeping("attribute", lambda m: [m.features]), "ABN",
                  "its input escapes: stored as module attribute `features`"),
    "attribute holding a view": (_keeping("view", lambda m: [m.transposed]), "ABN",
                                 "its input escapes: stored as module attribute `transposed`"),
    "list on self": (_keeping("list", lambda m: m.kept), "ABN",
                     "its input escapes: stored as module attribute `kept[1]`"),
    "dict on self": (_keeping("dict", lambda m: list(m.cache.values())), "ABN",
                     "its input escapes: stored as module attribute `cache['h']`"),
    "global": (_keeping("global", lambda m: KEPT_GLOBALLY), "ABN",
               "its input escapes: kept outside the graph"),
    "forward hook on the producer": (lambda: _hooked("conv", "forward"), "ABN",
                                     "its input escapes: passed to a forward hook of `conv`"),
    "pre-hook on the norm": (lambda: _hooked("bn", "pre"), "untouched", "hooks"),
    "forward hook on the norm": (lambda: _hooked("bn", "forward"), "untouched", "hooks"),
    "pre-hook on the activation": (lambda: _hooked("act", "pre"), "untouched",
                                   "the LeakyReLU after it is not fused (its output escapes: "
                                   "passed to a forward pre-hook of `act`)"),
    "forward hook on the activation": (lambda: _hooked("act", "forward"), "untouched",
                                       "passed to a forward hook of `act`"),
    # the hook gets the activation's output, which both layers keep for backward
    "pre-hook on the next conv": (lambda: _hooked("head", "pre"), "untouched",
                                  "output escapes: passed to a forward pre-hook of `head`, "
                                  "which may write into it"),
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_values_kept_outside_the_graph_are_not_overwritten(name):
    build, decision, words = ESCAPES[name]
    _, rows = _convert_and_compare(*build())
    print(rows["bn"].reason)
    assert rows["bn"].decision == decision, rows["bn"]
    assert words in rows["bn"].reason, rows["bn"].reason


class StemWithHook(nn.Module):
    """A hook on a traced (non-leaf) module whose output is the norm's input: the hook ran
    on proxies while tracing, and only the model's own forward runs it again."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, C, 3, padding=1))
        self.bn = nn.BatchNorm2d(C)
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        return self.head(F.leaky_relu(self.bn(self.stem(x)), 0.1))


def test_a_hook_on_a_traced_module_keeps_the_class_and_the_tensor():
    model, store = StemWithHook(), {}
    model.stem.register_forward_hook(lambda m, i, o: store.__setitem__("stem", o))
    converted, rows = _convert_and_compare(model, lambda m: [store["stem"]])
    assert type(converted) is StemWithHook  # not a generated module, which runs no hooks
    assert rows["bn"].decision == "untouched"
    assert "its input escapes: passed to a forward hook of `stem`" in rows["bn"].reason


class FunctionalActivationWithAttribute(nn.Module):
    """F.leaky_relu would need a generated fx module, which does not store attributes."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, C, 1)
        self.bn1, self.bn2 = nn.BatchNorm2d(C), nn.BatchNorm2d(C)
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        h = self.conv1(x)
        self.features = h
        y = F.leaky_relu(self.bn1(h), 0.1)
        return self.head(F.leaky_relu(self.bn2(self.conv2(y)), 0.1))


def test_an_attribute_store_keeps_the_class_and_functional_activations_separate():
    converted, rows = _convert_and_compare(FunctionalActivationWithAttribute(),
                                           lambda m: [m.features])
    assert type(converted) is FunctionalActivationWithAttribute
    assert rows["bn1"].decision == "untouched"  # input escapes; nothing may be fused
    assert "stored as module attribute `features`" in rows["bn1"].reason
    assert rows["bn2"].decision == "InPlaceABN"  # in place, with the activation after it
    assert "leaky_relu after it is not fused" in rows["bn2"].reason
    assert converted.bn2.activation == "identity"


class PreActivationKept(nn.Module):
    """The norm's own output is kept before the activation: fusing would remove it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.1)
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        self.normalised = y
        return self.head(self.act(y))


def test_a_kept_norm_output_is_not_fused_away():
    converted, rows = _convert_and_compare(PreActivationKept(), lambda m: [m.normalised])
    assert "the LeakyReLU after it is not fused (its output escapes: stored as module " \
           "attribute `normalised`)" in rows["bn"].reason
    assert isinstance(converted.act, nn.LeakyReLU)


class ExtraOutput(nn.Module):
    """The conv output is also returned."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.1)
        self.head = nn.Conv2d(C, 2, 1)  # a returned norm output stays untouched

    def forward(self, x):
        h = self.conv(x)
        return {"out": self.head(self.act(self.bn(h))), "features": h}


def test_a_conv_output_returned_too_is_not_overwritten():
    _, rows = _convert_and_compare(ExtraOutput())
    assert rows["bn"].decision == "ABN" and "also used by 1 other" in rows["bn"].reason


class CaughtError(nn.Module):
    """forward keeps a caught exception in a local: its traceback and the frame (holding the
    conv output) form a reference cycle that outlives the call until garbage collection."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.1)
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        h = self.conv(x)
        try:
            raise KeyError("absent")
        except KeyError as error:
            caught = error  # noqa: F841
        return self.head(self.act(self.bn(h)))


def test_values_only_in_reference_cycles_do_not_escape():
    _, rows = _convert_and_compare(CaughtError())
    assert rows["bn"].decision == "InPlaceABN", rows["bn"]


def test_a_model_that_already_ran_converts():
    """A forward with gradients left a non-leaf tensor on the model, which deepcopy refuses."""
    model = _randomise(Escaping("attribute"))
    model(_x(1))
    assert model.features.grad_fn is not None
    _, rows = _convert_and_compare(model, lambda m: [m.features])
    assert rows["bn"].decision == "ABN"


def test_verify_catches_a_backward_that_fails_in_eval_mode(monkeypatch):
    """The check behind the rules: with the write rule switched off, the converted model's
    eval-mode backward fails (Dropout returns its input there) and convert says so."""
    from iabn.conversion import graph

    monkeypatch.setattr(graph, "later_write", lambda *args: None)
    model = _randomise(WrittenThroughAlias(nn.Dropout(0.1)))
    with pytest.raises(RuntimeError, match="eval-mode backward fails where the original's runs"):
        iabn.convert(model, _x())


# ---------------------------------------------------------------- the list of "new tensor" ops

X3, X4, X5 = torch.randn(2, 4, 3), torch.randn(2, 4, 3, 3), torch.randn(2, 4, 2, 3, 3)
EYE = torch.eye(4)


def _shares_memory(result, inputs):
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    return any(t.untyped_storage().data_ptr() in storages
               for t in tree_leaves(result) if isinstance(t, torch.Tensor))


# one call per function the rules count as returning a new tensor, at degenerate settings
# (size-1 kernels, zero padding, scale 1, adding 0) where a shortcut could return the input
FUNCTION_CALLS = {
    F.conv1d: lambda: F.conv1d(X3, EYE[..., None]),
    F.conv2d: lambda: F.conv2d(X4, EYE[..., None, None]),
    F.conv3d: lambda: F.conv3d(X5, EYE[..., None, None, None]),
    torch.conv1d: lambda: torch.conv1d(X3, EYE[..., None]),
    torch.conv2d: lambda: torch.conv2d(X4, EYE[..., None, None]),
    torch.conv3d: lambda: torch.conv3d(X5, EYE[..., None, None, None]),
    F.conv_transpose1d: lambda: F.conv_transpose1d(X3, EYE[..., None]),
    F.conv_transpose2d: lambda: F.conv_transpose2d(X4, EYE[..., None, None]),
    F.conv_transpose3d: lambda: F.conv_transpose3d(X5, EYE[..., None, None, None]),
    F.linear: lambda: F.linear(X4, torch.eye(3)),
    F.bilinear: lambda: F.bilinear(X3, X3, torch.ones(1, 3, 3)),
    operator.add: lambda: X4 + 0, operator.sub: lambda: X4 - 0, operator.mul: lambda: X4 * 1,
    operator.truediv: lambda: X4 / 1, operator.floordiv: lambda: X4 // 1,
    operator.mod: lambda: X4 % 1e9, operator.pow: lambda: X4 ** 1,
    operator.matmul: lambda: X4 @ torch.eye(3), operator.neg: lambda: -X4,
    operator.abs: lambda: abs(X4), operator.lt: lambda: X4 < 0, operator.le: lambda: X4 <= 0,
    operator.gt: lambda: X4 > 0, operator.ge: lambda: X4 >= 0, operator.eq: lambda: X4 == 0,
    operator.ne: lambda: X4 != 0,
    torch.add: lambda: torch.add(X4, 0), torch.sub: lambda: torch.sub(X4, 0),
    torch.mul: lambda: torch.mul(X4, 1), torch.div: lambda: torch.div(X4, 1),
    torch.cat: lambda: torch.cat([X4]), torch.concat: lambda: torch.concat([X4]),
    torch.concatenate: lambda: torch.concatenate([X4]), torch.stack: lambda: torch.stack([X4]),
    torch.matmul: lambda: torch.matmul(X4, torch.eye(3)),
    torch.mm: lambda: torch.mm(EYE, EYE),
    torch.bmm: lambda: torch.bmm(X3, torch.eye(3).expand(2, 3, 3)),
    torch.sum: lambda: torch.sum(X4[:1], 0, True),
    torch.mean: lambda: torch.mean(X4[:1], 0, True),
    torch.relu: lambda: torch.relu(X4), torch.sigmoid: lambda: torch.sigmoid(X4),
    torch.tanh: lambda: torch.tanh(X4), torch.exp: lambda: torch.exp(X4),
    torch.log: lambda: torch.log(X4), torch.sqrt: lambda: torch.sqrt(X4),
    torch.rsqrt: lambda: torch.rsqrt(X4), torch.abs: lambda: torch.abs(X4),
    torch.neg: lambda: torch.neg(X4), torch.clamp: lambda: torch.clamp(X4, -1e9, 1e9),
    torch.clip: lambda: torch.clip(X4, -1e9, 1e9), torch.softmax: lambda: torch.softmax(X4, 1),
    torch.log_softmax: lambda: torch.log_softmax(X4, 1),
    torch.where: lambda: torch.where(X4 > 0, X4, X4), torch.maximum: lambda: torch.maximum(X4, X4),
    torch.minimum: lambda: torch.minimum(X4, X4),
    F.relu: lambda: F.relu(X4), F.relu6: lambda: F.relu6(X4),
    F.leaky_relu: lambda: F.leaky_relu(X4),
    F.elu: lambda: F.elu(X4), F.selu: lambda: F.selu(X4), F.celu: lambda: F.celu(X4),
    F.gelu: lambda: F.gelu(X4), F.silu: lambda: F.silu(X4), F.mish: lambda: F.mish(X4),
    F.hardswish: lambda: F.hardswish(X4), F.hardsigmoid: lambda: F.hardsigmoid(X4),
    F.hardtanh: lambda: F.hardtanh(X4, -1e9, 1e9), F.sigmoid: lambda: F.sigmoid(X4),
    F.tanh: lambda: F.tanh(X4), F.softplus: lambda: F.softplus(X4),
    F.softmax: lambda: F.softmax(X4, 1), F.log_softmax: lambda: F.log_softmax(X4, 1),
    F.glu: lambda: F.glu(X4, 1), F.prelu: lambda: F.prelu(X4, torch.ones(1)),
    F.max_pool1d: lambda: F.max_pool1d(X3, 1), F.max_pool2d: lambda: F.max_pool2d(X4, 1),
    F.max_pool3d: lambda: F.max_pool3d(X5, 1), F.avg_pool1d: lambda: F.avg_pool1d(X3, 1),
    F.avg_pool2d: lambda: F.avg_pool2d(X4, 1), F.avg_pool3d: lambda: F.avg_pool3d(X5, 1),
    F.adaptive_avg_pool1d: lambda: F.adaptive_avg_pool1d(X3, 3),
    F.adaptive_avg_pool2d: lambda: F.adaptive_avg_pool2d(X4, 3),
    F.adaptive_avg_pool3d: lambda: F.adaptive_avg_pool3d(X5, (2, 3, 3)),
    F.adaptive_max_pool1d: lambda: F.adaptive_max_pool1d(X3, 3),
    F.adaptive_max_pool2d: lambda: F.adaptive_max_pool2d(X4, 3, return_indices=True),
    F.adaptive_max_pool3d: lambda: F.adaptive_max_pool3d(X5, (2, 3, 3)),
    F.interpolate: lambda: F.interpolate(X4, scale_factor=1),
    F.pad: lambda: F.pad(X4, (0, 0, 0, 0)), F.pixel_shuffle: lambda: F.pixel_shuffle(X4, 1),
    F.pixel_unshuffle: lambda: F.pixel_unshuffle(X4, 1),
    F.batch_norm: lambda: F.batch_norm(X4, None, None, training=True),
    F.layer_norm: lambda: F.layer_norm(X4, (3,)), F.group_norm: lambda: F.group_norm(X4, 1),
    F.instance_norm: lambda: F.instance_norm(X4), F.normalize: lambda: F.normalize(X4),
    F.scaled_dot_product_attention: lambda: F.scaled_dot_product_attention(X4, X4, X4),
}
METHOD_ARGUMENTS = {"add": (0,), "sub": (0,), "mul": (1,), "div": (1,), "pow": (1,),
                    "matmul": (torch.eye(3),), "softmax": (1,), "log_softmax": (1,),
                    "clamp": (-1e9, 1e9), "clip": (-1e9, 1e9), "amax": (0,), "amin": (0,),
                    "masked_fill": (torch.zeros(3, dtype=torch.bool), 0.0)}


def test_every_function_counted_as_new_returns_a_new_tensor():
    from iabn.conversion import graph

    assert set(FUNCTION_CALLS) == graph._NEW_FUNCTIONS  # an example for each, no more
    for function, call in FUNCTION_CALLS.items():
        assert not _shares_memory(call(), [X3, X4, X5, EYE]), function
    for name in graph._NEW_METHODS:
        x = X4[:1, :1, :1, :1].clone() if name == "item" else X4
        assert not _shares_memory(getattr(x, name)(*METHOD_ARGUMENTS.get(name, ())), [x]), name


def _modules_by_file():
    from torch.nn.modules import activation

    with_arguments = {"MultiheadAttention": None, "Softmax": (1,), "Softmin": (1,),
                      "LogSoftmax": (1,), "Threshold": (-1e9, 0.0), "GLU": (1,)}
    examples = [getattr(activation, name)(*with_arguments.get(name, ()))
                for name in activation.__all__ if name != "MultiheadAttention"]
    examples += [nn.Conv2d(4, 4, 1), nn.Conv3d(4, 4, 1), nn.ConvTranspose2d(4, 4, 1),
                 nn.MaxPool2d(1), nn.AvgPool2d(1), nn.AdaptiveAvgPool2d(3),
                 nn.AdaptiveMaxPool2d(3), nn.LPPool2d(1, 1), nn.ZeroPad2d(0),
                 nn.ConstantPad2d(0, 0.0), nn.ReflectionPad2d(0), nn.ReplicationPad2d(0),
                 nn.CircularPad2d(0), nn.Upsample(scale_factor=1),
                 nn.UpsamplingNearest2d(scale_factor=1), nn.PixelShuffle(1),
                 nn.PixelUnshuffle(1), nn.ChannelShuffle(1), nn.LayerNorm(3), nn.GroupNorm(1, 4),
                 nn.LocalResponseNorm(1), nn.BatchNorm2d(4), nn.InstanceNorm2d(4),
                 nn.Linear(3, 3), iabn.ABN(4, activation="identity")]
    return examples


def test_every_module_counted_as_new_returns_a_new_tensor():
    from iabn.conversion import graph

    examples = _modules_by_file()
    assert {type(m).__module__ for m in examples} >= graph._NEW_MODULE_FILES
    for m in [*examples, nn.MultiheadAttention(3, 1, batch_first=True)]:
        for training in (True, False):
            m.train(training)
            x = (X3 if isinstance(m, nn.MultiheadAttention) else
                 X5 if isinstance(m, nn.Conv3d) else X4).clone()
            with torch.no_grad():
                result = m(x, x, x) if isinstance(m, nn.MultiheadAttention) else m(x)
            assert not _shares_memory(result, [x]), m
