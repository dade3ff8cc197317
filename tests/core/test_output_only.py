"""The output-only mode of the in-place layers (``overwrite_input=False``): the input is left
as it was, the output is a new tensor, and only the output (with per-channel or per-group
tensors) is kept for backward, so an input that is read again is not kept by the layer.
References: ``nn.BatchNorm2d`` / ``nn.GroupNorm`` + the activation in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import iabn
from iabn.memory import saved_tensor_bytes

from helpers import BRANCH, randomise_, torch_activation

SHAPE = (4, 6, 5, 3)
#: float64 outputs and gradients: the in-place layers' backward recovers the input from the
#: output; measured differences from the references here are below 1e-14.
TOL = 1e-12


def _layers(kind, activation, param):
    if kind == "batch":
        norm = randomise_(nn.BatchNorm2d(SHAPE[1])).double()
        layer = iabn.InPlaceABN(SHAPE[1], activation=activation, activation_param=param,
                                overwrite_input=False, dtype=torch.float64)
    elif kind == "sync":  # without a process group: the single-process layer
        norm = randomise_(nn.BatchNorm2d(SHAPE[1])).double()
        layer = iabn.InPlaceABNSync(SHAPE[1], activation=activation, activation_param=param,
                                    overwrite_input=False, dtype=torch.float64)
    else:
        norm = nn.GroupNorm(3, SHAPE[1]).double()
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
        layer = iabn.InPlaceGroupNormAct(3, SHAPE[1], activation=activation,
                                         activation_param=param, overwrite_input=False,
                                         dtype=torch.float64)
    layer.load_state_dict(norm.state_dict())
    return nn.Sequential(norm, torch_activation(activation, param)), layer


CASES = [("batch", "leaky_relu", 0.01), ("batch", "elu", 1.0),
         *(("batch", name, 0.0) for name in BRANCH), ("sync", "leaky_relu", 0.1),
         ("group", "leaky_relu", 0.01), ("group", "elu", 0.5)]


@pytest.mark.filterwarnings("ignore:.*process group:UserWarning")
@pytest.mark.parametrize("kind,activation,param", CASES)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_equals_the_reference_and_leaves_its_input(kind, activation, param, training):
    reference, layer = _layers(kind, activation, param)
    reference.train(training)
    layer.train(training)
    x = torch.randn(SHAPE, dtype=torch.float64) * 2 + 0.3
    grad = torch.randn(SHAPE, dtype=torch.float64)
    expected_leaf = x.clone().requires_grad_()
    expected = reference(expected_leaf)
    expected.backward(grad)
    leaf = x.clone().requires_grad_()   # a leaf that requires grad: the in-place mode refuses it
    out = layer(leaf)
    assert out is not leaf and torch.equal(leaf.detach(), x)
    out.backward(grad)
    assert (out - expected).abs().max() <= TOL
    assert (leaf.grad - expected_leaf.grad).abs().max() <= TOL
    for name, p in reference[0].named_parameters():
        assert (getattr(layer, name).grad - p.grad).abs().max() <= TOL, name
    for name, b in reference[0].named_buffers():
        assert torch.allclose(getattr(layer, name), b, rtol=0, atol=TOL), name


class Residual(nn.Module):
    """``norm(h) + h``: h is read again by the addition, which saves nothing for backward."""

    def __init__(self, norm):
        super().__init__()
        self.conv = nn.Conv2d(3, SHAPE[1], 3, padding=1).double()
        self.norm = norm

    def forward(self, x):
        h = self.conv(x)
        return self.norm(h) + h


@pytest.mark.parametrize("kind", ["batch", "group"])
def test_keeps_only_its_output_where_abn_keeps_its_input_too(kind):
    """Saved for backward, exactly: the conv's input x and the layer's output with its
    per-channel or per-(sample, group) tensors; ABN / GroupNormAct keep h, the conv's output,
    and their activation's output."""
    _, layer = _layers(kind, "leaky_relu", 0.01)
    if kind == "batch":
        keeping = iabn.ABN(SHAPE[1], dtype=torch.float64)
        small, keeping_small = 2 * SHAPE[1] * 8, 2 * SHAPE[1] * 8   # (invstd, g); (mean, invstd)
    else:
        keeping = iabn.GroupNormAct(3, SHAPE[1], dtype=torch.float64)
        small, keeping_small = SHAPE[0] * 3 * 8, 2 * SHAPE[0] * 3 * 8  # rstd; (mean, rstd)
    keeping.load_state_dict(layer.state_dict())
    x = torch.randn(SHAPE[0], 3, *SHAPE[2:], dtype=torch.float64)
    activation = x.numel() // 3 * SHAPE[1] * 8
    conv_input = x.numel() * 8
    assert saved_tensor_bytes(Residual(layer).train(), x) == conv_input + activation + small
    assert (saved_tensor_bytes(Residual(keeping).train(), x)
            == conv_input + 2 * activation + keeping_small)


def test_the_option_is_checked_and_shown():
    with pytest.raises(TypeError, match="overwrite_input='no'"):
        iabn.InPlaceABN(4, overwrite_input="no")
    layer = iabn.InPlaceGroupNormAct(2, 4)
    with pytest.raises(TypeError, match="overwrite_input=1"):
        layer.overwrite_input = 1
    assert layer.overwrite_input and "overwrite_input" not in repr(layer)
    layer.overwrite_input = False
    assert "overwrite_input=False" in repr(layer)
    leaf = torch.randn(2, 4, 3, requires_grad=True)
    layer(leaf).sum().backward()       # accepted now: the leaf is not overwritten
    layer.overwrite_input = True
    with pytest.raises(RuntimeError, match="leaf"):
        layer(torch.randn(2, 4, 3, requires_grad=True))
    copied = copy.deepcopy(iabn.InPlaceABN(4, overwrite_input=False))
    assert copied.overwrite_input is False


def test_compiles_to_the_same_gradients():
    """torch.compile (aot_eager: no C++ compiler needed) of the output-only layer."""
    _, layer = _layers("batch", "leaky_relu", 0.01)
    x = torch.randn(SHAPE, dtype=torch.float64)
    grads = []
    for model in (layer, torch.compile(copy.deepcopy(layer), backend="aot_eager",
                                       fullgraph=True)):
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        assert torch.equal(leaf.detach(), x)
        out.square().sum().backward()
        grads.append((leaf.grad, model.weight.grad if hasattr(model, "weight")
                      else model._orig_mod.weight.grad))
    for eager, compiled in zip(grads[0], grads[1], strict=True):
        assert (eager - compiled).abs().max() <= TOL
