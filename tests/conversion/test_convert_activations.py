"""iabn.convert on activations without a norm, whatever form they take: registry function
forms called in forward (``F.gelu``, ``F.silu``, ``F.mish``) become calls of iabn's in-place
layers where the graph is rewritten anyway, under the rules of their module forms; a
registry record without an in-place layer stays, with the reason, and never fails the
conversion; an activation that writes into its input is never given a layer that does not.

Every converted model is compared in float64 with the original (outputs and the gradients
of the input and every parameter, train and eval mode), and the saved bytes with the
models' own (iabn.memory.saved_tensor_bytes) and with what each function kept."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import iabn
from conversion_checks import assert_bytes_are_real, assert_same_model
from iabn.conversion import TrainEvalGraphModule
from iabn.kernels import activations as registry

N, C, H, W = 2, 8, 5, 5
#: elements of one activation of the MLP part (channels last)
ELEMENTS = N * H * W * C


def _x(seed=0):
    return torch.randn(N, 3, H, W, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def _rows(report):
    return {row.pattern: row for row in report.rows}


class Functions(nn.Module):
    """A norm whose activation is ``F.relu`` (fused: the result is a generated module), then
    an MLP whose activations are all functions."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.fc1, self.fc2, self.fc3, self.fc4, self.fc5 = (nn.Linear(C, C) for _ in range(5))

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).permute(0, 2, 3, 1)
        a = F.gelu(self.fc1(h))                       # fresh input, used once: in place
        b = F.gelu(self.fc2(a), approximate="tanh")   # the tanh form: InPlaceGELU("tanh")
        c = self.fc3(b)
        d = self.fc4(F.silu(c)) + c                   # c read again: output only
        return self.fc5(F.mish(d))                    # an addition's output: in place


def test_function_activations_become_layers_in_a_generated_module():
    model = Functions().double()
    x = _x()
    converted, report = iabn.convert(model, x)
    assert isinstance(converted, TrainEvalGraphModule)
    decisions = [(row.pattern, row.decision) for row in report.rows]
    assert decisions == [("BatchNorm2d -> F.relu", "ABN"), ("F.gelu", "InPlaceGELU"),
                         ("F.gelu", "InPlaceGELU"),
                         ("F.silu", "InPlaceSiLU(overwrite_input=False)"),
                         ("F.mish", "InPlaceMish")]
    layers = [converted.get_submodule(row.name) for row in report.rows[1:]]
    assert [type(layer) for layer in layers] == [iabn.InPlaceGELU, iabn.InPlaceGELU,
                                                 iabn.InPlaceSiLU, iabn.InPlaceMish]
    assert [layer.approximate for layer in layers[:2]] == ["none", "tanh"]
    assert set(converted.state_dict()) == set(model.state_dict())
    assert_same_model(model, converted, x)
    assert_bytes_are_real(model, converted, report, x)
    # each function kept its float64 input; each layer alone keeps one bit per element
    # (its output is the next linear layer's input, which that layer saves anyway)
    for row in report.rows[1:]:
        assert row.saved_before == ELEMENTS * 8, row
        assert row.saved_after == math.ceil(ELEMENTS / 8), row
    # the functions left as they are (activations=False): the model saves more
    _, norms_only = iabn.convert(model, x, activations=False)
    assert [r.decision for r in norms_only.rows[1:]] == ["untouched"] * 4
    assert all("activations=False" in r.reason for r in norms_only.rows[1:])
    freed = sum(r.saved_before - r.saved_after for r in report.rows[1:])
    assert norms_only.saved_after - report.saved_after == freed > 0


class FunctionRules(nn.Module):
    """``F.relu`` after the norm (a generated module), then a function activation whose input
    a product saves or whose output is written later."""

    def __init__(self, case):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.fc = nn.Linear(C, C)
        self.case = case

    def forward(self, x):
        h = self.fc(F.relu(self.bn(self.conv(x))).permute(0, 2, 3, 1))
        if self.case == "saved":
            return F.gelu(h) * h  # the product saves h: keeping only the output frees nothing
        y = F.silu(h)
        y.add_(1.0)  # the layer would keep its output for backward
        return y


@pytest.mark.parametrize("case, words", [("saved", "also save"), ("written", "writes into")])
def test_function_activations_follow_the_module_rules(case, words):
    model = FunctionRules(case).double()
    x = _x()
    converted, report = iabn.convert(model, x)
    assert isinstance(converted, TrainEvalGraphModule)
    (row,) = [row for row in report.rows if row.pattern.startswith("F.")]
    assert row.decision == "untouched" and words in row.reason
    assert_same_model(model, converted, x)


class KeepsFeatures(Functions):
    """Forward stores a value on the model: only its own forward reproduces that."""

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        self.features = h.detach()
        return self.fc2(F.gelu(self.fc1(h.permute(0, 2, 3, 1))))


def test_function_activations_stay_where_the_model_keeps_its_class(analysis):
    """A model that keeps a value outside the graph, and any recorded run, are converted by
    swapping modules: the functions stay, and the report's note says why."""
    for model in (KeepsFeatures().double(), Functions().double()):
        if analysis == "torch.fx" and type(model) is Functions:
            continue  # fx rewrites its graph (the test above)
        x = _x()
        converted, report = iabn.convert(model, x)
        assert type(converted) is type(model) and report.result == "modules swapped"
        assert not any(row.pattern.startswith("F.") for row in report.rows)
        (note,) = [n for n in report.notes if "written as functions" in n]
        assert "F.gelu" in note
        assert ("keep its class" if analysis == "torch.fx" else "only modules") in note
        assert_same_model(model, converted, x)


class Swish(nn.Module):
    """An activation module that no iabn layer subclasses."""

    def forward(self, x):
        return x * torch.sigmoid(x)


def swish(x):
    return x * torch.sigmoid(x)


torch.fx.wrap("swish")  # a call_function node in fx's graph


@pytest.fixture
def swish_record(monkeypatch):
    """A record added to the registry (SiLU's math, another module class and function) with
    no in-place layer and no change to the converter."""
    record = dataclasses.replace(
        registry.ACTIVATIONS[registry.SILU], name="swish_test", code=None,
        make_module=lambda param, inplace: Swish(),
        forms=registry.TorchForms(modules=(registry.ModuleForm(Swish),),
                                  functions=(registry.FunctionForm(swish, "swish"),)))
    monkeypatch.setitem(registry.ACTIVATIONS, record.name, record)
    monkeypatch.setitem(registry.MODULE_FORMS, Swish, ((record, record.forms.modules[0]),))
    monkeypatch.setitem(registry.FUNCTION_FORMS, swish,
                        ((record, record.forms.functions[0]),))
    for names in ("BRANCH_ACTIVATIONS", "IN_PLACE_ACTIVATIONS", "ALL_ACTIVATIONS"):
        monkeypatch.setattr(registry, names, (*getattr(registry, names), record.name))
    return record


class SwishModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.fc1, self.fc2, self.fc3 = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.act = Swish()

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).permute(0, 2, 3, 1)  # a generated module
        return self.fc3(swish(self.fc2(self.act(self.fc1(h)))))


def test_a_record_without_a_layer_stays_with_the_reason(swish_record):
    assert iabn.layers.activation.has_activation_layer(Swish()) is False
    model = SwishModel().double()
    x = _x()
    converted, report = iabn.convert(model, x)
    assert isinstance(converted, TrainEvalGraphModule)
    rows = _rows(report)
    for pattern in ("Swish", "swish"):
        assert rows[pattern].decision == "untouched"
        assert "no in-place layer of swish_test" in rows[pattern].reason
        assert rows[pattern].saved_after == rows[pattern].saved_before
    assert type(converted.act) is Swish
    assert_same_model(model, converted, x)
    assert_bytes_are_real(model, converted, report, x)


def test_a_record_without_a_layer_stays_in_a_module_swap(swish_record, analysis):
    model = nn.Sequential(nn.Linear(C, C), Swish(), nn.Linear(C, C)).double()
    x = torch.randn(N, C, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    (row,) = report.rows
    assert row.decision == "untouched" and "no in-place layer" in row.reason
    assert type(converted[1]) is Swish
    assert_same_model(model, converted, x)


class WritesItsInput(nn.Module):
    """An activation that writes into its input (``inplace=True``), whose input the
    addition reads afterwards: the addition reads the activation's output there (twice
    the activation; a layer that left its input as it is would make it the activation
    plus its input)."""

    def __init__(self, form):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.fc1, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)
        self.act = nn.SiLU(inplace=True)
        self.form = form

    def forward(self, x):
        h = self.fc1(F.relu(self.bn(self.conv(x))).permute(0, 2, 3, 1))
        a = self.act(h) if self.form == "module" else F.silu(h, inplace=True)
        return self.fc2(a + h)


@pytest.mark.parametrize("form", ["module", "function"])
def test_an_activation_writing_its_input_gets_no_output_only_layer(form):
    model = WritesItsInput(form).double()
    x = _x()
    converted, report = iabn.convert(model, x)
    (row,) = [row for row in report.rows if "SiLU" in row.pattern or "silu" in row.pattern]
    assert row.decision == "untouched" and "writes into its input" in row.reason
    assert_same_model(model, converted, x)


class Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.fc1, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(h)))


class ReadsValues(nn.Module):
    """fx cannot trace it and its forward reads a value; its body is converted on its own,
    where fx rewrites the graph."""

    def __init__(self):
        super().__init__()
        self.body = Body()

    def forward(self, x):
        y = self.body(x)
        return y if y.sum() > 0 else -y


def test_a_part_reports_its_function_activations():
    model = ReadsValues().double()
    x = _x()
    with pytest.warns(iabn.conversion.ConversionWarning):
        converted, report = iabn.convert(model, x)
    assert report.result == "converted by parts"
    assert isinstance(converted.body, TrainEvalGraphModule)
    rows = _rows(report)
    assert rows["BatchNorm2d -> F.relu"].name == "body.bn"
    assert rows["F.gelu"].decision == "InPlaceGELU"
    assert type(converted.get_submodule(rows["F.gelu"].name)) is iabn.InPlaceGELU
    assert_same_model(model, converted, x)
    assert_same_model(model, converted, -x)


def test_the_function_layer_is_a_module_fx_calls():
    """The generated module calls the new layer as a module in both graphs."""
    model = Functions().double()
    converted, report = iabn.convert(model, _x(), verify=False)
    names = {row.name for row in report.rows[1:]}
    for graph in converted.__dict__["_graphs"].values():
        called = {n.target for n in graph.nodes if n.op == "call_module"}
        assert names <= called
        assert not any(n.op == "call_function" and n.target in (F.gelu, F.silu, F.mish)
                       for n in graph.nodes)
    assert isinstance(converted.graph, fx.Graph)


def test_a_record_fuses_with_a_norm_without_a_converter_change(swish_record, analysis):
    """The batch norm's layer takes the record's activation by its registry name. Forward
    only: the in-place layer's backward reads the minimum from kernels/branch.py's table,
    which is built from the registry at import."""
    model = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), Swish(),
                          nn.Conv2d(C, 4, 1)).double()
    x = _x()
    converted, report = iabn.convert(model, x, verify=False)
    (row,) = report.rows
    assert (row.pattern, row.decision) == ("BatchNorm2d -> Swish", "InPlaceABN")
    assert converted[1].activation == "swish_test" and type(converted[2]) is nn.Identity
    assert row.saved_after < row.saved_before
    assert_bytes_are_real(model, converted, report, x)
    for training in (True, False):
        with torch.no_grad():
            expected = copy.deepcopy(model).train(training)(x)
            got = copy.deepcopy(converted).train(training)(x)
        assert (got - expected).abs().max() <= 1e-12 * expected.abs().max()
