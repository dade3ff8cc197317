"""The models the memory benchmarks use: they respect the in-place contract, and with the same
weights ``iabn``, ``abn`` and ``bn`` (LeakyReLU everywhere) give the same gradients."""

import pytest
import torch

from iabn.models import MODELS, NORM_ACT_NAMES, create

SIZES = {"resnet50": 32, "resnet101": 32, "resnet152": 32, "vgg19": 32, "mobilenet_v2": 32}


def _portable_state(model):
    """A state_dict with nn.Sequential(BatchNorm2d, act)'s ``.0.`` removed from BN keys."""
    state = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        norm_entry = parts[-1] in (
            "weight", "bias", "running_mean", "running_var", "num_batches_tracked")
        # value.dim() <= 1: a norm's entry, not the weight of a conv inside a Sequential
        if len(parts) >= 2 and parts[-2] == "0" and norm_entry and value.dim() <= 1:
            parts.pop(-2)
        state[".".join(parts)] = value
    return state


@pytest.mark.parametrize("name", ["resnet50", "vgg19", "mobilenet_v2"])
def test_norm_act_layers_agree(name):
    torch.manual_seed(0)
    reference = create(name, num_classes=5, norm_act="bn").double()
    x = torch.randn(2, 3, SIZES[name], SIZES[name], dtype=torch.float64)
    grads = {}
    for layer in ("bn", "abn", "iabn"):
        model = create(name, num_classes=5, norm_act=layer).double()
        state = reference.state_dict() if layer == "bn" else _portable_state(reference)
        model.load_state_dict(state)
        out = model(x.clone())
        out.square().sum().backward()
        grads[layer] = (out.detach(), {k: p.grad for k, p in _named_grads(model, layer)})
    # Float64 round-off only. Gradients of these deep, freshly initialised nets reach 1e7, and
    # some are zero up to round-off (a norm's bias feeding a 1x1 conv and another norm), so
    # each tensor is compared as a whole against the largest gradient's scale.
    scale = max(g.norm().item() for g in grads["bn"][1].values())
    for layer in ("abn", "iabn"):
        torch.testing.assert_close(grads[layer][0], grads["bn"][0], atol=1e-9, rtol=1e-9)
        for key, grad in grads[layer][1].items():
            expected = grads["bn"][1][key]
            error = (grad - expected).norm().item()
            assert error <= 1e-10 * (expected.norm().item() + scale), (layer, key, error)


def _named_grads(model, layer):
    for key, param in model.named_parameters():
        if layer == "bn":
            parts = key.split(".")
            if parts[-2] == "0" and param.dim() == 1 and parts[-1] in ("weight", "bias"):
                parts.pop(-2)
            key = ".".join(parts)
        yield key, param


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_trains_a_step_with_inplace_abn(name):
    torch.manual_seed(0)
    model = create(name, num_classes=3)
    x = torch.randn(2, 3, SIZES[name], SIZES[name])
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 2]))
    loss.backward()  # the in-place contract is violated -> autograd raises here
    assert all(p.grad is not None for p in model.parameters())


def test_factory_errors():
    with pytest.raises(ValueError, match="unknown model 'resnet9'"):
        create("resnet9")
    with pytest.raises(ValueError, match="unknown norm_act='gn'"):
        create("resnet50", norm_act="gn")
    assert NORM_ACT_NAMES == ("bn", "abn", "iabn", "iabn_sync")
