"""iabn.plan on full-size library models (torchvision's ResNet-50, VGG-19-BN, DenseNet-121 and
EfficientNet-B0, timm's ResNeXt-50): the planned model's activation bytes, counted by
iabn.memory on a training forward, equal the plan's prediction exactly and are within the
budget. One budget, a quarter of the model's bytes, where plans mix the most choices
(recompute, selective and lean runs, in place); 8-25 s of planning each on 2 cores.
(MobileNetV3-Small, and every model at half its bytes, gave the same exactness, 2026-11-24.)"""

import copy

import pytest
import torch

import iabn
from iabn.memory import saved_tensor_bytes

pytestmark = [pytest.mark.slow, pytest.mark.without_gpu]
BUDGET = 0.25


def _torchvision(name):
    torchvision = pytest.importorskip("torchvision")
    return getattr(torchvision.models, name)(num_classes=10)


def _timm(name):
    timm = pytest.importorskip("timm")
    return timm.create_model(name, num_classes=10)


MODELS = {
    "resnet50": lambda: _torchvision("resnet50"),
    "vgg19_bn": lambda: _torchvision("vgg19_bn"),
    "densenet121": lambda: _torchvision("densenet121"),
    "efficientnet_b0": lambda: _torchvision("efficientnet_b0"),
    "resnext50_32x4d (timm)": lambda: _timm("resnext50_32x4d"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_planned_bytes_are_the_predicted_ones_within_the_budget(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randn(2, 3, 64, 64)
    planned, report = iabn.plan(model, x, BUDGET)
    counted = saved_tensor_bytes(copy.deepcopy(planned).train(), x)
    assert counted == report.predicted == report.measured
    assert counted <= BUDGET * report.as_given
    assert report.as_given == saved_tensor_bytes(copy.deepcopy(model).train(), x)
    assert sum(n for choice, n in report.counts.items() if choice != "keep") >= 1
