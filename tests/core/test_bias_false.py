"""``bias=False``, as ``nn.BatchNorm2d(C, bias=False)`` and ``nn.GroupNorm(G, C, bias=False)``
have it: a learned weight, no bias parameter, none in the ``state_dict``. Every layer takes
it, computes PyTorch's own modules' outputs and gradients (float64), loads their state, and
``iabn.convert`` carries it over."""

import copy

import pytest
import torch
from torch import nn

import iabn
from iabn import compat

C = 6


def _without_bias(norm):
    """PyTorch's norm with what its ``bias=False`` does (no bias parameter), made by hand:
    torch 2.14 has the keyword, torch 2.11 (the oldest supported) does not."""
    norm.register_parameter("bias", None)
    return norm


def _pairs():
    """(iabn layer, PyTorch reference: norm without bias + the same activation)."""
    def bn():
        return _without_bias(nn.BatchNorm2d(C))

    return {
        "ABN": (lambda: iabn.ABN(C, bias=False),
                lambda: nn.Sequential(bn(), nn.LeakyReLU(0.01))),
        "InPlaceABN": (lambda: iabn.InPlaceABN(C, bias=False),
                       lambda: nn.Sequential(bn(), nn.LeakyReLU(0.01))),
        "InPlaceABN silu": (lambda: iabn.InPlaceABN(C, activation="silu", bias=False),
                            lambda: nn.Sequential(bn(), nn.SiLU())),
        "InPlaceABN output-only": (
            lambda: iabn.InPlaceABN(C, activation="elu", activation_param=1.0, bias=False,
                                    overwrite_input=False),
            lambda: nn.Sequential(bn(), nn.ELU())),
        "GroupNormAct": (lambda: iabn.GroupNormAct(2, C, bias=False),
                         lambda: nn.Sequential(_without_bias(nn.GroupNorm(2, C)),
                                               nn.LeakyReLU(0.01))),
        "InPlaceGroupNormAct": (lambda: iabn.InPlaceGroupNormAct(2, C, bias=False),
                                lambda: nn.Sequential(_without_bias(nn.GroupNorm(2, C)),
                                                      nn.LeakyReLU(0.01))),
    }


PAIRS = _pairs()


@pytest.mark.parametrize("name", list(PAIRS))
def test_bias_false_is_pytorchs_norm_without_bias(name):
    build, build_reference = PAIRS[name]
    torch.manual_seed(0)
    layer, reference = build().double(), build_reference().double()
    assert layer.bias is None and "bias=False" in repr(layer)
    assert set(layer.state_dict()) == set(reference[0].state_dict())
    with torch.no_grad():
        reference[0].weight.uniform_(0.5, 1.5)
    layer.load_state_dict(reference[0].state_dict())  # strict: the same keys
    x = torch.randn(4, C, 5, 5, dtype=torch.float64)
    for training in (True, False):
        layer.train(training)
        reference.train(training)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, expected = layer(a * 1), reference(b)
        dy = torch.randn_like(out)
        (out * dy).sum().backward()
        (expected * dy).sum().backward()
        # measured up to 8.0e-15 (outputs, input and weight gradients; SiLU's inversion, the
        # in-place layers' backward reorders sums): 1e-12 is ~125x that
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
        torch.testing.assert_close(layer.weight.grad, reference[0].weight.grad, rtol=0,
                                   atol=1e-12)
        layer.weight.grad = reference[0].weight.grad = None
    if hasattr(reference[0], "running_mean"):
        torch.testing.assert_close(layer.running_mean, reference[0].running_mean, rtol=0,
                                   atol=1e-15)


def test_every_constructor_takes_it_and_checks_it():
    for layer in (iabn.InPlaceABNSync(C, bias=False), iabn.ABNSync(C, bias=False),
                  compat.ABN(C, bias=False), compat.InPlaceABN(C, bias=False),
                  compat.InPlaceABNSync(C, bias=False)):
        assert layer.bias is None and "bias" not in layer.state_dict(), type(layer)
    assert iabn.ABN(C).bias is not None  # the default keeps it
    for cls in (iabn.ABN, iabn.InPlaceABN):
        with pytest.raises(TypeError, match="bias='no': must be True or False"):
            cls(C, bias="no")
    with pytest.raises(TypeError, match="bias=0: must be True or False"):
        iabn.GroupNormAct(2, C, bias=0)


def test_convert_keeps_a_norm_without_bias():
    model = nn.Sequential(nn.Conv2d(3, C, 3, padding=1), _without_bias(nn.BatchNorm2d(C)),
                          nn.LeakyReLU(0.01), nn.Conv2d(C, 2, 1)).double()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    assert report.rows[0].decision == "InPlaceABN"
    assert converted[1].bias is None and torch.equal(converted[1].weight, model[1].weight)
    assert set(converted.state_dict()) == set(model.state_dict())
    for training in (True, False):
        expected = copy.deepcopy(model).train(training)(x)
        got = copy.deepcopy(converted).train(training)(x)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
