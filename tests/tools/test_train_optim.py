"""Optimizers: which parameters get weight decay (by identity), and the configured types."""

import pytest
import torch
from torch import nn

import iabn
from iabn.tools.training.config import ENGINE_SCHEMA, defaults
from iabn.tools.training.optim import build_optimizer, parameter_groups


def _model() -> tuple[nn.Module, list[nn.Parameter], list[nn.Parameter]]:
    """A model with every kind of norm layer, and its (decayed, exempt) parameters as built."""
    conv, linear = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)
    norms = [nn.BatchNorm2d(4), iabn.InPlaceABN(4), iabn.ABN(4), nn.GroupNorm(2, 4),
             nn.LayerNorm([4, 1, 1])]
    model = nn.Sequential(conv, *norms, nn.AdaptiveAvgPool2d(1), nn.Flatten(), linear)
    decayed = [conv.weight, conv.bias, linear.weight, linear.bias]
    exempt = [p for norm in norms for p in (norm.weight, norm.bias)]
    return model, decayed, exempt


def _ids(params) -> set[int]:
    return {id(p) for p in params}


def test_norm_parameters_are_exempt_from_weight_decay():
    model, decayed, exempt = _model()
    groups = parameter_groups(model, 1e-4, decay_norm=False)
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]
    assert _ids(groups[0]["params"]) == _ids(decayed)
    assert _ids(groups[1]["params"]) == _ids(exempt)


def test_decay_norm_puts_every_parameter_in_one_decayed_group():
    model, decayed, exempt = _model()
    groups = parameter_groups(model, 1e-4, decay_norm=True)
    assert len(groups) == 1 and _ids(groups[0]["params"]) == _ids(decayed + exempt)


def test_frozen_parameters_are_left_out():
    model, decayed, _ = _model()
    decayed[0].requires_grad_(False)
    groups = parameter_groups(model, 1e-4, decay_norm=False)
    assert id(decayed[0]) not in _ids(p for g in groups for p in g["params"])


def test_an_sgd_step_with_zero_gradients_shrinks_only_decayed_weights():
    model, decayed, exempt = _model()
    section = defaults(ENGINE_SCHEMA)["optimizer"] | {"lr": 0.5, "weight_decay": 0.1,
                                                      "momentum": 0.0}
    optimizer = build_optimizer(model, section)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in decayed:  # p <- p - lr * wd * p
        torch.testing.assert_close(p.detach(), before[id(p)] * (1 - 0.5 * 0.1))
    for p in exempt:
        assert torch.equal(p.detach(), before[id(p)])


@pytest.mark.parametrize(("kind", "cls"), [("sgd", torch.optim.SGD),
                                           ("adam", torch.optim.Adam),
                                           ("adamw", torch.optim.AdamW)])
def test_optimizer_types_and_hyperparameters(kind, cls):
    model, _, _ = _model()
    section = defaults(ENGINE_SCHEMA)["optimizer"] | {
        "type": kind, "lr": 0.03, "betas": [0.8, 0.99], "eps": 1e-6, "momentum": 0.7}
    optimizer = build_optimizer(model, section)
    assert type(optimizer) is cls
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.03
    if kind == "sgd":
        assert (group["momentum"], group["nesterov"]) == (0.7, True)
    else:
        assert (group["betas"], group["eps"]) == ((0.8, 0.99), 1e-6)


def test_nesterov_is_dropped_without_momentum():
    model, _, _ = _model()
    section = defaults(ENGINE_SCHEMA)["optimizer"] | {"momentum": 0.0, "nesterov": True}
    assert build_optimizer(model, section).param_groups[0]["nesterov"] is False
