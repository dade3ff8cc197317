"""Selective recomputation (iabn.planning.selective): recomputed in backward but for the
products, whose outputs are kept.

Checked against the same segment run without recomputation in float64 (outputs, gradients:
bit for bit, since the same operations run on the same values), the bytes against the
tensors' own sizes, and what backward runs with a dispatch mode.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from iabn.memory import saved_storages, saved_tensor_bytes
from iabn.planning.selective import is_product, selectively_recomputed
from iabn.planning.wrappers import recomputed


class Selective(nn.Module):
    """``module`` run by selective recomputation (running statistics restored after it;
    ``lean``: its expansions run again too)."""

    def __init__(self, module, lean=False):
        super().__init__()
        self.module, self.lean = module, lean

    def forward(self, x):
        return recomputed(self.module, [self.module], x, selective=True, lean=self.lean)


class Attention(nn.Module):
    """Linear projections and a matrix product written with functional calls."""

    def __init__(self, c):
        super().__init__()
        self.qkv = nn.Linear(c, 3 * c)
        self.out = nn.Linear(c, c)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return self.out(torch.nn.functional.gelu(weights @ v))


def conv_chain(inplace=True):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=inplace),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=inplace),
        nn.Dropout(0.3), nn.MaxPool2d(2), nn.Conv2d(8, 4, 1), nn.LeakyReLU(0.1, inplace=inplace),
    )


def _step(model, x, grad, seed=0):
    torch.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    return out.detach(), x.grad, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("make, shape", [
    (conv_chain, (2, 3, 8, 8)),
    (lambda: conv_chain(inplace=False), (2, 3, 8, 8)),
    (lambda: Attention(6), (2, 5, 6)),
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=True)), (2, 3, 6, 6)),
], ids=["conv_bn_relu_inplace", "conv_bn_relu", "attention", "conv_then_inplace_relu"])
def test_training_is_bitwise_the_plain_segment(make, shape):
    """float64, two steps: outputs, input and parameter gradients and running statistics
    equal those of the segment run plainly (the same operations on the same values). The
    last case writes into a kept convolution output (ReLU in place right after it)."""
    assert_trains_as_the_plain_segment(make, shape, lean=False)


def assert_trains_as_the_plain_segment(make, shape, lean):
    torch.manual_seed(0)
    plain = make().double().train()
    planned = Selective(copy.deepcopy(plain), lean).train()
    x = torch.randn(shape, dtype=torch.float64)
    for step in range(2):
        grad = torch.randn_like(plain(x.clone()).detach())
        plain.load_state_dict(planned.module.state_dict())  # undo that forward's statistics
        expected = _step(plain, x, grad, seed=step)
        got = _step(planned, x, grad, seed=step)
        for a, b in zip(expected[:2] + tuple(expected[2]), got[:2] + tuple(got[2]), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(plain.state_dict().values(), planned.module.state_dict().values(),
                        strict=True):
            assert torch.equal(a, b)
        for p in (*plain.parameters(), *planned.parameters()):
            p.grad = None


def test_keeps_the_input_and_the_products_outputs_only():
    """Kept: the input and each convolution's output (sizes from the shapes); a plain run
    keeps those and the normalised and activated tensors besides."""
    torch.manual_seed(0)
    model = conv_chain(inplace=False).train()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    kept = saved_storages(Selective(model), x)
    element = x.element_size()
    expected = sorted([x.numel() * element, 2 * 8 * 8 * 8 * element, 2 * 8 * 8 * 8 * element,
                       2 * 4 * 4 * 4 * element])
    assert sorted(s.nbytes for s in kept) == expected
    assert saved_tensor_bytes(model, x) > 2 * sum(expected)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_backward_runs_no_product_forward_again():
    """Backward recomputes batch norm and the activations but no convolution: it runs the
    convolutions' backward only."""
    model = Selective(conv_chain()).train()
    out = model(torch.randn(2, 3, 8, 8, requires_grad=True))
    ops = _Ops()
    with ops:
        out.sum().backward()
    assert "convolution" not in ops.names and "convolution_backward" in ops.names
    assert "native_batch_norm" in ops.names or "_native_batch_norm_legit" in ops.names


def test_a_later_write_into_a_kept_output_is_refused():
    """A segment whose output is a view of a convolution's output (kept: the view reads it),
    changed in place after the segment: backward refuses (autograd's check of saved tensors;
    the recomputation would read the changed values)."""
    conv = nn.Conv2d(3, 4, 3)
    out = selectively_recomputed(lambda x: conv(x).flatten(1),
                                 torch.randn(1, 3, 5, 5, requires_grad=True))
    out.relu_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 5, 1)), (2, 3, 6, 6)),
    (lambda: nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3)), (4, 6)),
], ids=["conv", "linear"])
def test_a_product_output_nothing_reads_is_not_kept(make, shape):
    """A segment ending in a product (a convolution, a linear layer) keeps its input and the
    products' outputs that the recomputation reads, not the last one: nothing reads it again
    (its backward reads its input). Written into after the segment (ReLU in place), the
    gradients are still those of the plain segment, in float64 bit for bit."""
    torch.manual_seed(0)
    plain = make().double().train()
    planned = Selective(copy.deepcopy(plain)).train()
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    first = plain[0](x)
    kept = saved_storages(planned, x)
    assert sorted(s.nbytes for s in kept) == sorted([x.numel() * 8, first.numel() * 8])
    grads = []
    for model in (plain, planned):
        out = model(x).relu_()
        grads.append(torch.autograd.grad(out.square().sum(), [x, *model.parameters()]))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_a_forward_that_changes_is_refused():
    """The recomputation must run the products the forward ran."""
    calls = []
    a = torch.randn(3, 3, requires_grad=True)

    def run(x):
        calls.append(1)
        if len(calls) == 1:
            return torch.mm(x, a).relu()
        return torch.bmm(x[None], a[None])[0].relu()

    out = selectively_recomputed(run, torch.randn(2, 3, requires_grad=True))
    with pytest.raises(RuntimeError, match="same operations each time"):
        out.sum().backward()


def test_no_grad_and_eval_run_plainly():
    model = Selective(conv_chain()).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(x.clone()), model.module(x.clone()))


def test_products_are_the_flop_counters_operations():
    aten = torch.ops.aten
    assert is_product(aten.convolution.default) and is_product(aten.mm.default)
    assert not is_product(aten.native_batch_norm.default)
    assert not is_product(aten.relu_.default)


def test_backward_twice_with_retain_graph():
    """A second backward through the same graph recomputes again and adds the same
    gradients."""
    torch.manual_seed(0)
    model = Selective(conv_chain(inplace=False).double()).train()
    model.module[6].p = 0.0  # dropout off: the two backward passes must agree exactly
    out = model(torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True))
    grad = torch.randn_like(out)
    out.backward(grad, retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    out.backward(grad)
    for once, twice in zip(first, (p.grad for p in model.parameters()), strict=True):
        assert torch.equal(2 * once, twice)


@pytest.mark.parametrize("make", [conv_chain, lambda: nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3, padding=1),
    nn.BatchNorm2d(4), nn.LeakyReLU(0.1, inplace=True))], ids=["conv_bn_relu", "relu_on_conv"])
def test_under_torch_compile(make):
    """Compiled (``aot_eager``, float64): Dynamo traces no custom dispatch modes, so the segment
    takes PyTorch's selective checkpointing there; gradients and running statistics equal
    the plain segment's eager ones, bit for bit."""
    torch.manual_seed(0)
    plain = make().double().train()
    for module in plain:
        if isinstance(module, nn.Dropout):
            module.p = 0.0  # eager and compiled code draw different masks
    planned = Selective(copy.deepcopy(plain)).train()
    compiled = torch.compile(planned, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = torch.autograd.grad(plain(xa).square().sum(), [xa, *plain.parameters()])
    got = torch.autograd.grad(compiled(xb).square().sum(), [xb, *planned.parameters()])
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(plain.buffers(), planned.buffers(), strict=True):
        assert torch.equal(a, b)
    torch._dynamo.reset()
