"""The activation registry (iabn.kernels.activations): each record's functions against torch's
own module of it, in float64, and the facts the kernels and iabn.convert read from it."""

from pathlib import Path

import pytest
import torch

from iabn.kernels import activations as act

from helpers import BRANCH, INVERTIBLE, activation_names, param_for

F64 = torch.float64


def _points():
    return torch.cat([torch.linspace(-12, 12, 2401, dtype=F64),
                      torch.tensor([0.0, -0.0, 1e-300, -1e-300, -30.0, 30.0], dtype=F64)])


@pytest.mark.parametrize("name", activation_names())
def test_apply_and_apply__are_torch_s_module(name):
    record = act.ACTIVATIONS[name]
    param = param_for(name)
    y = _points()
    expected = record.torch_module(param)(y)
    assert torch.equal(record.apply(y, param), expected)
    assert torch.equal(record.apply_(y.clone(), param), expected)


@pytest.mark.parametrize("name", INVERTIBLE)
def test_invert_and_grad_from_output_recover_torch_s_input_and_gradient(name):
    record = act.ACTIVATIONS[name]
    param = param_for(name)
    y = torch.linspace(-6, 6, 1201, dtype=F64).requires_grad_()
    z = record.torch_module(param)(y)
    dz = torch.linspace(-1, 1, y.numel(), dtype=F64)
    (dy,) = torch.autograd.grad(z, y, dz)
    torch.testing.assert_close(record.invert(z.detach(), param), y.detach(), rtol=1e-12,
                               atol=1e-12)
    torch.testing.assert_close(record.grad_from_output(dz, z.detach(), param), dy,
                               rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("name", BRANCH)
def test_the_minimum_s_functions_are_torch_s(name):
    """``value`` and ``derivative`` equal torch's module and its autograd derivative; the
    log tail is ``log(phi(y) / y)`` and its derivative that of the log tail, for ``y < 0``."""
    minimum = act.ACTIVATIONS[name].minimum
    module = act.ACTIVATIONS[name].torch_module()
    y = torch.linspace(-8, 8, 1601, dtype=F64).requires_grad_()
    z = module(y)
    (slope,) = torch.autograd.grad(z.sum(), y)
    y = y.detach()
    # (gelu's erfc form differs from torch's erf form where the latter cancels: 1.5e-16)
    torch.testing.assert_close(minimum.value(y), z.detach(), rtol=1e-14, atol=1e-15)
    # torch's derivative of the tanh GELU, 0.5 (1 + tanh u) + ..., cancels in the left tail:
    # measured against mpmath (40 digits) over this range it is off by 4.7e-15, the
    # registry's by 2.2e-16, so its reference takes 1e-14 (2x torch's error)
    atol = 1e-14 if name == "gelu_tanh" else 1e-15
    torch.testing.assert_close(minimum.derivative(y), slope, rtol=1e-12, atol=atol)
    # (above -3, where torch's gelu loses under 1e-13 of itself to cancellation)
    left = y[(y < -1e-3) & (y > -3)].clone().requires_grad_()
    tail = torch.log(module(left) / left)
    (tail_slope,) = torch.autograd.grad(tail.sum(), left)
    torch.testing.assert_close(minimum.log_tail(left.detach()), tail.detach(), rtol=1e-12,
                               atol=1e-14)
    torch.testing.assert_close(minimum.log_tail_derivative(left.detach()), tail_slope,
                               rtol=1e-9, atol=1e-12)


def test_kinds_and_codes():
    """Every activation the kernels run has its own code, which the kernels' source names;
    the activations with a minimum are those that need a branch bit."""
    codes = [a.code for a in act.ACTIVATIONS.values() if a.code is not None]
    assert len(codes) == len(set(codes))
    # the kernels run in-place activations only; one without a code (softplus) is left to
    # the reference by the Triton backend (backends.backend_for)
    assert set(act.IN_PLACE_ACTIVATIONS) >= {n for n, a in act.ACTIVATIONS.items()
                                             if a.code is not None}
    source = (Path(act.__file__).parent / "triton_kernels.py").read_text()
    for name, record in act.ACTIVATIONS.items():
        assert record.needs_branch == (record.minimum is not None)
        assert not (record.invertible and record.needs_branch), name
        if record.code is not None:
            assert f'"{name}"' in source, name


def test_gelu_in_place_float32_is_the_erfc_form_on_every_element():
    """The norm layers' GELU (``apply_``, float32, in place) against ``y erfc(-y / sqrt 2) /
    2`` in float64 at the same inputs: above zero within 1.5 eps of it (measured 1.14; torch's
    ``F.gelu``, 2.91: the erfc form is the closer); below zero within 1.5x of the 100 eps
    measured (torch's float32 erfc where it is small) and nonzero down to y = -14, where
    ``F.gelu`` is 0 below -5.5 (its ``1 + erf`` cancels)."""
    eps = torch.finfo(torch.float32).eps
    y = torch.linspace(-14, 10, 200001, dtype=F64).float()
    exact = 0.5 * y.double() * torch.special.erfc(-y.double() / 2 ** 0.5)
    z = act.ACTIVATIONS["gelu"].minimum.apply_(y.clone()).double()
    relative = (z - exact).abs() / exact.abs().clamp(min=1e-300)
    left = y < 0
    normal = exact.abs() >= torch.finfo(torch.float32).tiny  # subnormal below y = -13.1
    assert relative[y > 0].max().item() <= 1.5 * eps
    assert relative[left & normal].max().item() <= 1.5 * 100 * eps
    assert (z[left] != 0).all()
    torch_relative = (torch.nn.functional.gelu(y).double() - exact).abs() / exact.abs()
    assert torch_relative[y > 0].max().item() > relative[y > 0].max().item()
