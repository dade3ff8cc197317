"""Lean selective recomputation (iabn.planning.selective, ``lean=True``): the products whose
output is larger than their input (expansions) are run again in backward rather than kept.

Checked against the same segment run plainly in float64 (bit for bit: the same operations
on the same values), the kept bytes against the tensors' own sizes, the output sizes the
rule reads from shapes against the outputs the operations make, and what backward runs.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from iabn.memory import compiled_saved_bytes, saved_storages
from iabn.planning.cost import OpCounter
from iabn.planning.planner import Planner, plan
from iabn.planning.selective import _product_sizes, is_expansion, is_product
from iabn.planning.wrappers import SELECTIVE, SELECTIVE_LEAN
from test_selective import Selective, assert_trains_as_the_plain_segment


def bottleneck_chain():
    """conv 3->4 (expansion), a 1x1 reduction 16->4 after a 4->16 expansion, a strided
    1x1 16->8 (not an expansion: fewer elements out), batch norms and activations."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 4, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 16, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.1, inplace=True),
        nn.Conv2d(16, 8, 1, stride=2), nn.ReLU(),
    )


def mlp():
    return nn.Sequential(nn.Linear(6, 24), nn.GELU(), nn.Linear(24, 6), nn.Tanh(),
                         nn.Linear(6, 24), nn.ReLU())


@pytest.mark.parametrize("make, shape", [(bottleneck_chain, (2, 3, 8, 8)), (mlp, (5, 6)),
                                         (mlp, (2, 3, 6))], ids=["convs", "linear", "linear_3d"])
def test_training_is_bitwise_the_plain_segment(make, shape):
    """float64, two steps: outputs, input and parameter gradients and running statistics
    equal those of the segment run plainly."""
    assert_trains_as_the_plain_segment(make, shape, lean=True)


def test_keeps_the_input_and_the_outputs_of_products_that_do_not_expand():
    """Kept: the input and the outputs of the 16->4 reduction and of the strided 16->8
    convolution (8 channels at 4x4); selective recomputation keeps the expansions' outputs
    besides (3->4 and both 4->16)."""
    torch.manual_seed(0)
    model = bottleneck_chain().train()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    per = 2 * 8 * 8 * x.element_size()  # bytes per channel of an 8x8 map
    lean = sorted(s.nbytes for s in saved_storages(Selective(model, lean=True), x))
    full = sorted(s.nbytes for s in saved_storages(Selective(model, lean=False), x))
    assert lean == sorted([3 * per, 4 * per, 2 * per])
    assert full == sorted([3 * per, 4 * per, 16 * per, 4 * per, 16 * per, 2 * per])


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.products = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_product(func):
            self.products.append((func, args, out))
        return out


def test_backward_runs_the_expansions_again_and_no_other_product():
    model = Selective(bottleneck_chain(), lean=True).train()
    out = model(torch.randn(2, 3, 8, 8, requires_grad=True))
    ops = _Ops()
    with ops:
        out.sum().backward()
    channels = [args[1].shape[0] for func, args, _ in ops.products
                if func == torch.ops.aten.convolution.default]
    assert channels == [4, 16, 16]  # 3->4, 4->16, 4->16; not 16->4, not 16->8


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.Conv1d(3, 5, 3, stride=2, padding=1, dilation=2), (2, 3, 11)),
    (lambda: nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 0), groups=2), (2, 4, 9, 7)),
    (lambda: nn.Conv2d(4, 4, 3, padding="same", dilation=2), (1, 4, 6, 6)),
    (lambda: nn.Conv3d(2, 3, 2, stride=2), (1, 2, 5, 4, 6)),
    (lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1, groups=2),
     (2, 4, 5, 5)),
    (lambda: nn.ConvTranspose1d(3, 6, 4, stride=3, dilation=2), (2, 3, 7)),
    (lambda: nn.Linear(5, 7), (3, 5)),
    (lambda: nn.Linear(5, 7, bias=False), (2, 3, 5)),
    (lambda: _Matmul(), (2, 3, 4)),
])
def test_output_sizes_from_shapes_are_those_the_products_make(make, shape):
    """The rule reads an output's size from the shapes before the operation runs (PyTorch's
    selective checkpointing asks then): it equals the size of what each product makes,
    forward and backward's recomputation alike."""
    torch.manual_seed(0)
    module = make()
    ops = _Ops()
    with ops:
        module(torch.randn(shape, requires_grad=True)).sum().backward()
    assert ops.products
    for func, args, out in ops.products:
        sizes = _product_sizes(func, args)
        if sizes is None:  # a product the rule does not know (kept, never run again)
            assert not is_expansion(func, args)
            continue
        assert sizes[1] == out.numel(), func
        assert is_expansion(func, args) == (out.numel() > sizes[0])


class _Matmul(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 4, 9))
        self.b = nn.Parameter(torch.randn(2, 3, 9))

    def forward(self, x):
        return torch.baddbmm(self.b, x, self.w) + torch.bmm(x, self.w)


def test_the_cost_counter_marks_the_expansions():
    model = bottleneck_chain().train()
    counter = OpCounter()
    with counter:
        model(torch.randn(2, 3, 8, 8))
    ops = [op for count in counter.counts.values() for op in count.ops if op.product]
    assert [op.expansion for op in ops] == [True, True, False, True, False]


@pytest.mark.slow
def test_compiled_lean_saves_less_and_trains_as_eager():
    """Under torch.compile (``aot_eager``, float64) the partitioner honours the marks: the
    compiled graphs save less than selective recomputation's (the expansions' outputs are
    recomputed), and the gradients are the plain segment's, bit for bit."""
    torch.manual_seed(0)
    plain = bottleneck_chain().double().train()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    saved = {lean: compiled_saved_bytes(Selective(copy.deepcopy(plain), lean=lean).train(), x)
             for lean in (False, True)}
    per = 2 * 8 * 8 * x.element_size()
    assert saved[False] - saved[True] >= 2 * 16 * per
    planned = Selective(copy.deepcopy(plain), lean=True).train()
    compiled = torch.compile(planned, backend="aot_eager", fullgraph=True)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = torch.autograd.grad(plain(xa).square().sum(), [xa, *plain.parameters()])
    got = torch.autograd.grad(compiled(xb).square().sum(), [xb, *planned.parameters()])
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    torch._dynamo.reset()


class Expanding(nn.Module):
    """Two chains of bottlenecks whose last convolution expands (w -> 4w): where a compiled
    model's recomputation costs only the products it runs again."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.body = nn.Sequential(*[nn.Sequential(
            nn.Conv2d(16, 4, 1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 16, 1), nn.BatchNorm2d(16), nn.ReLU()) for _ in range(3)])
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def test_the_compiled_time_model_prefers_lean_runs_and_bytes_stay_exact():
    """With ``compiled=True`` a selective run costs only the products it runs again: at the
    bytes of the leanest selective plan, the plan recomputes leanly (a full recomputation
    would run every product again), and its measured bytes are the predicted ones, within
    the budget."""
    torch.manual_seed(0)
    model, x = Expanding().train(), torch.randn(2, 3, 8, 8)
    planner = Planner(model, (x,), "lossless", ("recompute",), compiled=True)
    lean = [c for c in planner.candidates if c.choice == SELECTIVE_LEAN]
    full = {c.units: c for c in planner.candidates if c.choice == SELECTIVE}
    assert lean and all(_bytes_of(planner, c) < _bytes_of(planner, full[c.units]) for c in lean)
    budget = 1 + min(_bytes_of(planner, c) for c in lean)
    _, report = plan(model, x, budget, allow=("recompute",), compiled=True)
    assert report.measured == report.predicted <= budget
    assert report.counts.get(SELECTIVE_LEAN, 0) >= 1


def _bytes_of(planner, candidate):
    """Bytes of the plan that runs ``candidate`` and keeps every other unit."""
    chosen = [planner.candidates.index(candidate)] + [
        i for i, c in enumerate(planner.candidates)
        if c.choice == "keep" and not set(c.units) & set(candidate.units)]
    return planner.problem().saved_bytes(chosen)


def test_compiled_must_be_a_bool():
    with pytest.raises(TypeError, match="compiled must be True or False"):
        plan(nn.Linear(2, 2), torch.randn(1, 2), 1.0, compiled="yes")
