"""iabn.convert on small hand-made models: each safety rule, both results (module swap and
graph module), exact saved bytes, and equality with the original model (float64)."""

import copy
import json
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from iabn.conversion import ConversionWarning, TrainEvalGraphModule
from iabn.memory import saved_tensor_bytes

from helpers import activation_names, param_for

N, C, H, W = 2, 8, 5, 5
ACT = N * C * H * W * 8     # one float64 activation of the norm's shape
VEC = C * 8                 # one float64 per-channel vector
INPUT = N * 3 * H * W * 8   # the model's input, saved by the first convolution

# Lossless conversion computes the same float64 operations in another order; the largest
# difference measured on these models is 5.7e-14 (outputs and gradients): 1e-12 is ~17x that.
TOL = 1e-12


def _x(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, H, W, dtype=torch.float64, generator=generator)


def _run(model, x, training):
    """Output and gradients (input, then parameters by name) in one mode, fixed randomness."""
    model.train(training)
    x = x.clone().requires_grad_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        out = model(x)
    names, weights = zip(*model.named_parameters(), strict=True)
    ramp = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * ramp).sum(), [x, *weights], allow_unused=True)
    return out.detach(), dict(zip(["input", *names], grads, strict=True))


def assert_same_model(original, converted, x):
    """Outputs, gradients and updated running statistics equal in train and eval mode."""
    original, converted = copy.deepcopy(original), copy.deepcopy(converted)
    for training in (True, False):
        expected_out, expected_grads = _run(original, x, training)
        out, grads = _run(converted, x, training)
        assert (out - expected_out).abs().max() <= TOL
        assert grads.keys() == expected_grads.keys()
        for name, g in grads.items():
            if expected_grads[name] is None:  # unused in this mode (an auxiliary head)
                assert g is None, name
                continue
            assert (g - expected_grads[name]).abs().max() <= TOL, name
    expected, got = original.state_dict(), converted.state_dict()
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.allclose(got[key].double(), value.double(), rtol=0, atol=TOL), key


class ConvNormAct(nn.Module):
    """conv -> norm -> activation -> conv: the pattern that goes in place."""

    def __init__(self, act=None):
        super().__init__()
        self.conv1 = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = act if act is not None else nn.LeakyReLU(0.01)
        self.conv2 = nn.Conv2d(C, 4, 1)

    def forward(self, x):
        return self.conv2(self.act(self.bn(self.conv1(x))))


def _randomise(model):
    """Non-trivial weights and statistics, so that a wrong parametrisation shows."""
    g = torch.Generator().manual_seed(3)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.weight.data = torch.rand(module.weight.shape, generator=g) + 0.5
            module.bias.data = torch.randn(module.bias.shape, generator=g)
            module.running_mean.data = torch.randn(module.running_mean.shape, generator=g)
            module.running_var.data = torch.rand(module.running_var.shape, generator=g) + 0.5
    return model.double()


def test_in_place_where_the_input_is_used_once_exact_bytes_and_equal_outputs(analysis):
    model = _randomise(ConvNormAct())
    x = _x()
    converted, report = iabn.convert(model, x)
    assert type(converted) is ConvNormAct and report.result == "modules swapped"
    assert isinstance(converted.bn, iabn.InPlaceABN) and isinstance(converted.act, nn.Identity)
    assert converted.bn.activation == "leaky_relu" and converted.bn.activation_param == 0.01
    (row,) = report.rows
    assert (row.name, row.decision) == ("bn", "InPlaceABN")
    # before: the norm's input, its two statistics vectors, and the activation's input;
    # after: the output alone (the next convolution saves that same storage) and two vectors.
    assert (row.saved_before, row.saved_after) == (2 * ACT + 2 * VEC, ACT + 2 * VEC)
    # whole model: the input (conv1), the above, and conv2's input (the activation's output)
    assert report.saved_before == INPUT + 3 * ACT + 2 * VEC
    assert report.saved_after == INPUT + ACT + 2 * VEC
    assert report.saved_after == saved_tensor_bytes(copy.deepcopy(converted).train(), x)
    assert_same_model(model, converted, x)


def test_the_model_given_is_not_modified(analysis):
    model = _randomise(ConvNormAct())
    before = copy.deepcopy(model.state_dict())
    iabn.convert(model, _x())
    assert isinstance(model.bn, nn.BatchNorm2d) and isinstance(model.act, nn.LeakyReLU)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert model.training


def test_converted_model_statistics_are_not_advanced_by_the_measurements(analysis):
    model = _randomise(ConvNormAct())
    converted, _ = iabn.convert(model, _x())
    assert int(converted.bn.num_batches_tracked) == int(model.bn.num_batches_tracked) == 0
    assert torch.equal(converted.bn.running_mean, model.bn.running_mean)


class TwoBranches(nn.Module):
    """The norm's input also feeds a second branch: it must survive the norm."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.01)
        self.side = nn.Conv2d(C, C, 1)

    def forward(self, x):
        h = self.conv(x)
        return self.act(self.bn(h)) + self.side(h)


class Residual(nn.Module):
    """``layer(h) + h``: the misuse that an in-place layer would silently get wrong."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.ELU(0.5)

    def forward(self, x):
        h = self.conv(x)
        return self.act(self.bn(h)) + h


def test_a_norm_input_saved_by_another_branch_gets_abn(analysis):
    """h feeds the norm and a convolution, which saves h for backward: a layer that keeps only
    its output would save nothing, so the norm gets ABN (which does not invert)."""
    model = _randomise(TwoBranches())
    x = _x()
    converted, report = iabn.convert(model, x)
    (row,) = report.rows
    assert row.decision == "ABN" and "also used by 1 other operation" in row.reason
    assert "'side' also saves it for backward" in row.reason
    assert type(converted.bn) is iabn.ABN
    assert row.saved_after == row.saved_before
    assert_same_model(model, converted, x)


@pytest.mark.parametrize("activation", [nn.ELU(0.5), nn.LeakyReLU(0.2), nn.SiLU()],
                         ids=["elu", "leaky_relu", "silu"])
def test_a_norm_input_read_again_by_an_addition_gets_the_output_only_layer(activation,
                                                                            analysis):
    """layer(h) + h: the addition saves nothing, so the output-only layer (a new output, only
    it kept) frees h, which ABN (and BatchNorm + activation) keep: one activation less."""
    model = _randomise(Residual())
    model.act = activation
    x = _x()
    converted, report = iabn.convert(model, x)
    (row,) = report.rows
    assert row.decision == "InPlaceABN(overwrite_input=False)", row
    assert "also used by 1 other operation" in row.reason
    assert type(converted.bn) is iabn.InPlaceABN and not converted.bn.overwrite_input
    # before: h, two statistics vectors, the activation's input (SiLU: its input too);
    # after: the output and the vectors (SiLU: and the branch bits, one per element packed
    # eight to a byte: 1/64 of a float64 activation)
    bits = ACT // 64 if isinstance(activation, nn.SiLU) else 0
    assert (row.saved_before, row.saved_after) == (2 * ACT + 2 * VEC, ACT + 2 * VEC + bits)
    assert report.saved_after == saved_tensor_bytes(copy.deepcopy(converted).train(), x)
    assert_same_model(model, converted, x)


class InputNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.act = nn.LeakyReLU(0.2)
        self.head = nn.Conv2d(3, 2, 1)  # the norm's output is not the model's (see below)

    def forward(self, x):
        return self.head(self.act(self.bn(x)))


def test_a_norm_on_the_model_input_is_not_in_place(analysis):
    model = _randomise(InputNorm())
    x = _x()
    converted, report = iabn.convert(model, x)
    assert report.rows[0].decision == "ABN" and "model's input" in report.rows[0].reason
    x_before = x.clone()
    assert_same_model(model, converted, x)
    assert torch.equal(x, x_before)


class WrittenLater(nn.Module):
    """The norm's output is modified in place afterwards (``+=``): the in-place layer keeps
    that output for backward, so it must not be chosen."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.extra = nn.Conv2d(3, C, 3, padding=1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        y += self.extra(x)
        return y


def test_a_norm_output_written_in_place_later_is_left_alone(analysis):
    model = _randomise(WrittenLater())
    x = _x()
    converted, report = iabn.convert(model, x)
    (row,) = report.rows
    written = "iadd" if analysis == "torch.fx" else ".add_()"  # `+=` as each way records it
    assert row.decision == "untouched" and f"{written} writes into the norm's output" in row.reason
    assert type(converted.bn) is nn.BatchNorm2d


class FunctionalRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.head = nn.Conv2d(C, 4, 1)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))))


class FunctionalLeakyRelu(FunctionalRelu):
    def forward(self, x):
        return self.head(F.leaky_relu(self.bn(self.conv(x)), 0.01))


class SharedRelu(nn.Module):
    """One ReLU module used after two norms and after the sum (as torchvision's ResNet)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, C, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(C), nn.BatchNorm2d(C)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.relu(self.bn2(self.conv2(h))) + h)


class SharedReluLeaky(SharedRelu):
    """What policy='leaky_relu' makes of SharedRelu: the ReLUs after the norms become
    LeakyReLU(0.01); the one after the sum stays."""

    def forward(self, x):
        h = F.leaky_relu(self.bn1(self.conv1(x)), 0.01)
        return F.relu(F.leaky_relu(self.bn2(self.conv2(h)), 0.01) + h)


LEAKY_REFERENCES = {FunctionalRelu: FunctionalLeakyRelu, SharedRelu: SharedReluLeaky}


@pytest.mark.parametrize("model_class", [FunctionalRelu, SharedRelu])
def test_activations_without_own_module_give_a_graph_module(model_class):
    model = _randomise(model_class())
    x = _x()
    converted, report = iabn.convert(model, x)
    assert isinstance(converted, TrainEvalGraphModule)
    assert report.result == "torch.fx GraphModule"
    assert all(row.decision == "ABN" for row in report.rows)  # ReLU: lossless keeps it exact
    assert_same_model(model, converted, x)


@pytest.mark.parametrize("model_class", [ConvNormAct, FunctionalRelu, SharedRelu])
def test_policy_leaky_relu_equals_the_model_with_leaky_relu(model_class):
    """The reference is the original model with every ReLU function/module replaced by
    LeakyReLU(0.01): plain PyTorch layers, built without iabn."""
    model = _randomise(model_class(nn.ReLU()) if model_class is ConvNormAct else model_class())
    x = _x()
    converted, report = iabn.convert(model, x, policy="leaky_relu")
    assert {row.decision for row in report.rows} == {"InPlaceABN"}
    assert all(row.saved_after < row.saved_before for row in report.rows)
    assert "changed the model" in report.notes[0]
    reference = copy.deepcopy(model)
    if model_class is ConvNormAct:
        reference.act = nn.LeakyReLU(0.01)
    else:
        reference.__class__ = LEAKY_REFERENCES[model_class]
    assert_same_model(reference, converted, x)


def test_zero_weights_keep_the_model_under_lossless_and_go_in_place_under_leaky_relu(analysis):
    model = _randomise(ConvNormAct())
    with torch.no_grad():
        model.bn.weight[0] = 0.0  # e.g. a zero-initialised last norm of a residual branch
    x = _x()
    converted, report = iabn.convert(model, x)
    assert report.rows[0].decision == "ABN" and "|weight| < eps" in report.rows[0].reason
    assert_same_model(model, converted, x)
    _, report = iabn.convert(model, x, policy="leaky_relu")
    assert report.rows[0].decision == "InPlaceABN" and "clamped" in report.rows[0].reason


class AuxiliaryHead(nn.Module):
    """Forward branches on ``self.training`` (like Inception's auxiliary classifier)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.1)
        self.aux_conv = nn.Conv2d(C, C, 1)
        self.aux_bn = nn.BatchNorm2d(C)
        self.head = nn.Conv2d(C, 2, 1)  # a returned norm output stays untouched

    def forward(self, x):
        h = self.act(self.bn(self.conv(x)))
        if self.training:
            h = h + F.relu(self.aux_bn(self.aux_conv(h)))
        return self.head(h)


def test_train_and_eval_graphs_both_hold():
    model = _randomise(AuxiliaryHead())
    x = _x()
    converted, report = iabn.convert(model, x)
    assert isinstance(converted, TrainEvalGraphModule)  # F.relu has no module to swap
    decisions = {row.name: row.decision for row in report.rows}
    assert decisions == {"bn": "InPlaceABN", "aux_bn": "ABN"}
    assert_same_model(model, converted, x)
    copied = copy.deepcopy(converted)  # deepcopy keeps both graphs
    assert_same_model(model, copied, x)
    assert "aux_conv" not in copied.eval().code and "aux_conv" in copied.train().code


@pytest.mark.parametrize("model_class", [FunctionalRelu, SharedRelu, AuxiliaryHead])
def test_a_recorded_run_swaps_modules_only(model_class, monkeypatch):
    """Without fx's graph there is no code to generate: an activation that is a function call
    or a shared module stays, the norm is decided without it, and the class is kept."""
    from analysis_paths import force_recording

    force_recording(monkeypatch)
    model = _randomise(model_class())
    x = _x()
    converted, report = iabn.convert(model, x, policy="leaky_relu")
    assert type(converted) is model_class and report.result == "modules swapped"
    assert "torch.fx cannot trace" in report.result_reason
    assert "input shape 2x3x5x5" in report.result_reason
    unfused = {row.name for row in report.rows if "is not fused" in row.reason}
    assert unfused == ({"aux_bn"} if model_class is AuxiliaryHead
                       else {row.name for row in report.rows})
    assert all("only modules can be swapped" in row.reason for row in report.rows
               if row.name in unfused)
    assert_same_model(model, converted, x)


def test_converted_state_dict_loads_into_the_original_class():
    model = _randomise(SharedRelu())
    converted, _ = iabn.convert(model, _x(), policy="leaky_relu")
    fresh = SharedRelu().double()
    fresh.load_state_dict(converted.state_dict())  # strict: the same keys
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_pickling_a_graph_module_keeps_the_current_graph():
    model = _randomise(FunctionalRelu())
    converted, _ = iabn.convert(model, _x())
    restored = pickle.loads(pickle.dumps(converted.eval()))
    with torch.no_grad():
        assert torch.equal(restored(_x(1)), converted(_x(1)))


class DataDependent(nn.Module):
    """Not traceable by torch.fx: control flow on tensor values."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), nn.BatchNorm2d(C), nn.ReLU(),
                                  nn.Conv2d(C, C, 1), nn.BatchNorm2d(C), nn.LeakyReLU())

    def forward(self, x):
        y = self.body(x)
        return y if y.sum() > 0 else -y


def test_forwards_branching_on_values_are_converted_by_parts_with_a_warning():
    """The model reads a value; its body does not: the body is converted on its own, its
    output counted as written by the code around it (the last norm stays)."""
    model = _randomise(DataDependent())
    x = _x()
    with pytest.warns(ConversionWarning, match=r"cannot trace DataDependent .* reads tensor "
                      r"values into Python \(bool\(\) at test_convert.py:\d+\)"):
        converted, report = iabn.convert(model, x)
    assert report.result == "converted by parts" and "part by part: body" in report.result_reason
    assert [row.decision for row in report.rows] == ["ABN", "untouched"]
    assert "returned to the code around this part" in report.rows[1].reason
    assert type(converted.body[1]) is iabn.ABN and isinstance(converted.body[2], nn.Identity)
    assert report.rows[0].saved_before == report.rows[0].saved_after == 2 * ACT + 2 * VEC
    assert_same_model(model, converted, x)
    assert_same_model(model, converted, -x)  # the other path


def test_shared_norm_modules_are_left_alone(analysis):
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, C, 1), nn.Conv2d(C, C, 1)
            self.bn = nn.BatchNorm2d(C)

        def forward(self, x):
            return self.bn(self.conv2(self.bn(self.conv1(x))))

    _, report = iabn.convert(_randomise(Twice()), _x())
    assert report.rows[0].decision == "untouched" and "more than once" in report.rows[0].reason


def test_batchnorm1d_and_3d(analysis):
    model = nn.Sequential(nn.Linear(6, C), nn.BatchNorm1d(C), nn.LeakyReLU(0.01),
                          nn.Linear(C, 2)).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    converted, report = iabn.convert(_randomise(model), x)
    assert report.rows[0].decision == "InPlaceABN"
    assert_same_model(model, converted, x)
    model = nn.Sequential(nn.Conv3d(3, C, 1), nn.BatchNorm3d(C), nn.ELU(),
                          nn.Conv3d(C, 2, 1)).double()
    x = torch.randn(2, 3, 2, 3, 3, dtype=torch.float64)
    converted, report = iabn.convert(_randomise(model), x)
    assert report.rows[0].decision == "InPlaceABN" and converted[1].activation == "elu"
    assert_same_model(model, converted, x)


def test_report_table_and_json():
    _, report = iabn.convert(_randomise(SharedRelu()), _x(), policy="leaky_relu")
    data = json.loads(report.to_json())
    assert [row["name"] for row in data["rows"]] == ["bn1", "bn2"]
    assert data["counts"] == {"InPlaceABN": 2}
    assert data["saved_before"] == report.saved_before
    text = str(report)
    assert "bn1" in text and "InPlaceABN" in text and "whole model" in text
    assert "policy leaky_relu; 2 layers: 2 InPlaceABN" in text
    _, report = iabn.convert(_randomise(ConvNormAct()), _x())
    assert "policy lossless; 1 layer: 1 InPlaceABN" in str(report)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match=r"policy='relu'.*'lossless'"):
        iabn.convert(ConvNormAct(), _x(), policy="relu")
    with pytest.raises(TypeError, match="example_input must be a tensor"):
        iabn.convert(ConvNormAct(), [1, 2])
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        iabn.convert(lambda x: x, _x())


def test_progress_lines():
    lines = []
    iabn.convert(_randomise(ConvNormAct()), _x(), progress=lines.append)
    assert lines[0].startswith("tracing") and any("counting" in line for line in lines)


def test_no_warning_for_traceable_models():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        iabn.convert(_randomise(ConvNormAct()), _x())


def test_sync_batchnorm_becomes_the_synchronised_layers():
    """Single process: nn.SyncBatchNorm and iabn's synchronised layers both compute the local
    batch norm (iabn warns that nothing is synchronised)."""
    model = _randomise(nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1), nn.SyncBatchNorm(C), nn.LeakyReLU(0.01),
        nn.Conv2d(C, C, 1), nn.SyncBatchNorm(C), nn.ReLU(), nn.Conv2d(C, 2, 1)))
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the synchronised layer's one-process note
        converted, report = iabn.convert(model, x)
        assert [row.decision for row in report.rows] == ["InPlaceABNSync", "untouched"]
        assert type(converted[1]) is iabn.InPlaceABNSync
        assert "ABNSync cannot compute ReLU" in report.rows[1].reason
        assert_same_model(model, converted, x)


class FunctionalActivation(nn.Module):
    """conv -> norm -> ``function(x, *args, **kwargs)`` -> conv."""

    def __init__(self, function, *args, **kwargs):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, C, 3, padding=1), nn.Conv2d(C, 4, 1)
        self.bn = nn.BatchNorm2d(C)
        self.function, self.args, self.kwargs = function, args, kwargs

    def forward(self, x):
        return self.conv2(self.function(self.bn(self.conv1(x)), *self.args, **self.kwargs))


def _every_form():
    """(id, model builder, activation name, parameter): each module and function form
    of every activation in the registry (iabn.kernels.activations), so that an activation
    added there is converted without a change here. A module form with a condition is built
    as the record's own torch module (``nn.GELU(approximate="tanh")``), a function form with
    its required keywords."""
    from iabn.kernels.activations import ACTIVATIONS

    cases = []
    for name in activation_names():
        record = ACTIVATIONS[name]
        param = param_for(name)
        for form in record.forms.modules:
            kwargs = {record.parameter.attribute: param} if record.parameter else {}
            if form.accepts is not None:
                build = lambda r=record, p=param: ConvNormAct(r.torch_module(p))  # noqa: E731
            else:
                build = lambda cls=form.cls, kw=kwargs: ConvNormAct(cls(**kw))  # noqa: E731
            cases.append((f"{name}-{form.cls.__name__}", build, name, param))
        for form in record.forms.functions:
            if form.function in (torch.relu_, F.leaky_relu_, F.elu_):
                continue  # the in-place functions: the same recognition as their pairs
            args = (param,) if record.parameter else ()
            cases.append((f"{name}-{form.display}",
                          lambda f=form.function, a=args, kw=dict(form.required):
                          FunctionalActivation(f, *a, **kw), name, param))
    return cases


@pytest.mark.parametrize(("build", "name", "param"),
                         [pytest.param(*case[1:], id=case[0])
                          for case in _every_form()])
def test_every_activation_form_of_the_registry_is_fused(build, name, param):
    model = _randomise(build())
    x = _x()
    converted, report = iabn.convert(model, x)
    (row,) = report.rows
    expected = "ABN" if name == "relu" else "InPlaceABN"  # relu: lossless keeps it exact
    assert row.decision == expected, row
    layer = converted.get_submodule("bn") if hasattr(converted, "bn") else None
    if layer is not None and isinstance(layer, iabn.ABN):
        assert layer.activation == name
        if name in ("leaky_relu", "elu"):
            assert layer.activation_param == pytest.approx(param)
    assert_same_model(model, converted, x)
