"""iabn.plan: exact bytes for every plan, budgets respected, the solver's optimum, exact
training, the report, errors.

Bytes are checked against iabn.memory.saved_tensor_bytes of the returned (or assembled) model,
counted independently of the planner's per-unit accounting; the solver's optimum against an
enumeration of every plan, each measured; training against the model as given in float64.
"""

import copy
import io
import json
import math
import pickle

import pytest
import torch
from torch import nn

import iabn
from iabn.conversion import TrainEvalGraphModule
from iabn.memory import saved_tensor_bytes
from iabn.planning import PlannedSequential, PlanReport, module_plan, traced_plan
from iabn.planning.planner import Planner
from iabn.planning.solver import Option, solve
from iabn.planning.wrappers import (
    INPLACE,
    INPLACE_RECOMPUTE,
    KEEP,
    OFFLOAD,
    RECOMPUTE,
    SELECTIVE,
)


class Block(nn.Module):
    """A basic residual block; ``shared`` uses one activation module three times (then
    iabn.convert returns a graph module for it)."""

    def __init__(self, c_in, c_out, stride=1, act=nn.LeakyReLU, shared=False):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.act1 = act()
        self.act2 = self.act1 if shared else act()
        self.down = (nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                   nn.BatchNorm2d(c_out)) if stride != 1 or c_in != c_out
                     else None)

    def forward(self, x):
        out = self.act1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act2(out + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    """A stem chain, two blocks (one with a shortcut convolution), pooling in forward and a
    linear head called once."""

    def __init__(self, act=nn.LeakyReLU):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  act(), nn.MaxPool2d(2))
        self.layer1 = nn.Sequential(Block(8, 8, act=act, shared=True),
                                    Block(8, 16, 2, act=act))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.layer1(self.stem(x)).mean((2, 3)))


def tiny_vgg(act=nn.ReLU):
    """A plain chain: conv-bn-act(-pool) units, and a classifier with dropout. With ReLU, the
    first unit's activation and the next convolution keep the same storage."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act(inplace=True),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), act(inplace=True), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 10))


class DenseLayer(nn.Module):
    def __init__(self, c_in, growth):
        super().__init__()
        self.norm = nn.BatchNorm2d(c_in)
        self.act = nn.ReLU()
        self.conv = nn.Conv2d(c_in, growth, 3, padding=1, bias=False)

    def forward(self, x):
        return self.conv(self.act(self.norm(x)))


class TinyDense(nn.Module):
    """Dense layers called from a ModuleList on the concatenation of all features before:
    single units outside any chain, whose inputs other code keeps using."""

    def __init__(self, growth=4):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.layers = nn.ModuleList(DenseLayer(8 + i * growth, growth) for i in range(3))
        self.norm = nn.BatchNorm2d(8 + 3 * growth)
        self.head = nn.Linear(8 + 3 * growth, 10)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = torch.cat([x, layer(x)], 1)
        return self.head(torch.relu(self.norm(x)).mean((2, 3)))


class StagedNet(nn.Module):
    """A stem chain and two stage chains called one after the other in forward, pooling, a
    flatten (a function) and a head: a traced chain runs from the stem to the pool."""

    def __init__(self, act=nn.LeakyReLU, stage1_blocks=2):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  act())
        self.stage1 = nn.Sequential(*(Block(8, 8, act=act) for _ in range(stage1_blocks)))
        self.stage2 = nn.Sequential(Block(8, 16, 2, act=act))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.pool(self.stage2(self.stage1(self.stem(x))))
        return self.head(torch.flatten(x, 1))


MODELS = {
    "resnet": (TinyResNet, (2, 3, 8, 8)),
    "staged": (StagedNet, (2, 3, 8, 8)),
    "resnet_relu": (lambda: TinyResNet(nn.ReLU), (2, 3, 8, 8)),
    "vgg": (tiny_vgg, (2, 3, 8, 8)),
    "vgg_leaky": (lambda: tiny_vgg(nn.LeakyReLU), (2, 3, 8, 8)),
    "dense": (TinyDense, (2, 3, 6, 6)),
}
#: Models only the enumeration of every plan uses: StagedNet with one block in stage1 has runs
#: across its three chains (330 of its 1080 plans) at a sixth of the full model's 6066 plans.
ENUMERATED = {"staged_short": (lambda: StagedNet(stage1_blocks=1), (2, 3, 8, 8))}


def build(name, dtype=torch.float32):
    factory, shape = MODELS[name] if name in MODELS else ENUMERATED[name]
    torch.manual_seed(0)
    model = factory().to(dtype)
    for m in model.modules():  # running statistics and affine parameters away from defaults
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model, torch.randn(*shape, dtype=dtype)


def measured(model, x, copy_first=True):
    """iabn.memory's count of one training forward; buffers and modes left as they were
    (unless ``copy_first`` is false: then the model is a throwaway)."""
    if copy_first:
        model = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return saved_tensor_bytes(model.train(), x)


def covers(planner):
    """Every plan: each unit covered by exactly one candidate (runs are consecutive units)."""
    by_start = {}
    for i, c in enumerate(planner.candidates):
        by_start.setdefault(c.units[0], []).append(i)

    def extend(unit):
        if unit == len(planner.units):
            yield []
            return
        for i in by_start.get(unit, []):
            for rest in extend(planner.candidates[i].units[-1] + 1):
                yield [i, *rest]

    return list(extend(0))


_PLANNERS = {}


def planner_for(name, policy="leaky_relu"):
    """A planner of the model (in place, recompute), every plan, and each plan's bytes as
    iabn.memory counts them on the model the plan assembles (cached for the module)."""
    if (name, policy) not in _PLANNERS:
        model, x = build(name)
        planner = Planner(model, (x,), policy, ("inplace", "recompute"))
        plans = covers(planner)
        counted = [measured(planner.assemble(
            [(planner.candidates[i].units, planner.candidates[i].choice) for i in plan],
            real=True), x, copy_first=False) for plan in plans]
        _PLANNERS[name, policy] = (planner, x, plans, counted)
    return _PLANNERS[name, policy]


# ---------------------------------------------------------------- exact bytes


@pytest.mark.parametrize("name", [
    # staged: 6066 plans, 2 min on 2 cores; staged_short has the same kinds of runs in 1080
    # (32 s on the 2-core VM); resnet (10 s quiet) and resnet_relu (9 s) too run in the slow
    # run, and vgg_leaky (14 s loaded): vgg has the same kinds of choices (in place, runs of
    # units) in the default one, dense the kinds that keep their input
    pytest.param("resnet", marks=pytest.mark.slow),
    pytest.param("resnet_relu", marks=pytest.mark.slow),
    pytest.param("staged_short", marks=pytest.mark.slow),
    pytest.param("staged", marks=[pytest.mark.slow, pytest.mark.sweep]),
    # dense (7 s quiet) too: the solver's and the planner's other tests run it by default
    "vgg", pytest.param("vgg_leaky", marks=pytest.mark.slow),
    pytest.param("dense", marks=pytest.mark.slow)])
def test_predicted_bytes_equal_measured_for_every_plan(name):
    planner, _, plans, counted = planner_for(name)
    problem = planner.problem()
    # every choice appears, and runs of several units too: the enumeration is not trivial
    choices = {planner.candidates[i].choice for plan in plans for i in plan}
    assert {KEEP, RECOMPUTE} <= choices
    if name != "dense":  # the dense layers' norms read their input: nothing goes in place
        assert {INPLACE, INPLACE_RECOMPUTE} <= choices
        assert any(len(planner.candidates[i].units) > 1 for plan in plans for i in plan)
    assert len(plans) > 50
    if name.startswith("staged"):  # runs across the stage chains, through the traced forward
        assert any(planner._crosses(planner.candidates[i].units) for plan in plans
                   for i in plan if planner.candidates[i].choice != KEEP)
    for plan, count in zip(plans, counted, strict=True):
        assert problem.saved_bytes(plan) == count, [
            (planner.candidates[i].units, planner.candidates[i].choice) for i in plan]


# resnet and resnet_relu (19 s of the default run's CPU time on 2 cores) in the slow run
@pytest.mark.parametrize("name", [pytest.param("resnet", marks=pytest.mark.slow),
                                  pytest.param("resnet_relu", marks=pytest.mark.slow),
                                  "vgg", "vgg_leaky", "dense"])
def test_keep_everything_is_the_model_as_given(name):
    planner, x, _, _ = planner_for(name)
    keep = [i for i, c in enumerate(planner.candidates) if c.choice == KEEP]
    model, _ = build(name)
    assert planner.problem().saved_bytes(keep) == measured(model, x) == planner.as_given


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("budget", [pytest.param(1.0, marks=pytest.mark.slow),
                                    pytest.param(0.6, marks=pytest.mark.slow), 0.35])
def test_plans_fit_the_budget_and_are_measured_exactly(name, budget):
    model, x = build(name)
    try:
        planned, report = iabn.plan(model, x, budget, policy="leaky_relu")
    except ValueError as error:  # the dense layers cannot reach 0.6: they keep their inputs
        assert f"budget={budget}" in str(error) and name == "dense"
        smallest = int(str(error).split("give budget >= ")[1].split()[0])
        assert smallest > budget * measured(model, x)
        return
    limit = math.floor(budget * measured(model, x))
    assert report.as_given == measured(model, x)
    assert report.predicted == report.measured == measured(planned, x) <= limit
    assert report.budget == limit
    # the rows and the rest add up to the total
    assert sum(r.kept_after for r in report.rows) + report.rest_bytes == report.predicted
    assert sum(r.kept_before for r in report.rows) + report.rest_bytes == report.as_given


# both budgets (10 s each on 2 cores) in the slow run: the meta device's byte counts are the
# same code as the planner's other models', which run by default
@pytest.mark.slow
@pytest.mark.parametrize("budget", [0.7, 0.45])
def test_torchvision_resnet18_on_meta(budget):
    """A meta model: bytes without memory (in place needs the weights' values: not there)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).to("meta")
    x = torch.empty(2, 3, 32, 32, device="meta")
    planned, report = iabn.plan(model, x, budget)
    assert report.predicted == report.measured == measured(planned, x)
    assert report.measured <= budget * report.as_given
    # recomputed one way or another (which way follows the timing calibration)
    assert sum(report.counts.get(c, 0) for c in ("recompute", "selective",
                                                 "selective-lean")) >= 1
    assert list(planned.state_dict()) == list(model.state_dict())
    assert any("iabn.convert reads the norms' weights" in n for n in report.notes)


def test_torchvision_resnet18_in_place_blocks_become_graph_modules():
    """Its blocks share one ReLU module: converted in place each becomes a graph module,
    which keeps the keys; bytes measured on the real model equal the prediction."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 16, 16)
    planned, report = iabn.plan(model, x, 0.9, policy="leaky_relu", allow=("inplace",))
    assert report.counts.get("inplace", 0) >= 1
    assert report.predicted == report.measured == measured(planned, x) <= 0.9 * report.as_given
    assert any(isinstance(m, TrainEvalGraphModule) for m in planned.modules())
    assert list(planned.state_dict()) == list(model.state_dict())


# ---------------------------------------------------------------- the solver


# resnet (30 s on the loaded 2 cores) and resnet_relu (8 s) in the slow run: vgg, vgg_leaky
# and dense have the same choices between in place, recompute and keep on smaller enumerations
@pytest.mark.parametrize("name", [pytest.param("resnet", marks=pytest.mark.slow),
                                  pytest.param("resnet_relu", marks=pytest.mark.slow),
                                  "vgg", "vgg_leaky", "dense"])
def test_solver_finds_the_optimum_of_an_enumeration(name):
    """The least predicted time among all plans whose measured bytes fit, for budgets from
    generous to the smallest any plan reaches."""
    planner, _, plans, counted = planner_for(name)
    problem = planner.problem()
    smallest = min(counted)
    for fraction in (0.95, 0.8, 0.65, 0.5, 0.4, 0.0):
        budget = max(int(fraction * planner.as_given), smallest)
        best = min(problem.cost(p) for p, b in zip(plans, counted, strict=True) if b <= budget)
        solution = solve(problem, budget, time_limit=10.0)
        assert solution.status == "optimal"
        assert problem.cost(solution.chosen) == pytest.approx(best, rel=1e-9, abs=1e-12)
        assert counted[plans.index(sorted(solution.chosen, key=lambda i: (
            planner.candidates[i].units[0])))] <= budget


def test_out_of_reach_budget_names_the_smallest_reachable():
    model, x = build("resnet")
    _, _, _, counted = planner_for("resnet")
    with pytest.raises(ValueError, match=r"budget=0\.01 .*out of reach.*give budget >= ") as e:
        iabn.plan(model, x, 0.01, policy="leaky_relu")
    smallest = int(str(e.value).split("give budget >= ")[1].split()[0])
    assert smallest == min(counted)  # the least over every plan, each measured
    # that figure is reachable, exactly
    planned, report = iabn.plan(model, x, smallest, policy="leaky_relu")
    assert report.measured == measured(planned, x) == smallest
    assert report.smallest == smallest
    with pytest.raises(ValueError, match=f"give budget >= {smallest}"):
        iabn.plan(model, x, smallest - 1, policy="leaky_relu")


def test_a_model_without_units_is_returned_as_given():
    model, x = nn.Linear(3, 3), torch.randn(2, 3)
    _, report = iabn.plan(model, x, 1.0)
    assert report.rows == [] and report.measured == measured(model, x) == report.as_given
    assert any(n.startswith("no units") for n in report.notes)
    with pytest.raises(ValueError, match=f"give budget >= {report.as_given}"):
        iabn.plan(model, x, 0.5)


def test_offload_alone_on_cpu_reaches_nothing():
    model, x = build("vgg")
    with pytest.raises(ValueError, match=r"allow=\('offload',\).*or allow more choices"):
        iabn.plan(model, x, 0.5, allow=("offload",))
    _, report = iabn.plan(model, x, 1.0, allow=("offload",))
    assert any("offload is not a candidate on cpu" in n for n in report.notes)
    assert report.counts == {"keep": len(report.rows)}


def test_time_limit_returns_the_best_plan_found(monkeypatch):
    """When the solver stops at the limit with a plan, the report says so; the plan still
    fits and is measured exactly."""
    from scipy import optimize

    real_milp = optimize.milp
    calls = []

    def stopped(*args, **kwargs):
        result = real_milp(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the least-time solve: stopped by "the time limit" with a plan
            result.status = 1
            result.mip_dual_bound = 0.0
        return result

    monkeypatch.setattr(optimize, "milp", stopped)
    model, x = build("resnet")
    planned, report = iabn.plan(model, x, 0.5, policy="leaky_relu", time_limit=5.0)
    assert report.solver_status == "time limit"
    assert any("not proven optimal" in n for n in report.notes)
    assert report.measured == measured(planned, x) <= 0.5 * report.as_given


def test_time_limit_without_a_faster_plan_returns_the_plan_of_fewest_bytes(monkeypatch):
    from scipy import optimize

    real_milp = optimize.milp
    calls = []

    def stopped(*args, **kwargs):
        result = real_milp(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:  # the least-time solve: stopped before it found any plan
            result.status, result.x = 1, None
        return result

    monkeypatch.setattr(optimize, "milp", stopped)
    model, x = build("resnet")
    planned, report = iabn.plan(model, x, 0.5, policy="leaky_relu", time_limit=5.0)
    assert report.solver_status == "time limit"
    assert any("plan of fewest bytes" in n for n in report.notes)
    assert report.measured == measured(planned, x) == report.smallest


def test_a_tiny_time_limit_is_handled():
    model, x = build("vgg_leaky")
    try:
        planned, report = iabn.plan(model, x, 0.5, policy="leaky_relu", time_limit=1e-6)
    except ValueError as error:
        assert "time_limit=1e-06" in str(error) and "more seconds" in str(error)
    else:
        assert report.measured == measured(planned, x) <= 0.5 * report.as_given


# ---------------------------------------------------------------- training is exact


def _step(model, x, target):
    out = model(x)
    loss = nn.functional.cross_entropy(out, target)
    loss.backward()
    return out.detach()


def _largest_difference(reference, planned, x, steps=2):
    """Train both for ``steps`` SGD steps on the same data (the same dropout masks); the
    largest difference of outputs, gradients and state (running statistics included), and
    whether ``num_batches_tracked`` counted each step once in both."""
    target = torch.arange(x.shape[0]) % 10
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, planned)]
    worst = 0.0
    for step in range(steps):
        outputs = []
        for m, opt in zip((reference, planned), optimizers, strict=True):
            opt.zero_grad()
            torch.manual_seed(step)
            outputs.append(_step(m, x + step, target))
        worst = max(worst, (outputs[0] - outputs[1]).abs().max().item())
        grads = [dict(m.named_parameters()) for m in (reference, planned)]
        assert grads[0].keys() == grads[1].keys()
        for key, p in grads[0].items():
            worst = max(worst, (p.grad - grads[1][key].grad).abs().max().item())
        for opt in optimizers:
            opt.step()
    state = [m.state_dict() for m in (reference, planned)]
    assert state[0].keys() == state[1].keys()
    counted = True
    for key, value in state[0].items():
        if key.endswith("num_batches_tracked"):
            counted &= value.item() == state[1][key].item() == steps
        else:
            worst = max(worst, (value - state[1][key]).abs().max().item())
    return worst, counted


# In-place layers differ from batch norm + activation by rounding: the largest difference
# measured over these models and plans is 6.7e-16 (float64); the bound is 15x that.
# Recomputation replays the same operations: bit-identical.
IN_PLACE_BOUND = 1e-14


@pytest.mark.parametrize("name", ["resnet", "staged", "vgg", "vgg_leaky", "dense"])
@pytest.mark.parametrize("budget", ["smallest", 0.7])
def test_training_a_planned_model_is_exact(name, budget):
    """float64, lossless: outputs, every gradient and the running statistics of two
    training steps equal the model's as given."""
    model, x = build(name, torch.float64)
    reference = copy.deepcopy(model)
    limit = report_smallest(model, x) if budget == "smallest" else budget
    planned, report = iabn.plan(model, x, limit, policy="lossless")
    assert set(report.counts) != {"keep"}
    worst, counted = _largest_difference(reference, planned, x)
    assert counted
    if "inplace" in report.counts or "inplace+recompute" in report.counts:
        assert worst <= IN_PLACE_BOUND
    else:
        assert worst == 0.0


def test_every_choice_trains_exactly():
    """A plan with each choice at once, including a run recomputed in place."""
    model, x = build("resnet", torch.float64)
    planner = Planner(model, (x,), "lossless", ("inplace", "recompute"))
    by_choice = {}
    for c in planner.candidates:
        by_choice.setdefault((c.units, c.choice), c)
    stem, block0, block1, head = range(4)
    blocks = [((stem,), INPLACE), ((block0, block1), INPLACE_RECOMPUTE), ((head,), RECOMPUTE)]
    assert all(b in by_choice for b in blocks), sorted(by_choice)
    planned = planner.assemble(blocks, real=True)
    assert planner.problem().saved_bytes(
        [planner.candidates.index(by_choice[b]) for b in blocks]) == measured(planned, x)
    worst, counted = _largest_difference(copy.deepcopy(model), planned, x, steps=3)
    assert counted and 0.0 < worst <= IN_PLACE_BOUND


def _staged_planner(dtype=torch.float64):
    model, x = build("staged", dtype)
    planner = Planner(model, (x,), "lossless", ("recompute",))
    units = {u.name: u.index for u in planner.units}
    return model, x, planner, units


def test_a_run_across_stage_chains_trains_exactly_and_keeps_the_model():
    """stem..stage2.0 recomputed as one segment (it crosses three Sequential chains): the
    model runs its traced forward, keeps its class, keys, parameter names and module paths,
    its bytes are the prediction and training is bit for bit the model's as given."""
    model, x, planner, units = _staged_planner()
    assert [planner.units[u].name for u in planner.segmentation.traced.units] == [
        "stem.0-2", "stage1.0", "stage1.1", "stage2.0", "pool"]
    run = tuple(units[n] for n in ("stem.0-2", "stage1.0", "stage1.1", "stage2.0"))
    chosen = [i for i, c in enumerate(planner.candidates)
              if (c.units, c.choice) in ((run, RECOMPUTE), ((units["pool"],), RECOMPUTE),
                                         ((units["head"],), KEEP))]
    assert len(chosen) == 3, sorted((c.units, c.choice) for c in planner.candidates)
    planned = planner.assemble([(planner.candidates[i].units, planner.candidates[i].choice)
                                for i in chosen], real=True)
    assert planner.problem().saved_bytes(chosen) == measured(planned, x) < planner.as_given
    assert type(planned) is StagedNet and traced_plan(planned) is not None
    assert not any(isinstance(m, PlannedSequential) for m in planned.modules())
    assert list(planned.state_dict()) == list(model.state_dict())
    assert [(n, type(m)) for n, m in planned.named_modules()] == [
        (n, type(m)) for n, m in model.named_modules()]
    assert [n for n, _ in planned.named_parameters()] == [n for n, _ in model.named_parameters()]
    # copies and pickles run the same plan, with their own modules
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()(x)
        for clone in (copy.deepcopy(planned), pickle.loads(pickle.dumps(planned))):
            assert traced_plan(clone) is not traced_plan(planned)
            clone.eval()
            assert torch.equal(clone(x), expected)
            clone.stage1[0].conv1.weight.zero_()
            assert not torch.equal(clone(x), expected)
    worst, counted = _largest_difference(copy.deepcopy(model), planned, x, steps=3)
    assert counted and worst == 0.0


def test_a_selective_run_across_stage_chains_keeps_less_than_its_parts():
    """stem..pool recomputed selectively as one run (across three chains) keeps less than the
    selective runs of each chain together (the tensors between the chains are kept by
    neither: each is recomputed from a kept convolution output), at the same predicted
    time; its bytes are the prediction and training is bit for bit the model's as given."""
    model, x, planner, units = _staged_planner()
    names = ("stem.0-2", "stage1.0", "stage1.1", "stage2.0", "pool")
    whole = tuple(units[n] for n in names)
    parts = [(units["stem.0-2"],), (units["stage1.0"], units["stage1.1"]),
             (units["stage2.0"],), (units["pool"],)]
    problem = planner.problem()

    def plan(runs):
        found = {(c.units, c.choice): i for i, c in enumerate(planner.candidates)}
        chosen = [found.get((run, SELECTIVE), found.get((run, RECOMPUTE))) for run in runs]
        return [*chosen, found[(units["head"],), KEEP]]

    one, split = plan([whole]), plan(parts)
    assert planner.candidates[one[0]].choice == SELECTIVE
    assert problem.saved_bytes(one) < problem.saved_bytes(split)
    planned = planner.assemble([(planner.candidates[i].units, planner.candidates[i].choice)
                                for i in one], real=True)
    assert problem.saved_bytes(one) == measured(planned, x)
    worst, counted = _largest_difference(copy.deepcopy(model), planned, x, steps=2)
    assert counted and worst == 0.0


def test_a_plan_without_a_run_across_containers_is_built_as_before():
    """A run inside one stage: the stages' own forwards run (no traced forward)."""
    model, x, planner, units = _staged_planner()
    run = (units["stage1.0"], units["stage1.1"])
    planned = planner.assemble([(run, RECOMPUTE)], real=True)
    assert traced_plan(planned) is None and "forward" not in planned.__dict__
    assert isinstance(planned.stage1, PlannedSequential)
    planned_full, report = iabn.plan(model, x, 1.0)
    assert traced_plan(planned_full) is None
    assert not any("crosses containers" in n for n in report.notes)


@pytest.mark.slow  # 8 s on 2 cores; the staged planner's crossing runs are in the default run
def test_the_smallest_plan_of_a_staged_model_crosses_and_says_so():
    model, x, _, _ = _staged_planner(torch.float32)
    planned, report = iabn.plan(model, x, report_smallest(model, x), allow=("recompute",))
    assert traced_plan(planned) is not None
    assert any(".." in row.segment for row in report.rows), report.table()
    assert any("crosses containers" in n and "stem, stage1, stage2" in n
               for n in report.notes), report.notes
    assert report.predicted == report.measured == measured(planned, x)


class _Branching(StagedNet):
    """Control flow on a tensor's value: fx cannot trace it."""

    def forward(self, x):
        x = self.stage1(self.stem(x))
        if x.sum() > 0:
            x = x * 2
        return self.head(torch.flatten(self.pool(self.stage2(x)), 1))


class _ModeDependent(StagedNet):
    """A branch on the training mode: the traced graph would freeze one branch."""

    def forward(self, x):
        x = self.stage1(self.stem(x))
        if not self.training:
            x = x * 2
        return self.head(torch.flatten(self.pool(self.stage2(x)), 1))


class _Reused(StagedNet):
    """Each stage's output has another user (or goes through a function): no path of unit
    calls crosses from one container into the next."""

    def forward(self, x):
        x = self.stem(x)
        x = self.stage1(x) + x.mean()
        y = self.stage2(x)
        return self.head(torch.flatten(self.pool(y) + y.mean(), 1))


@pytest.mark.parametrize("cls, why", [(_Branching, "does not trace with torch.fx"),
                                      (_ModeDependent, "differs between training and eval"),
                                      (_Reused, "no path of unit calls across containers")])
def test_forwards_that_do_not_give_a_traced_chain_plan_as_before(cls, why):
    torch.manual_seed(0)
    model, x = cls(), torch.randn(2, 3, 8, 8)
    planner = Planner(model, (x,), "lossless", ("recompute",))
    assert planner.segmentation.traced is None
    assert why in planner.segmentation.traced_note
    assert not any(planner._crosses(c.units) for c in planner.candidates)
    planned, report = iabn.plan(model, x, report_smallest(model, x), allow=("recompute",))
    assert traced_plan(planned) is None
    assert any(n.startswith("runs do not cross containers") and why in n
               for n in report.notes), report.notes
    assert report.predicted == report.measured == measured(planned, x)


def report_smallest(model, x):
    """The smallest reachable budget (from the error's message), to force every choice."""
    with pytest.raises(ValueError, match="give budget >= ") as error:
        iabn.plan(model, x, 1, policy="lossless")
    return int(str(error.value).split("give budget >= ")[1].split()[0])


def test_running_statistics_update_once_per_forward():
    model, x = build("vgg")
    planned, report = iabn.plan(model, x, report_smallest(model, x), allow=("recompute",))
    assert report.counts.get("recompute")
    planned.train()
    planned(x).sum().backward()  # backward recomputes
    for name, value in planned.state_dict().items():
        if name.endswith("num_batches_tracked"):
            assert value.item() == 1, name


# ---------------------------------------------------------------- the model and its copy


def test_the_model_given_is_not_modified():
    model, x = build("resnet")
    before = copy.deepcopy(model.state_dict())
    structure = repr(model)
    model.eval()
    iabn.plan(model, x, 0.5, policy="leaky_relu")
    assert repr(model) == structure and not model.training
    assert all(not m.training for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_planned_model_keeps_keys_names_classes_and_mode():
    """Recomputed single modules keep their class (isinstance checks, such as an optimizer's
    no-decay group for norm layers, see them), keys, names and mode."""
    model, x = build("dense")
    model.eval()
    planned, report = iabn.plan(model, x, report_smallest(model, x), policy="leaky_relu")
    assert not planned.training and all(not m.training for m in planned.modules())
    assert list(planned.state_dict()) == list(model.state_dict())
    assert [n for n, _ in planned.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert [(n, type(m)) for n, m in planned.named_modules()] == [
        (n, type(m)) for n, m in model.named_modules()]
    # the state dict of the model as given loads into it and back
    planned.load_state_dict(model.state_dict())
    model.load_state_dict(planned.state_dict())
    recomputed = {n: module_plan(m).choice for n, m in planned.named_modules()
                  if module_plan(m) is not None}
    assert "recompute" in recomputed.values(), report.table()
    assert all(module_plan(m) is None for m in model.modules())
    norm = planned.norm  # a norm layer recomputed on its own stays a norm layer
    assert isinstance(norm, nn.BatchNorm2d) and module_plan(norm).choice == "recompute"
    # copies and pickles keep the plan and run
    for clone in (copy.deepcopy(planned), pickle.loads(pickle.dumps(planned))):
        assert module_plan(clone.norm).choice == "recompute"
        assert module_plan(clone.norm) is not module_plan(norm)
        assert clone(x).shape == (2, 10)
    buffer = io.BytesIO()
    torch.save(planned, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=False)(x).shape == (2, 10)


def test_hooks_of_a_recomputed_module_run_once():
    model, x = build("dense")
    planned, _ = iabn.plan(model, x, report_smallest(model, x), allow=("recompute",))
    layer = planned.layers[0]
    # recomputed whole or selectively, as the timing calibration decides
    assert module_plan(layer).choice in ("recompute", "selective", "selective-lean")
    calls = []
    layer.register_forward_hook(lambda *_: calls.append("forward"))
    layer.register_forward_pre_hook(lambda *_: calls.append("pre"))
    planned(x).sum().backward()
    assert calls == ["pre", "forward"]


def test_planned_sequential_keeps_indexing():
    model, x = build("vgg")
    planned, _ = iabn.plan(model, x, report_smallest(model, x), allow=("recompute",))
    assert isinstance(planned, PlannedSequential)
    assert isinstance(planned[0], nn.Conv2d) and len(planned) == len(model)


# ---------------------------------------------------------------- the report


def test_report_table_and_json():
    model, x = build("resnet")
    _, report = iabn.plan(model, x, 0.5, policy="leaky_relu")
    assert isinstance(report, PlanReport) and iabn.PlanReport is PlanReport
    text = str(report)
    assert "segment" in text and "measured" in text and "solver: optimal" in text
    for row in report.rows:
        assert row.segment in text
    data = json.loads(report.to_json())
    assert data["measured"] == report.measured and data["budget"] == report.budget
    assert [r["choice"] for r in data["rows"]] == [r.choice for r in report.rows]
    assert sum(r["saved"] for r in data["rows"]) == report.as_given - report.predicted
    assert data["speed"]["flops_per_s"] > 0
    # recomputation (whole or selective, as the timing calibration decides) costs time,
    # keeping costs none
    for row in report.rows:
        assert (row.predicted_ms > 0) == (row.choice in (
            "recompute", "inplace+recompute", "selective", "selective-lean"))


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("kwargs, match", [
    ({"budget": True}, "budget must be a number"),
    ({"budget": "half"}, "budget must be a number"),
    ({"budget": 0}, "budget=0: a number of bytes must be positive"),
    ({"budget": -5}, "budget=-5"),
    ({"budget": 1.5}, r"budget=1.5: a fraction .* must be in \(0, 1\]"),
    ({"budget": 0.0}, r"budget=0.0"),
    ({"budget": float("nan")}, r"budget=nan"),
    ({"policy": "fast"}, "policy='fast'"),
    ({"allow": ("inplace", "swap")}, "unknown choice 'swap'"),
    ({"allow": 3}, "allow must be"),
    ({"time_limit": 0}, "time_limit=0"),
    ({"time_limit": float("inf")}, "time_limit=inf"),
])
def test_bad_arguments_are_refused_before_anything_runs(kwargs, match):
    model, x = build("vgg")
    before = copy.deepcopy(model.state_dict())
    arguments = {"budget": 0.5, **kwargs}
    budget = arguments.pop("budget")
    with pytest.raises((ValueError, TypeError), match=match):
        iabn.plan(model, x, budget, **arguments)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_model_or_input():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        iabn.plan(lambda x: x, torch.randn(2, 3), 0.5)
    with pytest.raises(TypeError, match="example_input must be a tensor"):
        iabn.plan(nn.Linear(3, 3), (), 0.5)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_offload_on_cuda_is_measured_exactly():
    model, x = build("vgg")
    model, x = model.cuda(), x.cuda()
    planned, report = iabn.plan(model, x, 0.5, allow=("offload",))
    assert report.counts.get("offload")
    assert report.predicted == report.measured == measured(planned, x) <= 0.5 * report.as_given
    target = torch.arange(2, device="cuda")
    reference = copy.deepcopy(model)
    for m in (reference, planned):
        torch.manual_seed(0)
        _step(m, x, target)
    for (name, p), q in zip(reference.named_parameters(), planned.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_offloaded_units_run_exactly_on_cpu():
    """Offloading is no candidate on CPU (nothing to gain), but its wrappers run there: a
    single module and a chain unit offloaded keep nothing of their own in the count (what
    CUDA's planner records for them), their neighbours' storages still count, and training
    is bit for bit the model's as given."""
    for name, chosen in (("dense", ("layers.0", "layers.1")), ("vgg", ("3-7",))):
        model, x = build(name)
        planner = Planner(model, (x,), "lossless", ("recompute",))
        units = {u.name: u.index for u in planner.units}
        offloaded = [units[n] for n in chosen]
        planned = planner.assemble([((u,), OFFLOAD) for u in offloaded], real=True)
        problem = planner.problem()
        nothing = len(problem.options)
        problem.options += [Option((u,), 0.0, 0, frozenset(), KEEP, True) for u in offloaded]
        plan = [i for i, c in enumerate(planner.candidates)
                if c.choice == KEEP and c.units[0] not in offloaded]
        plan += list(range(nothing, nothing + len(offloaded)))
        assert problem.saved_bytes(plan) == measured(planned, x) < planner.as_given
        worst, counted = _largest_difference(copy.deepcopy(model), planned, x)
        assert counted and worst == 0.0
