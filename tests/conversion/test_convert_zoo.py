"""iabn.convert on real model families: torchvision's classification families with batch norm
(and ResNet-50 with group norm) and timm's TResNet, CSPDarkNet, ResNet, pre-activation
ResNet, RegNet and EfficientNet (residual adds, concatenations, SiLU, norms without
activation, shared activation modules).

Lossless conversion must give the original model's outputs and gradients in train and eval
mode (float64; the reference is the unconverted model itself, plain PyTorch layers), and a
backward pass through it must not raise in either mode: an unsafe in-place choice shows as an
autograd error or as a wrong gradient. The report's totals must be the bytes the converted
model really saves.
"""

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import iabn
from iabn.conversion.graph import is_layer_site
from iabn.memory import saved_tensor_bytes

torchvision = pytest.importorskip("torchvision", reason="the zoo needs torchvision")

# A difference counts relative to the reference tensor's largest magnitude, with a floor of
# FLOOR times the model's largest gradient: some gradients are mathematically zero (the bias of
# a norm whose output goes through a convolution into another norm, which removes any constant)
# and are float64 rounding noise of sums of huge terms (measured: 8e-7 where the model's largest
# gradient is 1e10, efficientnet_b0 at random init). The largest difference measured over the
# zoo is 7.4e-13 (efficientnet_v2_s; torch 2.14.1, CPU): the tolerance is ~13x that.
RELATIVE_TOLERANCE = 1e-11
FLOOR = 1e-14


def _torchvision(name, **kwargs):
    def build():
        model = torchvision.models.get_model(name, weights=None, **kwargs)
        if name == "vgg11_bn":  # a 25088x4096 classifier is all parameters, no norm
            model.classifier = nn.Linear(512 * 7 * 7, 10)
        return model
    return build


def _maxvit():
    """maxvit_t's architecture at a size for 32x32 inputs (maxvit_t needs 224x224: 26 s)."""
    from torchvision.models import MaxVit

    return MaxVit(input_size=(32, 32), stem_channels=8, partition_size=2, block_channels=[8, 16],
                  block_layers=[1, 1], head_dim=4, stochastic_depth_prob=0.2, num_classes=10)


def _example(name):
    """A factory of examples/zoo_models.py (the models of the figures in
    docs/usage/conversion.md that ``iabn memory`` builds from ``pkg.module:factory``)."""
    def build():
        path = Path(__file__).resolve().parents[2] / "examples" / "zoo_models.py"
        spec = importlib.util.spec_from_file_location("zoo_models", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return getattr(module, name)(num_classes=10)
    return build


def _timm(name):
    def build():
        timm = pytest.importorskip("timm", reason="timm is not installed")
        return timm.create_model(name, pretrained=False, num_classes=10)
    return build


# (builder, input size): the smallest member of each family with batch norm; sizes as small as
# the architecture allows.
TORCHVISION = {
    "resnet18": (_torchvision("resnet18", num_classes=10), 32),
    "resnext50_32x4d": (_torchvision("resnext50_32x4d", num_classes=10), 32),
    "densenet121": (_torchvision("densenet121", num_classes=10), 32),
    "efficientnet_b0": (_torchvision("efficientnet_b0", num_classes=10), 32),
    "googlenet": (_torchvision("googlenet", num_classes=10, aux_logits=True,
                               init_weights=False), 64),
    # the auxiliary head needs 299x299 inputs; googlenet's covers train/eval-only branches
    "inception_v3": (_torchvision("inception_v3", num_classes=10, aux_logits=False,
                                  init_weights=False), 75),
    "mnasnet0_5": (_torchvision("mnasnet0_5", num_classes=10), 32),
    "mobilenet_v2": (_torchvision("mobilenet_v2", num_classes=10), 32),
    "mobilenet_v3_small": (_torchvision("mobilenet_v3_small", num_classes=10), 32),
    "regnet_x_400mf": (_torchvision("regnet_x_400mf", num_classes=10), 32),
    "regnet_y_400mf": (_torchvision("regnet_y_400mf", num_classes=10), 32),
    "efficientnet_v2_s": (_torchvision("efficientnet_v2_s", num_classes=10), 32),
    "resnet50_group_norm": (_example("resnet50_group_norm"), 32),
    "shufflenet_v2_x0_5": (_torchvision("shufflenet_v2_x0_5", num_classes=10), 32),
    "vgg11_bn": (_torchvision("vgg11_bn"), 32),
    "maxvit": (_maxvit, 32),
}
TIMM = {
    "tresnet_m": (_timm("tresnet_m"), 32),
    "cspdarknet53": (_timm("cspdarknet53"), 32),
    "resnet18d": (_timm("resnet18d"), 32),
    "resnetv2_50": (_timm("resnetv2_50"), 32),
    "regnetx_002": (_timm("regnetx_002"), 32),
    "efficientnet_b0": (_timm("efficientnet_b0"), 32),
}
ZOO = {**{f"torchvision-{k}": v for k, v in TORCHVISION.items()},
       **{f"timm-{k}": v for k, v in TIMM.items()}}

# The in-place layers lossless conversion must make in the models of the figures in
# docs/usage/conversion.md (a conversion that silently leaves them alone fails here): SiLU with
# the saved branch bit, LeakyReLU, and norms without activation (the downsample norms of a
# ResNet, whose output goes to an addition that writes into the other operand; RegNet's
# last norm of each block); ReLU nets keep ABN / GroupNormAct for the norms followed by ReLU.
IN_PLACE = {
    "torchvision-efficientnet_v2_s": {"silu": 1},
    "torchvision-regnet_y_400mf": {"identity": 1, "ABN": 1},
    "torchvision-resnet50_group_norm": {"InPlaceGroupNormAct": 1, "GroupNormAct": 1},
    "timm-cspdarknet53": {"leaky_relu": 1},
    "timm-resnetv2_50": {"ABN": 1},
}


def _layer_kinds(model):
    """How many layers of each kind ``model`` has: ``InPlaceABN`` counted by activation
    (``silu``/``gelu`` are the branch-bit layers), the other layers by class; a layer in the
    output-only mode (``overwrite_input=False``: not in place) gets `` output-only`` added."""
    kinds = {}
    for module in model.modules():
        if type(module) is iabn.InPlaceABN:
            kind = module.activation
        elif type(module) in (iabn.ABN, iabn.InPlaceGroupNormAct, iabn.GroupNormAct):
            kind = type(module).__name__
        else:
            continue
        if not getattr(module, "overwrite_input", True):
            kind += " output-only"
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _outputs_and_grads(model, x, training):
    model.train(training)
    x = x.clone().requires_grad_()
    with torch.random.fork_rng(devices=[]):  # the same dropout / stochastic depth masks
        torch.manual_seed(1)
        out = model(x)
    leaves = [t for t in (out if isinstance(out, tuple) else (out,)) if torch.is_tensor(t)]
    # backward in eval mode too (frozen-statistics fine-tuning, input gradients): there
    # dropout and stochastic depth return their input, so a later ``+=`` writes into it
    names, weights = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad],
                         strict=True)
    loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum()
               for t in leaves)
    grads = torch.autograd.grad(loss, [x, *weights], allow_unused=True)
    return [t.detach() for t in leaves], dict(zip(["input", *names], grads, strict=True))


def _error(got, expected, floor):
    scale = max(float(expected.abs().max()), floor, 1e-300)
    return float((got - expected).abs().max()) / scale


# one model of each library by default; the rest of the zoo is slow (up to 6.5 s a model on a
# 2-core CPU)
DEFAULT_ZOO = ("torchvision-resnet18", "timm-resnet18d")


def _zoo_params(names):
    return [n if n in DEFAULT_ZOO else pytest.param(n, marks=pytest.mark.slow) for n in names]


@pytest.mark.parametrize("name", _zoo_params(ZOO))
def test_lossless_conversion_is_the_same_model(name):
    _check_lossless(name)


@pytest.mark.parametrize("name", DEFAULT_ZOO)
def test_lossless_conversion_of_a_recorded_run_is_the_same_model(name, monkeypatch):
    """The same on a recorded run (forced): the rest of the zoo is compared with the traced
    conversion's decisions below, which this one's equalities then carry over to."""
    from analysis_paths import force_recording

    force_recording(monkeypatch)
    _check_lossless(name)


def _check_lossless(name):
    build, size = ZOO[name]
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    converted, report = iabn.convert(model, x, verify=False)
    norms = [n for n, m in model.named_modules()
             if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm))]
    # one row per norm, in model order; then the layer norms and activations without a norm
    # (an EfficientNet's squeeze-excitation SiLU, MaxViT's layer norms and GELUs)
    assert [row.name for row in report.rows][:len(norms)] == norms
    assert all(is_layer_site(model.get_submodule(row.name))
               for row in report.rows[len(norms):])
    assert set(converted.state_dict()) == set(model.state_dict())
    assert report.saved_before == saved_tensor_bytes(copy.deepcopy(model).train(), x)
    assert report.saved_after == saved_tensor_bytes(copy.deepcopy(converted).train(), x)
    for row in report.rows:  # ABN keeps what BN + activation kept; untouched keeps it all
        if row.decision in ("ABN", "untouched") and row.saved_before is not None:
            assert row.saved_after == row.saved_before, row
    kinds = _layer_kinds(converted)
    for kind, least in IN_PLACE.get(name, {}).items():
        assert kinds.get(kind, 0) >= least, (kind, kinds)
    worst = 0.0
    for training in (True, False):
        expected_out, expected_grads = _outputs_and_grads(copy.deepcopy(model), x, training)
        out, grads = _outputs_and_grads(copy.deepcopy(converted), x, training)
        floor = FLOOR / RELATIVE_TOLERANCE * max(
            (float(g.abs().max()) for g in expected_grads.values() if g is not None),
            default=0.0)
        assert grads.keys() == expected_grads.keys()
        pairs = [*zip(out, expected_out, strict=True),
                 *((grads[k], expected_grads[k]) for k in grads)]
        for got, want in pairs:
            assert (got is None) == (want is None)
            if got is not None:
                worst = max(worst, _error(got, want, floor))
    print(f"{name}: largest relative difference {worst:.3g}")
    assert worst <= RELATIVE_TOLERANCE, worst


@pytest.mark.parametrize("name", _zoo_params(["torchvision-resnet18", "torchvision-densenet121",
                                               "timm-cspdarknet53", "timm-resnetv2_50"]))
def test_leaky_relu_policy_goes_in_place_and_trains(name):
    build, size = ZOO[name]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(2, 3, size, size)
    converted, report = iabn.convert(model, x, policy="leaky_relu")
    assert report.counts.get("InPlaceABN", 0) > report.counts.get("ABN", 0)
    assert report.saved_after < report.saved_before
    assert report.norm_saved_after < report.norm_saved_before
    out = converted.train()(x)
    out.sum().backward()  # the in-place layers' saved outputs were not disturbed
    assert all(p.grad is not None for p in converted.parameters() if p.requires_grad)


def test_families_without_batch_norm_are_returned_unchanged():
    torch.manual_seed(0)
    model = torchvision.models.squeezenet1_1(weights=None, num_classes=10)
    x = torch.randn(2, 3, 32, 32)
    converted, report = iabn.convert(model, x)
    assert report.rows == [] and type(converted) is type(model)
    assert report.saved_after == report.saved_before
    assert report.max_difference_eval == report.max_difference_train == 0


def test_timm_batchnormact_by_activation():
    pytest.importorskip("timm", reason="timm is not installed")
    from timm.layers import BatchNormAct2d

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3)
            self.conv3 = nn.Conv2d(8, 8, 3)
            self.bn1 = BatchNormAct2d(8, act_layer=nn.LeakyReLU)
            self.bn2 = BatchNormAct2d(8, act_layer=nn.SiLU)
            self.bn3 = BatchNormAct2d(8, act_layer=nn.Hardswish)

        def forward(self, x):
            return self.bn3(self.conv3(self.bn2(self.conv2(self.bn1(self.conv1(x))))))

    model = Net().double()
    x = torch.randn(2, 3, 11, 11, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    assert [(r.pattern, r.decision) for r in report.rows] == [
        ("BatchNormAct2d(LeakyReLU)", "InPlaceABN"), ("BatchNormAct2d(SiLU)", "InPlaceABN"),
        ("BatchNormAct2d(Hardswish)", "untouched")]
    assert "Hardswish is not one iabn's layers compute" in report.rows[2].reason
    assert type(converted.bn2) is iabn.InPlaceABN and converted.bn2.activation == "silu"
    assert type(converted.bn1) is iabn.InPlaceABN and converted.bn1.activation_param == 0.01
    # float64; tests/conversion/test_convert.py measures at most 5.7e-14 on such models
    assert report.max_difference_train <= 1e-12 and report.max_difference_eval <= 1e-12


@pytest.mark.parametrize("name", _zoo_params(ZOO))
def test_a_recorded_run_decides_as_the_trace(name, monkeypatch):
    """Both ways to a graph feed the same rules: where fx's conversion is a module swap, a
    recorded run gives every layer the same decision and the model the same bytes; where fx
    fused activations that only a generated module can remove, the recorded run keeps them
    and its model saves no less."""
    from analysis_paths import force_recording

    build, size = ZOO[name]
    torch.manual_seed(0)
    model = build().double()
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    _, traced = iabn.convert(model, x, verify=False)
    force_recording(monkeypatch)
    _, recorded = iabn.convert(model, x, verify=False)
    assert recorded.result == "modules swapped"
    assert recorded.saved_before == traced.saved_before
    if traced.result == "modules swapped":
        assert [(r.name, r.decision, r.saved_before, r.saved_after) for r in recorded.rows] == \
               [(r.name, r.decision, r.saved_before, r.saved_after) for r in traced.rows]
    else:
        assert recorded.saved_after >= traced.saved_after
    print(f"{name}: fx {traced.result} {traced.saved_after / traced.saved_before:.3f}x, "
          f"recorded {recorded.saved_after / recorded.saved_before:.3f}x")
