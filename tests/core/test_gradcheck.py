"""float64 ``torch.autograd.gradcheck`` of the in-place layer's hand-written backward."""

import pytest
import torch

from iabn.functional import abn, inplace_abn

from helpers import (
    ACTIVATION_PARAMS,
    INVERTIBLE,
    TRITON_DEVICE,
    memory_format_for,
    runs_triton,
)

CASES = [  # (shape, channels_last)
    ((5, 3), False),
    ((3, 2, 5), False),
    ((2, 3, 3, 4), False),
    ((2, 3, 3, 4), True),
    ((2, 2, 2, 3, 3), False),
    ((2, 2, 2, 3, 3), True),
]


def _inputs(shape, channels_last, device="cpu"):
    fmt = memory_format_for(len(shape), channels_last)
    x = (torch.randn(shape, dtype=torch.float64) * 1.5 + 0.3).to(device)
    x = x.contiguous(memory_format=fmt)
    channels = shape[1]
    sign = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)[:channels]
    sign = sign.repeat(channels)[:channels]
    weight = (torch.rand(channels, dtype=torch.float64) + 0.5) * sign
    bias = torch.randn(channels, dtype=torch.float64)
    return [t.to(device).requires_grad_() for t in (x, weight, bias)]


def _gradcheck_layer(shape, channels_last, activation, training, variant=2, fast_mode=False,
                     device="cpu"):
    x, weight, bias = _inputs(shape, channels_last, device)
    channels = shape[1]
    running_mean = torch.randn(channels, dtype=torch.float64).to(device)
    running_var = (torch.rand(channels, dtype=torch.float64) + 0.5).to(device)
    param = ACTIVATION_PARAMS[activation] or 0.01

    def fn(x, weight, bias):
        # clone: the layer overwrites its input, gradcheck's leaf must stay intact
        return inplace_abn(
            x.clone(), running_mean.clone(), running_var.clone(), weight, bias, training,
            0.1, 1e-5, activation, param, variant=variant,
        )

    return torch.autograd.gradcheck(fn, (x, weight, bias), eps=1e-6, atol=1e-7, rtol=1e-5,
                                    fast_mode=fast_mode)


@pytest.mark.parametrize("shape,channels_last", CASES, ids=str)
@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_gradcheck(shape, channels_last, activation, variant, training):
    assert _gradcheck_layer(shape, channels_last, activation, training, variant)


@pytest.mark.parametrize("shape,channels_last", CASES, ids=str)
@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@runs_triton
# 9 s on 2 cores under the interpreter; the reference kernels' gradcheck runs by default
@pytest.mark.slow
def test_gradcheck_triton_kernels(shape, channels_last, activation, training, monkeypatch):
    """The Triton kernels' backward in float64 (under the interpreter on CPU, compiled on
    CUDA). fast_mode checks random vector-Jacobian products instead of every column, which
    keeps the interpreted run short; a wrong gradient still fails it."""
    pytest.importorskip("triton")
    monkeypatch.setenv("IABN_BACKEND", "triton")
    assert _gradcheck_layer(shape, channels_last, activation, training, fast_mode=True,
                            device=TRITON_DEVICE)


@pytest.mark.parametrize("gamma_mode", ["signed", "abs"])
@pytest.mark.parametrize("layer", ["inplace_abn", "abn"])
def test_gradcheck_gamma_modes(gamma_mode, layer):
    x, weight, bias = _inputs((3, 3, 4, 3), channels_last=False)

    def fn(x, weight, bias):
        if layer == "abn":
            return abn(x, None, None, weight, bias, True, gamma_mode=gamma_mode)
        return inplace_abn(x.clone(), None, None, weight, bias, True, gamma_mode=gamma_mode)

    assert torch.autograd.gradcheck(fn, (x, weight, bias), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_without_affine():
    x, _, _ = _inputs((4, 3, 3), channels_last=False)

    def fn(x):
        return inplace_abn(x.clone(), None, None, None, None, True, activation="elu",
                           activation_param=1.0)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_backward_variants_agree_with_each_other_and_only_need_requested_grads():
    x, weight, bias = _inputs((3, 4, 5, 5), channels_last=False)
    grads = []
    for variant in (1, 2):
        out = inplace_abn(x.clone(), None, None, weight, bias, True, variant=variant)
        grads.append(torch.autograd.grad(out.square().sum(), (x, weight, bias)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    # only the weight's gradient: dx is not computed, and nothing fails
    frozen = x.detach().clone()
    out = inplace_abn(frozen, None, None, weight, bias, True)
    (gw,) = torch.autograd.grad(out.sum(), (weight,))
    assert gw.shape == weight.shape


def test_double_backward_is_refused_with_a_pointer_to_abn():
    x, weight, bias = _inputs((3, 4, 5), channels_last=False)
    out = inplace_abn(x.clone(), None, None, weight, bias, True)
    with pytest.raises(RuntimeError, match=r"double backward.*iabn\.ABN"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)

