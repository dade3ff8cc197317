"""iabn.convert on models with nn.GroupNorm: the same rules as for batch norm, with
iabn.InPlaceGroupNormAct and iabn.GroupNormAct as the new layers. References: the original
model (lossless), nn.GroupNorm + nn.LeakyReLU in the converted graph (policy leaky_relu), and
iabn.memory's saved-tensor count of each model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import iabn
from iabn.memory import saved_tensor_bytes


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(4, c)
        self.act1 = nn.LeakyReLU(0.1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(4, c)
        self.act2 = nn.LeakyReLU(0.1)

    def forward(self, x):
        out = self.act1(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return self.act2(out + x)


class Net(nn.Module):
    """A small ResNet with GroupNorm + LeakyReLU, and a side branch whose norm input is used
    twice (must not go in place) and one with ReLU (lossless: GroupNormAct with relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 8)
        self.act = nn.LeakyReLU(0.1)
        self.b1 = Block(8)
        self.b2 = Block(8)
        self.side = nn.Conv2d(8, 8, 1)
        self.gn_shared = nn.GroupNorm(2, 8)
        self.gn_relu = nn.GroupNorm(8, 8, affine=False)
        self.relu = nn.ReLU()
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = self.act(self.gn(self.stem(x)))
        x = self.b2(self.b1(x))
        h = self.side(x)
        x = self.gn_shared(h) + h
        x = self.relu(self.gn_relu(x))
        return self.head(x.mean((2, 3)))


def randomise(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.GroupNorm) and m.affine:
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_()
    return model


def gradients(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    out = model(x)
    return [out.detach(), *torch.autograd.grad((out ** 2).sum(), [x, *model.parameters()])]


def test_small_resnet_with_group_norm_lossless():
    torch.manual_seed(0)
    model = randomise(Net()).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    decisions = {row.name: row.decision for row in report.rows}
    assert decisions == {
        "gn": "InPlaceGroupNormAct", "b1.gn1": "InPlaceGroupNormAct",
        "b1.gn2": "InPlaceGroupNormAct", "b2.gn1": "InPlaceGroupNormAct",
        "b2.gn2": "InPlaceGroupNormAct", "gn_shared": "untouched", "gn_relu": "GroupNormAct",
    }, report.table()
    rows = {row.name: row for row in report.rows}
    assert rows["gn"].pattern == "GroupNorm -> LeakyReLU"
    assert "also used by 1 other operation" in rows["gn_shared"].reason
    assert type(converted.gn) is iabn.InPlaceGroupNormAct and type(converted.act) is nn.Identity
    assert converted.gn.activation_param == 0.1
    assert type(converted.gn_relu) is iabn.GroupNormAct and converted.gn_relu.activation == "relu"
    assert converted.gn_relu.weight is None
    assert report.max_difference_train == report.max_difference_eval == 0.0

    # the report's bytes are iabn.memory's count of each model
    assert report.saved_before == saved_tensor_bytes(copy.deepcopy(model).train(), x)
    assert report.saved_after == saved_tensor_bytes(copy.deepcopy(converted).train(), x)
    # by hand, float64, N = 2, 8 channels of 8x8: a fused norm + LeakyReLU kept the norm's
    # input, mean and rstd (N, G) and the activation's input; now z and rstd
    activation, n = 2 * 8 * 8 * 8 * 8, 2
    assert (rows["gn"].saved_before, rows["gn"].saved_after) == (
        2 * activation + 2 * n * 2 * 8, activation + n * 2 * 8)
    assert (rows["b1.gn2"].saved_before, rows["b1.gn2"].saved_after) == (
        activation + 2 * n * 4 * 8, activation + n * 4 * 8)
    # the three fused norms drop an activation and mean (N, G); the two before an addition
    # drop mean (N, G); the two left as they were (gn_shared, gn_relu) change nothing
    saved = (activation + n * 2 * 8) + 2 * (activation + n * 4 * 8) + 2 * n * 4 * 8
    assert report.norm_saved_before - report.norm_saved_after == saved == 24_864
    assert report.saved_after < 0.7 * report.saved_before

    for got, want in zip(gradients(converted, x), gradients(model, x), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)


def test_small_weights_are_not_clamped_under_lossless():
    torch.manual_seed(1)
    model = randomise(Net()).double()
    with torch.no_grad():
        model.b1.gn1.weight[0] = 1e-7
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    _, report = iabn.convert(model, x)
    rows = {row.name: row for row in report.rows}
    assert rows["b1.gn1"].decision == "GroupNormAct" and "|weight| < eps" in rows[
        "b1.gn1"].reason
    assert report.max_difference_train == 0.0
    _, report = iabn.convert(model, x, policy="leaky_relu")
    assert {row.name: row.decision for row in report.rows}["b1.gn1"] == "InPlaceGroupNormAct"


def test_torchvision_resnet18_with_group_norm_under_leaky_relu():
    """torchvision's resnet18 with nn.GroupNorm(8, c): under policy leaky_relu every norm
    followed by its ReLU goes in place (ReLU -> LeakyReLU(0.01)); the last norm of each block,
    whose output ``out += identity`` overwrites, stays. The gradients equal those of the same
    graph with nn.GroupNorm + nn.LeakyReLU(0.01) in place of each new layer."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(2)
    model = randomise(torchvision.models.resnet18(
        num_classes=4, norm_layer=lambda c: nn.GroupNorm(8, c))).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    converted, report = iabn.convert(model, x, policy="leaky_relu", verify=False)
    assert report.counts == {"InPlaceGroupNormAct": 12, "untouched": 8}, report.table()
    assert report.saved_before == saved_tensor_bytes(copy.deepcopy(model).train(), x)
    assert report.saved_after == saved_tensor_bytes(copy.deepcopy(converted).train(), x)
    assert report.saved_after < 0.75 * report.saved_before

    reference = copy.deepcopy(converted)
    for name, layer in list(reference.named_modules()):
        if isinstance(layer, iabn.InPlaceGroupNormAct):
            norm = nn.GroupNorm(layer.num_groups, layer.num_channels, layer.eps).double()
            norm.load_state_dict(layer.state_dict())
            if layer.activation == "identity":  # the downsampling branches' norms
                reference.set_submodule(name, norm)
                continue
            assert layer.activation == "leaky_relu" and layer.activation_param == 0.01
            reference.set_submodule(name, nn.Sequential(norm, nn.LeakyReLU(0.01)))
    got, want = gradients(converted.train(), x), gradients(reference.train(), x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-11)
