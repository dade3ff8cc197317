"""The layers' lean eager path (docs/design.md, "The in-place contract", its "Host cost"
paragraph): what it keeps between calls is dropped when what it depends on changes, and the
tensors it reads from nn.Module's tables are the ones ``layer.weight`` and the others would
give, against ``torch.nn`` in float64."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

import iabn
from iabn.kernels import backends, reference

from helpers import randomise_, torch_activation

# as tests/core/test_hostile_use.py: 11x the largest measured, 1.8e-15
TOL = dict(rtol=0, atol=2e-14)

# (option, value assigned after a first call, the nn reference's settings for the second call)
CHANGES = {
    "eps": (0.5, dict(eps=0.5)),
    "momentum": (0.6, dict(momentum=0.6)),
    "momentum None": (None, dict(momentum=None)),
    "activation_param": (0.3, dict(activation_param=0.3)),
    "activation": ("elu", dict(activation="elu", activation_param=0.01)),
}


def _pair(layer_cls, training):
    bn = randomise_(nn.BatchNorm2d(3)).double().train(training)
    layer = layer_cls(3).double().train(training)
    layer.load_state_dict(bn.state_dict())
    return layer, bn


def _reference_step(bn, x, grad, eps, momentum, activation, activation_param):
    """BatchNorm2d with these settings + the activation, on ``bn``'s parameters and
    statistics (``bn`` is updated as the layer is); returns the output and the gradients."""
    bn.eps, bn.momentum = eps, momentum
    x = x.detach().clone().requires_grad_()
    out = torch_activation(activation, activation_param)(bn(x))
    out.backward(grad)
    return out, x.grad, bn.weight.grad


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, iabn.ABN])
@pytest.mark.parametrize("training", [True, False])
def test_an_option_assigned_after_a_call_is_used_by_the_next(change, layer_cls, training):
    """The call settings kept between calls (``_call_config``) are rebuilt when an option
    is assigned: the second call computes, and trains, with the new value."""
    torch.manual_seed(0)
    layer, bn = _pair(layer_cls, training)
    settings = dict(eps=1e-5, momentum=0.1, activation="leaky_relu", activation_param=0.01)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    for step in range(2):
        if step == 1:
            name, (value, new) = change.split()[0], CHANGES[change]
            setattr(layer, name, value)
            settings.update(new)
        layer.zero_grad()
        bn.zero_grad()
        x.grad = None
        out = layer(x.clone())
        out.backward(grad)
        ref, ref_dx, ref_dweight = _reference_step(bn, x, grad, **settings)
        torch.testing.assert_close(out, ref, **TOL)
        torch.testing.assert_close(x.grad, ref_dx, **TOL)
        torch.testing.assert_close(layer.weight.grad, ref_dweight, **TOL)
        torch.testing.assert_close(layer.running_mean, bn.running_mean, **TOL)
        torch.testing.assert_close(layer.running_var, bn.running_var, **TOL)
        assert int(layer.num_batches_tracked) == int(bn.num_batches_tracked)


def test_gamma_mode_and_variant_assigned_after_a_call_reach_the_kernels(monkeypatch):
    """Options whose effect the comparison above cannot see (the variants compute the same
    gradients; abs and signed agree for weights above eps) must still reach the kernels."""
    seen = []
    backward = reference.backward

    def spy(*args):
        seen.append(args[6])  # the LayerConfig
        return backward(*args)

    monkeypatch.setattr(reference, "backward", spy)
    layer = iabn.InPlaceABN(3)
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    layer(x.clone()).sum().backward()
    layer.variant, layer.gamma_mode = 1, "abs"
    layer(x.clone()).sum().backward()
    assert [(c.variant, c.gamma_mode) for c in seen] == [(2, "signed"), (1, "abs")]


@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, iabn.ABN])
def test_num_features_assigned_after_a_call_is_checked_on_the_next(layer_cls):
    """The signature of the last validated call is dropped when an option changes: the
    channel count is checked against the new num_features even for the same input shape."""
    layer = layer_cls(4)
    layer(torch.randn(2, 4, 3, 3))
    layer.num_features = 5
    x = torch.randn(2, 4, 3, 3)
    before = x.clone()
    with pytest.raises(ValueError, match=r"input has 4 channels .* num_features=5"):
        layer(x)
    assert torch.equal(x, before) and int(layer.num_batches_tracked) == 1


def test_backend_variable_changed_between_calls_is_read_again(monkeypatch):
    """``IABN_BACKEND`` is read on every call (what is kept is the parsing of values seen)."""
    monkeypatch.delenv("IABN_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    layer = iabn.InPlaceABN(3)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    layer(x.clone()).sum().backward()
    for value, error in [("bogus", ValueError), ("triton", RuntimeError)]:
        monkeypatch.setenv("IABN_BACKEND", value)
        with pytest.raises(error, match=f"IABN_BACKEND={value}|IABN_BACKEND='{value}'"):
            layer(x.clone())
    monkeypatch.setenv("IABN_BACKEND", " Reference ")
    layer(x.clone()).sum().backward()
    assert int(layer.num_batches_tracked) == 2


def test_backend_variable_read_from_a_replaced_environment(monkeypatch):
    """``os.environ`` replaced by a plain mapping is still read (through ``get``)."""
    monkeypatch.setattr(os, "environ", {"IABN_BACKEND": "bogus"})
    with pytest.raises(ValueError, match="IABN_BACKEND='bogus'"):
        backends.requested_backend()
    monkeypatch.setattr(os, "environ", {"IABN_BACKEND": "reference"})
    assert backends.backend_for(torch.zeros(1)) is reference


class _Double(nn.Module):
    def forward(self, weight):
        return 2 * weight


@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, iabn.ABN])
def test_parametrized_weight_is_read_as_the_attribute(layer_cls):
    """``parametrize`` takes the weight out of ``_parameters`` (the layer reads the tables
    first): the layer computes with the parametrized weight, as nn.BatchNorm2d does."""
    torch.manual_seed(0)
    layer, bn = _pair(layer_cls, True)
    parametrize.register_parametrization(layer, "weight", _Double())
    parametrize.register_parametrization(bn, "weight", _Double())
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(layer(x.clone()), F.leaky_relu(bn(x), 0.01), **TOL)
    torch.testing.assert_close(layer.running_var, bn.running_var, **TOL)


@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, iabn.ABN])
def test_functional_call_tensors_are_used(layer_cls):
    """``torch.func.functional_call`` swaps the tensors in the tables for the call."""
    torch.manual_seed(0)
    layer, bn = _pair(layer_cls, False)
    tensors = {"weight": torch.rand(3, dtype=torch.float64) + 0.5,
               "bias": torch.randn(3, dtype=torch.float64),
               "running_mean": torch.randn(3, dtype=torch.float64),
               "running_var": torch.rand(3, dtype=torch.float64) + 0.5}
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    got = torch.func.functional_call(layer, tensors, (x.clone(),))
    want = torch.func.functional_call(bn, tensors, (x,))
    torch.testing.assert_close(got, F.leaky_relu(want, 0.01), **TOL)
