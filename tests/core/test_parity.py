"""InPlaceABN and ABN against ``nn.BatchNorm*`` + the matching ``torch.nn`` activation."""

import copy

import pytest
import torch

import iabn

from helpers import (
    ACTIVATION_PARAMS,
    INVERTIBLE,
    activation_names,
    memory_format_for,
    randomise_,
    torch_activation,
)
from helpers import torch_batchnorm as make_bn

SHAPES = [
    (4, 3),             # (N, C)
    (3, 5, 7),          # (N, C, L), odd sizes
    (2, 6, 5, 7),       # (N, C, H, W)
    (1, 3, 4, 5),       # N = 1 with spatial size > 1
    (6, 7, 1, 1),       # 1x1 spatial, N > 1, non-power-of-two C
    (2, 4, 3, 4, 5),    # (N, C, D, H, W)
]


def _pair(shape, activation, layer_cls=iabn.InPlaceABN, dtype=torch.float64, device="cpu",
          **kw):
    """(reference bn, reference activation, iabn layer) with identical state, on ``device``
    (the reference runs on the same device: PyTorch's own kernels there)."""
    bn_kw = {k: v for k, v in kw.items() if k in ("momentum", "affine", "track_running_stats")}
    layer_kw = {k: v for k, v in kw.items() if k not in bn_kw}
    bn = randomise_(make_bn(len(shape), shape[1], **bn_kw).to(dtype)).to(device)
    param = ACTIVATION_PARAMS.get(activation, 0.0)
    layer = layer_cls(
        shape[1], activation=activation, activation_param=param or 0.01, **bn_kw, **layer_kw
    ).to(dtype=dtype, device=device)
    layer.load_state_dict(bn.state_dict())
    return bn, torch_activation(activation, param), layer


def _run(bn, act, layer, x, grad, training):
    bn.train(training)
    layer.train(training)
    x_ref = x.clone().requires_grad_()
    out_ref = act(bn(x_ref))
    out_ref.backward(grad)
    x_leaf = x.clone().requires_grad_()
    out = layer(x_leaf.clone())  # a non-leaf input, as in a network
    out.backward(grad)
    return out_ref, x_ref.grad, out, x_leaf.grad


def _assert_same(bn, layer, out_ref, gx_ref, out, gx, atol):
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=0)
    torch.testing.assert_close(gx, gx_ref, atol=atol, rtol=0)
    if bn.weight is not None:
        torch.testing.assert_close(layer.weight.grad, bn.weight.grad, atol=atol * 10, rtol=0)
        torch.testing.assert_close(layer.bias.grad, bn.bias.grad, atol=atol * 10, rtol=0)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        if getattr(bn, name) is not None:
            torch.testing.assert_close(getattr(layer, name), getattr(bn, name), atol=atol, rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_inplace_abn_matches_torch_float64(shape, activation, variant, training, backend,
                                           device):
    bn, act, layer = _pair(shape, activation, variant=variant, device=device)
    if training and shape[0] * torch.Size(shape[2:]).numel() == 1:
        pytest.skip("one value per channel")
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.5).to(device)
    grad = torch.randn(shape, dtype=torch.float64).to(device)
    results = _run(bn, act, layer, x, grad, training)
    _assert_same(bn, layer, *results, atol=1e-12)


@pytest.mark.parametrize("activation", activation_names(branch=False))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_abn_matches_torch(activation, training):
    shape = (3, 6, 5, 4)
    bn, act, layer = _pair(shape, activation, layer_cls=iabn.ABN)
    x = torch.randn(shape, dtype=torch.float64)
    grad = torch.randn(shape, dtype=torch.float64)
    results = _run(bn, act, layer, x, grad, training)
    _assert_same(bn, layer, *results, atol=1e-12)


@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, iabn.ABN])
@pytest.mark.parametrize(
    "options",
    [
        {"momentum": None},
        {"momentum": 0.3},
        {"affine": False},
        {"track_running_stats": False},
        {"affine": False, "track_running_stats": False},
    ],
    ids=str,
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_options_match_torch_over_several_steps(layer_cls, options, training, backend,
                                                device):
    if layer_cls is iabn.ABN and backend == "triton":
        pytest.skip("ABN runs on torch.nn.functional, not on the kernels")
    shape = (4, 6, 3, 5)
    bn, act, layer = _pair(shape, "leaky_relu", layer_cls=layer_cls, device=device, **options)
    for _ in range(3):  # several steps: the cumulative average of momentum=None needs them
        x = torch.randn(shape, dtype=torch.float64).to(device)
        grad = torch.randn(shape, dtype=torch.float64).to(device)
        if bn.weight is not None:
            bn.weight.grad = bn.bias.grad = layer.weight.grad = layer.bias.grad = None
        results = _run(bn, act, layer, x, grad, training)
        _assert_same(bn, layer, *results, atol=1e-12)


@pytest.mark.parametrize("ndim", [4, 5])
@pytest.mark.parametrize("variant", [1, 2])
def test_channels_last_keeps_format_and_matches(ndim, variant, backend, device):
    shape = (2, 6, 5, 4) if ndim == 4 else (2, 6, 3, 4, 5)
    fmt = memory_format_for(ndim, channels_last=True)
    bn, act, layer = _pair(shape, "leaky_relu", dtype=torch.float32, variant=variant,
                           device=device)
    x = torch.randn(shape).to(device).contiguous(memory_format=fmt)
    grad = torch.randn(shape).to(device).contiguous(memory_format=fmt)
    out_ref, gx_ref, out, gx = _run(bn, act, layer, x, grad, training=True)
    assert out.is_contiguous(memory_format=fmt)
    _assert_same(bn, layer, out_ref, gx_ref, out, gx, atol=1e-5)


def test_output_is_the_input_storage():
    layer = iabn.InPlaceABN(4)
    x = torch.randn(3, 4, 5, 5, requires_grad=True).clone()
    ptr = x.data_ptr()
    out = layer(x)
    assert out is x and out.data_ptr() == ptr


@pytest.mark.parametrize(
    "make_view",
    [
        lambda t: t.transpose(0, 2),              # permuted
        lambda t: t[:, :, ::2],                   # strided slice
        lambda t: t[:, :, 1:4, 1:],               # offset window
    ],
    ids=["transposed", "strided", "window"],
)
def test_non_contiguous_input_is_correct_and_written_in_place(make_view, backend, device):
    base = torch.randn(6, 5, 7, 6, dtype=torch.float64).to(device)
    x = make_view(base.clone())
    shape = tuple(x.shape)
    bn, act, layer = _pair(shape, "leaky_relu", device=device)
    expected = act(bn(x.clone()))
    out = layer(x)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(x, expected, atol=1e-12, rtol=0)  # the view itself was written


def test_gradient_for_expanded_upstream_gradient_is_not_written(backend, device):
    """An expanded (stride-0) incoming gradient must be read, never written."""
    layer = iabn.InPlaceABN(3, activation="identity").double().to(device)
    bn = randomise_(torch.nn.BatchNorm2d(3).double()).to(device)
    layer.load_state_dict(bn.state_dict())
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64).to(device)
    x_ref = x.clone().requires_grad_()
    bn(x_ref).sum().backward()  # sum's backward hands on an expanded gradient
    x_leaf = x.clone().requires_grad_()
    layer(x_leaf.clone()).sum().backward()
    torch.testing.assert_close(x_leaf.grad, x_ref.grad, atol=1e-12, rtol=0)


def test_retain_graph_backward_twice_gives_same_gradients(backend, device):
    layer = iabn.InPlaceABN(4, activation="elu", activation_param=1.0).to(device)
    x = torch.randn(3, 4, 5, 5).to(device).requires_grad_()
    out = layer(x.clone())
    grad = torch.randn_like(out)
    out.backward(grad, retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    out.backward(grad)
    torch.testing.assert_close(x.grad, first, atol=0, rtol=0)


def test_deepcopy_and_repr():
    layer = iabn.InPlaceABN(8, momentum=None, activation="elu", activation_param=0.5, variant=1)
    text = repr(layer)
    assert text == (
        "InPlaceABN(8, eps=1e-05, momentum=None, affine=True, track_running_stats=True, "
        "activation=elu, activation_param=0.5, variant=1)"
    )
    assert repr(copy.deepcopy(layer)) == text
    assert "relu" in repr(iabn.ABN(3, activation="relu"))
    assert "gamma_mode=abs" in repr(iabn.InPlaceABN(3, gamma_mode="abs"))


def test_no_grad_and_inference_mode_run_in_place():
    layer = iabn.InPlaceABN(4).eval()
    bn = torch.nn.BatchNorm2d(4).eval()
    x = torch.randn(2, 4, 3, 3)
    expected = torch.nn.functional.leaky_relu(bn(x), 0.01)
    with torch.no_grad():
        y = x.clone()
        assert layer(y) is y
        torch.testing.assert_close(y, expected)
    with torch.inference_mode():
        y = x.clone()
        torch.testing.assert_close(layer(y), expected)


def test_network_of_layers_sharing_scratch_memory_matches_torch():
    """Several layers of different sizes reuse the backward's scratch buffers in turn; the
    last layer's input (34 KiB) is under scratch.MIN_BYTES and gets fresh temporaries."""
    from iabn.kernels import scratch

    def net(norm_act):
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), norm_act(8),
            torch.nn.Conv2d(8, 16, 3, stride=2), norm_act(16),
            torch.nn.Conv2d(16, 4, 1), norm_act(4),
        ).double()

    torch.manual_seed(0)
    reference = net(lambda c: torch.nn.Sequential(torch.nn.BatchNorm2d(c),
                                                  torch.nn.LeakyReLU(0.01)))
    ours = net(lambda c: iabn.InPlaceABN(c))
    state = {k.replace(".0.", ".", 1) if k.count(".") == 2 else k: v
             for k, v in reference.state_dict().items()}
    ours.load_state_dict(state)
    scratch.release()
    x = torch.randn(3, 3, 40, 40, dtype=torch.float64)  # layer inputs: 300, 135, 34 KiB
    for model in (reference, ours):
        model(x).square().sum().backward()
    assert scratch.held_bytes() == 2 * 3 * 8 * 40 * 40 * 8  # two buffers of the largest input
    for (name, a), b in zip(reference.named_parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-10, rtol=1e-10, msg=name)
    scratch.release()
    assert scratch.held_bytes() == 0


@pytest.mark.parametrize(
    "make_view",
    [lambda t: t.transpose(0, 2), lambda t: t[:, :, ::2], lambda t: t[:, 2:5]],
    ids=["transposed", "strided", "channel-slice"],
)
def test_in_place_on_a_view_of_an_intermediate_has_correct_gradients(make_view, backend,
                                                                      device):
    """Autograd rebases the written view onto its base; gradients must flow through both."""
    base = torch.randn(6, 8, 7, 6, dtype=torch.float64).to(device).requires_grad_()
    channels = make_view(base).shape[1]
    bn, act, layer = _pair(tuple(make_view(base).shape), "leaky_relu", device=device)
    bn.train()
    expected = act(bn(make_view(base).clone()))
    grad = torch.randn_like(expected)
    (grad_expected,) = torch.autograd.grad((expected * grad).sum(), base)

    work = base * 1.0
    out = layer(make_view(work))
    assert out.shape[1] == channels
    (grad_ours,) = torch.autograd.grad((out * grad).sum(), base)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad_ours, grad_expected, atol=1e-12, rtol=0)
