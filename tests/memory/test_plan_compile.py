"""torch.compile of a planned model: every choice that recomputes (in place or not, selective),
in a chain, on a single module and on a run across containers (the traced forward), compiles
with ``fullgraph=True`` and trains as the eager planned model does (float64, ``aot_eager``:
the graphs Inductor would compile, without the code generation)."""

import copy
import functools
import pickle

import pytest
import torch
from torch import nn

import iabn
from iabn.planning import traced_plan
from iabn.planning.planner import Planner
from iabn.planning.wrappers import (
    INPLACE,
    INPLACE_RECOMPUTE,
    KEEP,
    RECOMPUTE,
    SELECTIVE,
    SELECTIVE_LEAN,
)
from test_plan import Block


def leaky():  # the blocks' activation (tests/memory/test_plan.py's residual Block)
    return nn.LeakyReLU(0.1)


class Net(nn.Module):
    """A stem chain of conv-bn-act units, a stage chain of two residual blocks, pooling and a
    head: chains, single modules, and a traced chain from the stem to the pool."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.LeakyReLU(0.1), nn.Conv2d(8, 8, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(8), nn.LeakyReLU(0.1))
        self.stage = nn.Sequential(Block(8, 8, act=leaky), Block(8, 16, 2, act=leaky))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.stage(self.stem(x))), 1))


@functools.cache
def _planner():
    """(Its candidates measured once: assemble copies the model.)"""
    torch.manual_seed(0)
    model = Net().double()
    for m in model.modules():  # affine parameters away from their defaults
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    return Planner(model, (x,), "lossless", ("inplace", "recompute"))


def _plan(planner, choices):
    """The planned model of ``choices``: ``(unit names, choice)`` per block."""
    units = {u.name: u.index for u in planner.units}
    blocks = [(tuple(units[n] for n in names), choice) for names, choice in choices]
    offered = {(c.units, c.choice) for c in planner.candidates}
    assert all(b in offered for b in blocks), sorted(offered)
    return planner.assemble(blocks, real=True)


def _train_step(model, x):
    """Outputs, input and parameter gradients and buffers after one training step."""
    x = x.clone().requires_grad_()
    out = model(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *model.parameters()])
    return [out.detach(), *grads, *model.buffers()]


# Each plan: (unit names, choice) per block; units left out run as given.
PLANS = {
    # chains: the stem in place, the stage recomputed in place, the head (a single module)
    # recomputed
    "chains": [(("stem.0-2",), INPLACE), (("stem.3-5",), INPLACE),
               (("stage.0", "stage.1"), INPLACE_RECOMPUTE), (("head",), RECOMPUTE)],
    "selective_chain": [(("stem.0-2", "stem.3-5"), SELECTIVE),
                        (("stage.0", "stage.1"), INPLACE_RECOMPUTE)],
    # the stem's first convolution expands (3 -> 8 channels): run again in backward
    "lean_chain": [(("stem.0-2", "stem.3-5"), SELECTIVE_LEAN), (("head",), SELECTIVE)],
    # runs across containers: the model runs its traced forward
    "traced": [(("stem.3-5", "stage.0", "stage.1"), RECOMPUTE)],
    "traced_in_place": [(("stem.0-2",), INPLACE),
                        (("stem.3-5", "stage.0", "stage.1"), INPLACE_RECOMPUTE),
                        (("pool",), KEEP), (("head",), SELECTIVE)],
}

# In-place layers run iabn's kernels in eager mode and ATen operations when compiled (the
# same math): with the CPU reference kernels every plan here measured bit for bit (0.0); the
# bound leaves room for a kernel backend that rounds differently (IABN_BACKEND), about 50
# float64 ulps of the values here. Without in-place layers: bit for bit, always.
IN_PLACE_BOUND = 1e-14


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in ("chains", "selective_chain") else n
    for n in PLANS])
def test_a_compiled_plan_trains_as_the_eager_plan(name):
    """fullgraph=True on a fresh deep copy (nothing cached by an eager call), at a batch the
    planner never ran: outputs, gradients and running statistics equal the eager plan's."""
    planner = _planner()
    planned = _plan(planner, PLANS[name])
    assert (traced_plan(planned) is not None) == name.startswith("traced")
    eager, compiled = copy.deepcopy(planned).train(), copy.deepcopy(planned).train()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    torch._dynamo.reset()
    try:
        expected = _train_step(eager, x)
        got = _train_step(torch.compile(compiled, backend="aot_eager", fullgraph=True), x)
    finally:
        torch._dynamo.reset()
    worst = max((a - b).abs().max().item() for a, b in zip(expected, got, strict=True))
    in_place = any(isinstance(m, iabn.InPlaceABN) for m in planned.modules())
    assert in_place == any(c in (INPLACE, INPLACE_RECOMPUTE) for _, c in PLANS[name])
    assert worst <= (IN_PLACE_BOUND if in_place else 0.0)


def test_an_unpickled_traced_plan_compiles():
    """Code made by ``exec`` does not pickle: an unpickled traced plan makes it again on its
    first call, which the compiler leaves to Python (it cannot trace torch.fx's tracer), then
    runs compiled."""
    planner = _planner()
    planned = _plan(planner, PLANS["traced"])
    clone = pickle.loads(pickle.dumps(planned)).train()
    assert traced_plan(clone).code is None
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    torch._dynamo.reset()
    try:
        expected = _train_step(copy.deepcopy(planned).train(), x)
        got = _train_step(torch.compile(clone, backend="aot_eager"), x)
    finally:
        torch._dynamo.reset()
    assert traced_plan(clone).code is not None
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
