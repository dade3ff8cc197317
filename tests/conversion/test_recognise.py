"""iabn.conversion.recognise: norm and activation modules of classes iabn does not know are
recognised by what they compute, each form matched, near misses refused with the reason
(docs/design.md, "Converting existing models"). The modules here are written as other
libraries write them (Hugging Face's formulas), independently of iabn's layers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from iabn.conversion.recognise import NormForm, recognise


class WrittenGELU(nn.Module):
    """GPT-2's NewGELUActivation: the tanh formula written out (``constant`` its factor)."""

    def __init__(self, constant: float = math.sqrt(2.0 / math.pi)) -> None:
        super().__init__()
        self.constant = constant

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(self.constant * (x + 0.044715 * torch.pow(x, 3.0))))


class ErfGELU(nn.Module):
    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class WrittenMish(nn.Module):
    def forward(self, x):
        return x * torch.tanh(F.softplus(x))


class InPlaceSwish(nn.Module):
    """Computes SiLU but writes it into its input."""

    def forward(self, x):
        return x.mul_(torch.sigmoid(x.clone()))


class UpcastRMSNorm(nn.Module):
    """Llama's RMSNorm (``eps_outside``: eps added after the square root, a near miss)."""

    def __init__(self, d, eps=1e-6, eps_outside=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps
        self.eps_outside = eps_outside

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        ms = h.pow(2).mean(-1, keepdim=True)
        h = h / (ms.sqrt() + self.variance_epsilon) if self.eps_outside else \
            h * torch.rsqrt(ms + self.variance_epsilon)
        return self.weight * h.to(dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's: normalised and scaled by 1 + weight in float32."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class StatsRMSNorm(nn.Module):
    """T5's: the mean of squares in float32, a hidden eps (no attribute to read)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self._hidden = 1e-6

    def forward(self, h):
        variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self._hidden)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.weight.dtype)
        return self.weight * h


class PlainRMSNorm(nn.Module):
    """An RMS norm in the input's dtype (``dim``: the dimension normalised)."""

    def __init__(self, d, eps=1e-5, dim=-1):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps, self.dim = eps, dim

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(self.dim, keepdim=True) + self.eps))


class SubclassedRMSNorm(nn.RMSNorm):
    """nn.RMSNorm's forward under another class name."""


class WrittenLayerNorm(nn.Module):
    """A layer norm written out, channels-first (ConvNeXt's) or over the last dimension."""

    def __init__(self, d, eps=1e-6, channels_first=False, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None
        self.layer_norm_eps, self.channels_first = eps, channels_first

    def forward(self, x):
        dim = 1 if self.channels_first else -1
        u = x.mean(dim, keepdim=True)
        s = (x - u).pow(2).mean(dim, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.layer_norm_eps)
        shape = (-1, 1, 1) if self.channels_first else (-1,)
        x = self.weight.view(shape) * x
        return x if self.bias is None else x + self.bias.view(shape)


@pytest.mark.parametrize(("module", "expected"), [
    (WrittenGELU(), nn.GELU(approximate="tanh")),
    (ErfGELU(), nn.GELU()),
    (Swish(), nn.SiLU()),
    (WrittenMish(), nn.Mish()),
])
def test_activation_forms_are_recognised(module, expected):
    found = recognise(module).found
    assert type(found) is type(expected)
    assert getattr(found, "approximate", None) == getattr(expected, "approximate", None)


@pytest.mark.parametrize(("module", "closest"), [
    # FastGELUActivation's constant: 3e-11 relative off sqrt(2/pi)
    (WrittenGELU(0.7978845608), "approximate='tanh'"),
    (QuickGELU(), "F.gelu"),  # far from every form: no report row (reported=False)
    (InPlaceSwish(), "writes into its input"),
])
def test_activation_near_misses_are_refused_with_the_reason(module, closest):
    result = recognise(module)
    assert result.found is None
    assert closest in result.why
    # a row in the report only within 1e-6 relative of a form (FastGELU's constant)
    assert result.reported == isinstance(module, WrittenGELU)


@pytest.mark.parametrize(("module", "expected"), [
    (UpcastRMSNorm(8), NormForm("rms_norm", 1e-6, False, 0.0, "normalise")),
    (OffsetRMSNorm(8, eps=1e-5), NormForm("rms_norm", 1e-5, False, 1.0, "scale")),
    (SubclassedRMSNorm(8, eps=1e-5), NormForm("rms_norm", 1e-5, False, 0.0, None)),
    (WrittenLayerNorm(8), NormForm("layer_norm", 1e-6, True)),
    (WrittenLayerNorm(8, bias=False), NormForm("layer_norm", 1e-6, False)),
    (WrittenLayerNorm(8, channels_first=True), NormForm("layer_norm_2d", 1e-6, True)),
])
def test_norm_forms_are_recognised_with_eps_read_from_any_attribute(module, expected):
    assert recognise(module).found == expected


def test_eps_without_an_attribute_is_found_by_the_probe():
    found = recognise(StatsRMSNorm(8)).found
    assert (found.kind, found.upcast, found.weight_offset) == ("rms_norm", "statistics", 0.0)
    assert found.eps == pytest.approx(1e-6, rel=1e-6)


@pytest.mark.parametrize(("module", "words"), [
    (UpcastRMSNorm(8, eps_outside=True), "matches no norm"),
    (PlainRMSNorm(6, dim=-2), "matches no norm"),  # another dimension
    # bfloat16 throughout, promoted to float32 by a float32 weight: no form gives that
    (PlainRMSNorm(8), "bfloat16"),
])
def test_norm_near_misses_are_refused_with_the_reason(module, words):
    result = recognise(module)
    assert result.found is None
    assert words in result.why


def test_a_converted_model_reports_a_module_that_matches_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), WrittenGELU(0.7978845608), nn.Linear(16, 8),
                          UpcastRMSNorm(8), nn.Linear(8, 16), Swish(), nn.Linear(16, 4))
    converted, report = iabn.convert(model, torch.randn(4, 8))
    rows = {row.name: row for row in report.rows}
    assert rows["1"].decision == "untouched"
    assert "F.gelu(approximate='tanh')" in rows["1"].reason
    assert rows["3"].decision == "InPlaceRMSNorm" and rows["5"].decision == "InPlaceSiLU"
    assert set(converted.state_dict()) == set(model.state_dict())
    assert report.max_difference_train < 1e-6



def test_probes_are_unseen_by_torch_function_modes_and_instance_forwards(monkeypatch):
    """A recorded run wraps each module's forward on the instance and records every torch
    call through a TorchFunctionMode: the probes run inside neither."""
    from torch.overrides import TorchFunctionMode

    from iabn.conversion import recognise as module

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    def wrapper(x):
        raise AssertionError("the instance's forward ran")

    monkeypatch.setattr(module, "_cache", {})
    gelu = WrittenGELU()
    gelu.forward = wrapper
    with Counting():
        found = recognise(gelu).found
    assert type(found) is nn.GELU and found.approximate == "tanh"
    assert Counting.calls == 0
