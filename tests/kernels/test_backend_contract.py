"""Every kernel backend keeps the contract of iabn.kernels.backend.KernelBackend: the same
functions with the same leading parameters (extra ones only with defaults), and the
synchronised layer's two halves give, in one process, the gradient of the single-process
backward, checked against nn.BatchNorm2d + nn.LeakyReLU in float64."""

import inspect

import pytest
import torch

from iabn.kernels import backends, reference
from iabn.kernels.backend import KernelBackend
from iabn.kernels.common import LayerConfig

from helpers import TRITON_DEVICE

CONTRACT = ("forward_", "backward", "local_sums", "input_grad", "activation_grad",
            "group_norm_forward_", "group_norm_backward", "row_norm_forward", "row_norm_backward")


def _backends():
    yield reference
    if backends.has_triton():
        from iabn.kernels import triton_backend

        yield triton_backend


def test_the_contract_names_the_nine_functions():
    declared = {name for name, value in vars(KernelBackend).items()
                if inspect.isfunction(value) and not name.startswith("_")}
    assert declared == set(CONTRACT)


@pytest.mark.parametrize("module", list(_backends()), ids=lambda m: m.__name__.rsplit(".")[-1])
@pytest.mark.parametrize("function", CONTRACT)
def test_backend_signatures_keep_the_contract(module, function):
    declared = list(inspect.signature(getattr(KernelBackend, function)).parameters.values())[1:]
    actual = list(inspect.signature(getattr(module, function)).parameters.values())
    assert [p.name for p in actual[: len(declared)]] == [p.name for p in declared]
    assert [p.kind for p in actual[: len(declared)]] == [p.kind for p in declared]
    extra = actual[len(declared):]
    assert all(p.default is not inspect.Parameter.empty for p in extra), extra


@pytest.mark.parametrize("choice", backends.CHOICES)
def test_every_backend_dispatch_returns_keeps_it(monkeypatch, choice):
    """backend_for returns one of the modules checked above whatever IABN_BACKEND says, so the
    layers need no second dispatcher for the synchronised halves."""
    if choice == "triton" and not backends.has_triton():
        pytest.skip("Triton is not installed")
    x = torch.zeros(2, 3, device=TRITON_DEVICE if choice == "triton" else "cpu")
    monkeypatch.setenv(backends.ENV, choice)
    assert backends.backend_for(x) in list(_backends())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_synchronised_halves_in_one_process_give_the_backward(backend, device, dtype):
    """local_sums -> (the all-reduce of one rank: the sums themselves) -> input_grad equals
    nn.BatchNorm2d + LeakyReLU's float64 input gradient: in float64 within 1e-12 of the
    largest (measured: 1.8e-15 reference, 8.9e-14 Triton interpreted, relative to 4.4); in
    bfloat16 within 4x the largest error of PyTorch's own layers in bfloat16 (measured: 1.0x
    reference, 2.0x Triton interpreted: its dx is rounded from float32 once, PyTorch's
    happened to round closer on these values)."""
    torch.manual_seed(0)

    def exact(t):  # values every dtype holds exactly: the reference sees the same inputs
        return t.to(torch.bfloat16).double()

    x64 = exact(torch.randn(8, 3, 16, 16, dtype=torch.float64, device=device))
    dz64 = exact(torch.randn_like(x64))
    w64 = exact(torch.rand(3, dtype=torch.float64, device=device) + 0.5)
    b64 = exact(torch.randn(3, dtype=torch.float64, device=device))

    x = x64.clone().requires_grad_()
    bn = torch.nn.BatchNorm2d(3, device=device, dtype=torch.float64)
    with torch.no_grad():
        bn.weight.copy_(w64), bn.bias.copy_(b64)
    torch.nn.functional.leaky_relu(bn(x), 0.01).backward(dz64)
    expected = x.grad
    with backends.use_backend(backend):
        x = x64.to(dtype, copy=True)
        kernels = backends.backend_for(x)
        config = LayerConfig(True, 0.0, 1e-5, "leaky_relu", 0.01, "signed")
        params = torch.float64 if dtype == torch.float64 else torch.float32
        weight, bias = w64.to(params), b64.to(params)
        invstd, scale = kernels.forward_(x, weight, bias, None, None, config)
        saved, sums = kernels.local_sums(x, dz64.to(dtype), bias, scale, config)
        total = torch.tensor(float(x.numel() // 3), dtype=torch.float64, device=device)
        dx = kernels.input_grad(saved, bias, scale, invstd, sums.clone(), total, dtype)
    assert dx.dtype == dtype and dx.shape == x.shape
    error = (dx.double() - expected).abs().max()
    if dtype == torch.float64:
        assert error <= 1e-12 * expected.abs().max()
    else:  # PyTorch's own layers in bfloat16 (float32 parameters), against the same float64
        x = x64.to(dtype, copy=True).requires_grad_()
        bn = torch.nn.BatchNorm2d(3, device=device)
        with torch.no_grad():
            bn.weight.copy_(w64), bn.bias.copy_(b64)
        torch.nn.functional.leaky_relu(bn(x), 0.01).backward(dz64.to(dtype))
        assert error <= 4 * (x.grad.double() - expected).abs().max()


def test_a_backend_may_leave_a_function_to_the_reference():
    """from_reference gives a backend the reference's functions by name (the Triton backend
    takes the group norm's and the row norms' forward that way; the row norms' backward is
    its own) and refuses a name the contract does not declare."""
    from iabn.kernels.backend import CONTRACT as declared
    from iabn.kernels.backend import from_reference

    assert set(declared) == set(CONTRACT)
    assert from_reference("row_norm_forward") == (reference.row_norm_forward,)
    with pytest.raises(ValueError, match="not functions of the backend contract"):
        from_reference("group_norm")
    if backends.has_triton():
        from iabn.kernels import triton_backend

        for name in ("group_norm_forward_", "group_norm_backward", "row_norm_forward"):
            assert getattr(triton_backend, name) is getattr(reference, name)
        assert triton_backend.row_norm_backward is not reference.row_norm_backward


def test_an_activation_a_backend_does_not_run_goes_to_the_reference(monkeypatch):
    """A backend that runs only some activations names them (KNOWN_ACTIVATIONS); backend_for
    gives the reference for another, so a registry record without Triton code runs."""
    if not backends.has_triton():
        pytest.skip("Triton is not installed")
    from iabn.kernels import triton_backend

    x = torch.zeros(2, 3, device=TRITON_DEVICE)
    monkeypatch.setenv(backends.ENV, "triton")
    assert backends.backend_for(x, "leaky_relu") is triton_backend
    monkeypatch.setattr(triton_backend, "KNOWN_ACTIVATIONS", frozenset({"elu"}))
    assert backends.backend_for(x, "leaky_relu") is reference
    assert backends.backend_for(x) is triton_backend
