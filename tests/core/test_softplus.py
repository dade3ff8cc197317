"""Softplus, the activation added through the registry alone: ``InPlaceABN`` and
``InPlaceGroupNormAct`` with ``activation="softplus"`` (``activation_param`` is ``beta``, the
threshold torch's default 20), and ``iabn.InPlaceSoftplus(beta, threshold)`` without a norm.
Softplus is monotone, so the input is recovered from the output alone (no branch bit).

References are PyTorch's own modules (``nn.BatchNorm2d``, ``nn.GroupNorm``, ``nn.Softplus``)
in float64; every gradient within 1e-12 of its largest value (measured: at most 7.8e-16).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from iabn.memory import saved_tensor_bytes

F64 = torch.float64
BETA = 1.5


def _close(got, want, rel=1e-12):
    scale = want.abs().max().clamp(min=1.0)
    assert (got - want).abs().max() <= rel * scale, float((got - want).abs().max() / scale)


def _run(module, x, dz):
    leaf = x.clone().requires_grad_()
    out = module(leaf.clone() if getattr(module, "overwrite_input", False) else leaf)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(out, [leaf, *params], dz)
    return out.detach(), grads


@pytest.mark.parametrize("training", [True, False])
def test_inplace_abn_softplus_equals_batchnorm_and_softplus(training):
    torch.manual_seed(0)
    x = torch.randn(6, 4, 5, 5, dtype=F64) * 3
    dz = torch.randn_like(x)
    ours = iabn.InPlaceABN(4, activation="softplus", activation_param=BETA, dtype=F64)
    bn = nn.BatchNorm2d(4, dtype=F64)
    with torch.no_grad():
        for layer in (ours, bn):
            layer.weight.copy_(torch.tensor([0.5, -2.0, 1.0, 3.0]))
            layer.bias.copy_(torch.tensor([0.1, -1.0, 2.0, 0.0]))
            layer.running_mean.copy_(torch.tensor([0.2, -0.3, 0.0, 1.0]))
    ours.train(training), bn.train(training)
    reference = nn.Sequential(bn, nn.Softplus(BETA))
    out, grads = _run(ours, x, dz)
    want_out, want_grads = _run(reference, x, dz)
    _close(out, want_out)
    for got, want in zip(grads, want_grads, strict=True):
        _close(got, want)
    _close(ours.running_mean, bn.running_mean)
    _close(ours.running_var, bn.running_var)


def test_inplace_group_norm_softplus_equals_group_norm_and_softplus():
    torch.manual_seed(1)
    x = torch.randn(3, 6, 4, 4, dtype=F64) * 2
    dz = torch.randn_like(x)
    ours = iabn.InPlaceGroupNormAct(3, 6, activation="softplus", activation_param=BETA,
                                    dtype=F64)
    gn = nn.GroupNorm(3, 6, dtype=F64)
    with torch.no_grad():
        for layer in (ours, gn):
            layer.weight.copy_(torch.linspace(-2, 2, 6))
            layer.bias.copy_(torch.linspace(-1, 1, 6))
    out, grads = _run(ours, x, dz)
    want_out, want_grads = _run(nn.Sequential(gn, nn.Softplus(BETA)), x, dz)
    _close(out, want_out)
    for got, want in zip(grads, want_grads, strict=True):
        _close(got, want)


@pytest.mark.parametrize("beta, threshold", [(1.0, 20.0), (BETA, 20.0), (0.5, 30.0)])
@pytest.mark.parametrize("overwrite", [True, False])
def test_inplace_softplus_equals_torch(beta, threshold, overwrite):
    """Outputs bit for bit; input gradients within 1e-12 of the largest, over both sides of
    the threshold and the far left tail."""
    x = torch.cat([torch.linspace(-80, 80, 1601, dtype=F64),
                   torch.tensor([0.0, 19.99, 20.0, 20.01, 59.99, 60.0, 60.01])])
    dz = torch.linspace(-1, 1, x.numel(), dtype=F64)
    ours = iabn.InPlaceSoftplus(beta, threshold, overwrite_input=overwrite)
    out, (dx,) = _run(ours, x, dz)
    want, (want_dx,) = _run(nn.Softplus(beta, threshold), x, dz)
    assert torch.equal(out, want)
    _close(dx, want_dx)


def test_inplace_softplus_keeps_only_its_output():
    """Between two linear layers nn.Softplus keeps its input and the next layer its output;
    InPlaceSoftplus keeps only the output, in the input's storage: one activation less."""
    torch.manual_seed(4)

    def model(act):
        first, second = nn.Linear(32, 32), nn.Linear(32, 32)
        return lambda x: second(act(first(x)))

    x = torch.randn(64, 32)
    saved = {name: saved_tensor_bytes(model(act), x)
             for name, act in (("torch", nn.Softplus()), ("iabn", iabn.InPlaceSoftplus()))}
    assert saved["torch"] - saved["iabn"] == 64 * 32 * 4, saved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_torch_s_own_error(dtype):
    """InPlaceABN(softplus) in half precision: input gradient no farther from the float64
    reference than twice PyTorch's own layers in that dtype (measured: 1.00x bfloat16, 1.02x
    float16)."""
    torch.manual_seed(2)
    x64 = (torch.randn(8, 4, 6, 6, dtype=F64) * 2).to(dtype).double()
    dz64 = torch.randn_like(x64).to(dtype).double()

    def grad(module, dt):
        leaf = x64.to(dt).requires_grad_()
        out = module(leaf.clone())
        (dx,) = torch.autograd.grad(out, leaf, dz64.to(dt))
        return dx.double()

    exact = grad(nn.Sequential(nn.BatchNorm2d(4, dtype=F64), nn.Softplus(BETA)), F64)
    torch_err = (grad(nn.Sequential(nn.BatchNorm2d(4), nn.Softplus(BETA)).to(dtype), dtype)
                 - exact).abs().max()
    ours = iabn.InPlaceABN(4, activation="softplus", activation_param=BETA).to(dtype)
    our_err = (grad(ours, dtype) - exact).abs().max()
    assert our_err <= 2 * torch_err, (float(our_err), float(torch_err))


def test_underflowed_output_gives_finite_gradients():
    """An output that underflowed to 0 (float32, y below about -103 / beta) recovers a finite
    input (the smallest normal output's): every gradient stays finite."""
    x = torch.tensor([[-200.0, -1.0, 0.5, 3.0], [-150.0, 2.0, -0.5, 1.0]]).T.contiguous()
    x = x.reshape(4, 2)
    layer = iabn.InPlaceABN(2, activation="softplus", activation_param=1.0,
                            momentum=0.0)
    with torch.no_grad():
        layer.weight.fill_(50.0)
    leaf = x.clone().requires_grad_()
    layer(leaf.clone()).sum().backward()
    assert torch.isfinite(leaf.grad).all() and torch.isfinite(layer.weight.grad).all()


def test_convert_fuses_batch_norm_and_softplus_and_swaps_a_standalone_one():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Softplus(BETA),
                          nn.Conv2d(8, 8, 1), nn.Softplus(), nn.Conv2d(8, 4, 1)).double()
    x = torch.randn(2, 3, 10, 10, dtype=F64)
    converted, report = iabn.convert(model, x)
    kinds = [type(m).__name__ for m in converted.modules()]
    assert "InPlaceABN" in kinds and "InPlaceSoftplus" in kinds, report
    assert report.saved_after < report.saved_before
    for mode in (True, False):
        model.train(mode), converted.train(mode)
        want = model(x)
        got = converted(x)
        _close(got, want)
        grads = torch.autograd.grad(got.sum(), list(converted.parameters()))
        want_grads = torch.autograd.grad(want.sum(), list(model.parameters()))
        for g, w in zip(grads, want_grads, strict=True):
            _close(g, w)


def test_softplus_with_another_threshold_is_not_fused():
    """A norm layer computes softplus with torch's default threshold; nn.Softplus with
    another one is another function and stays (the norm goes in place without it)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Softplus(threshold=5.0),
                          nn.Conv2d(8, 4, 1))
    converted, _ = iabn.convert(model, torch.randn(2, 3, 8, 8))
    assert not any(isinstance(m, iabn.InPlaceABN) and m.activation == "softplus"
                   for m in converted.modules())
    assert any(type(m) is nn.Softplus and m.threshold == 5.0 for m in converted.modules())


def test_argument_errors():
    with pytest.raises(ValueError, match=r"beta=0\.0: must be a finite number > 0"):
        iabn.InPlaceSoftplus(0.0)
    with pytest.raises(ValueError, match=r"threshold=4\.0: must be a finite number >= 20"):
        iabn.InPlaceSoftplus(threshold=4.0)
    with pytest.raises(ValueError, match=r"activation_param=-1\.0 is the beta of softplus"):
        iabn.InPlaceABN(4, activation="softplus", activation_param=-1.0)
    x = torch.randn(3, 4)
    assert torch.equal(F.softplus(x), iabn.InPlaceSoftplus(overwrite_input=False)(x))
