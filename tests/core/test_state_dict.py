"""State dicts: the keys of nn.BatchNorm2d, weight portability both ways, old checkpoints."""

import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn

from helpers import randomise_


def test_parameters_buffers_and_keys_match_batchnorm():
    ours, theirs = iabn.InPlaceABN(7), nn.BatchNorm2d(7)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_parameters()] == ["weight", "bias"]
    assert [n for n, _ in ours.named_buffers()] == [
        "running_mean", "running_var", "num_batches_tracked"
    ]
    assert list(iabn.InPlaceABN(3, affine=False, track_running_stats=False).state_dict()) == []


def _conv_bn_net(norm_act):
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *norm_act(8), nn.Conv2d(8, 4, 1))


def test_batchnorm_trained_state_dict_reproduces_outputs():
    """Train with nn.BatchNorm2d + LeakyReLU, load into InPlaceABN: same outputs."""
    torch.manual_seed(0)
    reference = _conv_bn_net(lambda c: [nn.BatchNorm2d(c), nn.LeakyReLU(0.01)])
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        reference(torch.randn(6, 3, 8, 8)).square().mean().backward()
        opt.step()
    with torch.no_grad():
        reference[1].weight[::2].neg_()  # make sure negative gammas are covered
    ours = _conv_bn_net(lambda c: [iabn.InPlaceABN(c)])
    missing = ours.load_state_dict(_renumber(reference.state_dict()))
    assert not missing.missing_keys and not missing.unexpected_keys
    x = torch.randn(4, 3, 8, 8)
    for training in (False, True):
        reference.train(training)
        ours.train(training)
        torch.testing.assert_close(ours(x), reference(x), atol=1e-5, rtol=1e-5)


def _renumber(state):
    """Sequential index 3 (the conv after BN, LeakyReLU) becomes 2 (after InPlaceABN)."""
    return {k.replace("3.", "2.", 1) if k.startswith("3.") else k: v for k, v in state.items()}


def test_abs_mode_reproduces_the_original_parametrisation():
    """gamma_mode='abs' computes with |gamma| + eps, as the original inplace_abn package."""
    bn = randomise_(nn.BatchNorm2d(5)).eval()
    original = iabn.InPlaceABN(5, gamma_mode="abs").eval()
    original.load_state_dict(bn.state_dict())
    with torch.no_grad():
        bn.weight.copy_(bn.weight.abs() + original.eps)
    x = torch.randn(3, 5, 4, 4)
    torch.testing.assert_close(original(x.clone()), nn.functional.leaky_relu(bn(x), 0.01))


def test_signed_mode_clamps_only_tiny_gammas():
    layer = iabn.InPlaceABN(3, activation="identity", affine=True).eval()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([0.0, -1e-7, -2.0]))
        layer.bias.zero_()
    out = layer(torch.ones(1, 3, 1, 1) * 2)  # running stats 0/1: out = g * 2 / sqrt(1 + eps)
    expected = torch.tensor([1e-5, -1e-5, -2.0]) * 2 / (1 + 1e-5) ** 0.5
    torch.testing.assert_close(out.flatten(), expected)


@pytest.mark.parametrize("with_metadata", [True, False])
def test_old_checkpoint_without_num_batches_tracked_loads(with_metadata):
    source = randomise_(nn.BatchNorm2d(4))
    state = source.state_dict()
    del state["num_batches_tracked"]
    if with_metadata:
        state._metadata = {"": {"version": 1}}  # written by a module without the buffer
    else:
        state = dict(state)  # a plain dict, as the original package's checkpoints load
    layer = iabn.InPlaceABN(4)
    layer.load_state_dict(state)
    assert layer.num_batches_tracked.item() == 0
    torch.testing.assert_close(layer.running_var, source.running_var)


def test_round_trip_through_torch_save():
    layer = iabn.InPlaceABN(6, momentum=None, activation="elu", activation_param=0.5)
    layer(torch.randn(4, 6, 3, 3))
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    clone = iabn.InPlaceABN(6, momentum=None, activation="elu", activation_param=0.5)
    clone.load_state_dict(torch.load(buffer))
    for key, value in layer.state_dict().items():
        assert torch.equal(clone.state_dict()[key], value), key
    x = torch.randn(2, 6, 3, 3)
    torch.testing.assert_close(clone.eval()(x.clone()), layer.eval()(x.clone()))


def test_reset_parameters_and_running_stats():
    layer = iabn.InPlaceABN(4)
    randomise_(layer)
    layer.num_batches_tracked.fill_(7)
    layer.reset_running_stats()
    assert torch.equal(layer.running_mean, torch.zeros(4))
    assert torch.equal(layer.running_var, torch.ones(4))
    assert layer.num_batches_tracked.item() == 0
    randomise_(layer)
    layer.reset_parameters()
    assert torch.equal(layer.weight, torch.ones(4)) and torch.equal(layer.bias, torch.zeros(4))


def test_not_converted_by_sync_batchnorm():
    """nn.SyncBatchNorm.convert_sync_batchnorm must not swallow the activation."""
    model = nn.Sequential(iabn.InPlaceABN(4), iabn.ABN(4))
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(converted[0], iabn.InPlaceABN) and isinstance(converted[1], iabn.ABN)


@pytest.mark.parametrize("training", [True, False])
def test_abn_signed_does_not_clamp_tiny_weights(training):
    """The non-in-place ABN inverts nothing, so in signed mode it must compute
    exactly nn.BatchNorm2d + activation even for |weight| < eps (zero-initialised last BN of a
    residual branch)."""
    torch.manual_seed(0)
    bn = randomise_(nn.BatchNorm2d(4).double())
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.0, -0.0, 3e-6, -1e-7], dtype=torch.float64))
    layer = iabn.ABN(4, activation="leaky_relu", activation_param=0.1).double()
    layer.load_state_dict(bn.state_dict())
    bn.train(training)
    layer.train(training)
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    expected = nn.functional.leaky_relu(bn(x), 0.1)
    out = layer(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    dy = torch.randn_like(out)
    ref_grads = torch.autograd.grad(expected, (x, bn.weight, bn.bias), dy)
    our_grads = torch.autograd.grad(out, (x, layer.weight, layer.bias), dy)
    for ours, ref in zip(our_grads, ref_grads, strict=True):
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-13)


@pytest.fixture
def fresh_gamma_warning(monkeypatch):
    import iabn.layers.options

    monkeypatch.setattr(iabn.layers.options, "_warned_abs_into_signed", False)


def _abs_trained_net():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 1), iabn.InPlaceABN(4, gamma_mode="abs"),
                        nn.Conv2d(4, 4, 1), iabn.ABN(4, gamma_mode="abs")).eval()
    randomise_(net[1])
    randomise_(net[3])
    return net


def test_abs_state_into_signed_layer_warns_once(fresh_gamma_warning, tmp_path):
    """Abs-trained weights loaded into default (signed) layers changed the
    outputs silently."""
    net = _abs_trained_net()
    path = tmp_path / "abs.pt"
    torch.save(net.state_dict(), path)
    state = torch.load(path, weights_only=True)
    signed = nn.Sequential(nn.Conv2d(3, 4, 1), iabn.InPlaceABN(4), nn.Conv2d(4, 4, 1),
                           iabn.ABN(4)).eval()
    with pytest.warns(iabn.layers.options.GammaModeWarning,
                      match=r"^1: .*gamma_mode='abs'.*iabn\.compat\.to_signed"):
        signed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        signed.load_state_dict(state)  # once per process
    # and it is right to warn: the outputs differ from the abs model's
    x = torch.randn(2, 3, 4, 4)
    assert (signed(x) - net(x)).abs().max() > 1e-3


def test_no_warning_when_modes_agree(fresh_gamma_warning):
    state = _abs_trained_net().state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nn.Sequential(nn.Conv2d(3, 4, 1), iabn.InPlaceABN(4, gamma_mode="abs"),
                      nn.Conv2d(4, 4, 1), iabn.ABN(4, gamma_mode="abs")).load_state_dict(state)
        iabn.InPlaceABN(4).load_state_dict(nn.BatchNorm2d(4).state_dict())
        iabn.InPlaceABN(4).load_state_dict(iabn.InPlaceABN(4).state_dict())


def test_abs_to_signed_conversion_is_exact(fresh_gamma_warning):
    from iabn.compat import to_signed_state_dict

    net = _abs_trained_net()
    converted = to_signed_state_dict(net.state_dict())
    signed = nn.Sequential(nn.Conv2d(3, 4, 1), iabn.InPlaceABN(4), nn.Conv2d(4, 4, 1),
                           iabn.ABN(4)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # converted: nothing to warn about
        signed.load_state_dict(converted)
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(signed(x), net(x))
    # independent reference: nn.BatchNorm2d + LeakyReLU with the converted weights
    bn = nn.BatchNorm2d(4).eval()
    bn.load_state_dict({k.removeprefix("1."): v for k, v in converted.items()
                        if k.startswith("1.")})
    torch.testing.assert_close(signed[1](net[0](x)), F.leaky_relu(bn(net[0](x)), 0.01),
                               rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="layers="):
        to_signed_state_dict(dict(net.state_dict()))


def test_iabn_test_reports_abs_weights_in_signed_layers(tmp_path):
    # iabn test belongs to the tools (torchvision data stack); CI's oldest-torch step runs this
    # file with the library core only.
    pytest.importorskip("torchvision")
    from iabn.tools.training.evaluate import load_weights

    net = _abs_trained_net()
    path = tmp_path / "abs.pt"
    torch.save({"state_dict": net.state_dict()}, path)
    signed = nn.Sequential(nn.Conv2d(3, 4, 1), iabn.InPlaceABN(4), nn.Conv2d(4, 4, 1),
                           iabn.ABN(4))
    report, _ = load_weights(signed, path)
    assert report.ok and len(report.warnings) == 1
    assert "2 layer(s) (1, 3)" in str(report) and "to_signed_state_dict" in str(report)
