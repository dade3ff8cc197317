"""The models the memory benchmarks use: they respect the in-place contract, and with the same
weights ``iabn``, ``abn`` and ``bn`` (LeakyReLU everywhere) give the same gradients."""

import pytest
import torch

from iabn.models import MODELS, NORM_ACT_NAMES, create

from helpers import ORIGINAL_KEYS, reference_layout

SIZE = 32  # input height = width: every model handles it (output stride 32 -> 1x1)


@pytest.mark.parametrize("name", [
    "resnet18", pytest.param("resnet50", marks=pytest.mark.slow),
    pytest.param("vgg19", marks=pytest.mark.slow), "mobilenet_v2",
    pytest.param("resnext50", marks=pytest.mark.slow), "densenet121"])
def test_norm_act_layers_agree(name):
    torch.manual_seed(0)
    reference = create(name, num_classes=5, norm_act="bn").double()
    x = torch.randn(2, 3, SIZE, SIZE, dtype=torch.float64)
    grads = {}
    for layer in ("bn", "abn", "iabn"):
        model = create(name, num_classes=5, norm_act=layer).double()
        model.load_state_dict(reference.state_dict())  # the same keys for every norm_act
        out = model(x.clone())
        out.square().sum().backward()
        grads[layer] = (out.detach(), {k: p.grad for k, p in model.named_parameters()})
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


# the smallest of each family by default (wider_resnet16, its _a2 form, resnet18 and the like);
# the deeper models are slow
_DEEP = ("resnet101", "resnet152", "resnext101", "resnext152", "densenet264", "wider_resnet20",
         "wider_resnet20_a2", "wider_resnet38", "wider_resnet38_a2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _DEEP else n
                                  for n in sorted(MODELS)])
def test_every_model_trains_a_step_with_inplace_abn(name):
    torch.manual_seed(0)
    model = create(name, num_classes=3)
    x = torch.randn(2, 3, SIZE, SIZE)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 2]))
    loss.backward()  # the in-place contract is violated -> autograd raises here
    assert all(p.grad is not None for p in model.parameters())


def test_factory_errors():
    with pytest.raises(ValueError, match="unknown model 'resnet9'"):
        create("resnet9")
    with pytest.raises(ValueError, match="unknown norm_act='gn'"):
        create("resnet50", norm_act="gn")
    assert NORM_ACT_NAMES == ("bn", "abn", "iabn", "iabn_sync")


REFERENCE_LAYOUTS = [
    ("resnet34", {}, "imagenet_resnet34_ipabn-sync_lr_512_keys.txt", None),
    ("resnet50", {}, "imagenet_resnet50_ipabn-sync_lr_512_keys.txt", None),
    ("densenet264", {}, "imagenet_densenet264_ipabn_lr_256_keys.txt", None),
    ("resnet101", {}, "imagenet_resnet101_ipabn-sync_lr_512_keys.txt", None),
    ("resnext101", {}, "imagenet_resnext101_ipabn_lr_512_keys.txt", None),
    ("resnext152", {}, "imagenet_resnext152_ipabn_lr_256_keys.txt", None),
    ("wider_resnet38", {}, "imagenet_wider_resnet38_ipabn_lr_256_keys.txt", None),
    ("wider_resnet38_a2", {"dilation": True, "num_classes": None},
     "vistas_wrn38_deeplabv3_keys.txt", "body"),
]


@pytest.mark.parametrize("name,kwargs,file,section", REFERENCE_LAYOUTS,
                         ids=[r[0] for r in REFERENCE_LAYOUTS])
def test_keys_and_shapes_match_the_original_checkpoints(name, kwargs, file, section):
    expected = reference_layout(ORIGINAL_KEYS / file, section)
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = create(name, norm_act="iabn", **kwargs)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert ours == expected


def test_dilated_wider_resnet_a2_has_output_stride_8_and_trains_with_inplace_abn():
    torch.manual_seed(0)
    model = create("wider_resnet38_a2", dilation=True, num_classes=None)
    x = torch.randn(2, 3, 32, 32)
    features = model(x)
    assert features.shape == (2, 4096, 4, 4)
    features.mean().backward()  # pre-activation blocks copy x before an in-place bn1
    assert model.mod2.block1.bn1.weight.grad is not None


def test_dilated_resnext_keeps_output_stride_8_and_the_weights():
    plain = create("resnext50", num_classes=None, norm_act="bn")
    dilated = create("resnext50", num_classes=None, norm_act="bn", dilation=True)
    dilated.load_state_dict(plain.state_dict())  # same keys and shapes
    x = torch.randn(1, 3, 64, 48)
    with torch.no_grad():
        assert torch.nn.Sequential(*plain.body())(x).shape[-2:] == (2, 2)
        assert torch.nn.Sequential(*dilated.body())(x).shape[-2:] == (8, 6)
    convs = {name: m.dilation for name, m in dilated.named_modules() if name.endswith("conv2")}
    assert convs["mod4.block1.convs.conv2"] == (2, 2) and convs["mod5.block1.convs.conv2"] == (4, 4)
    assert convs["mod3.block1.convs.conv2"] == (1, 1)


def test_wider_resnet_width_scales_every_layer():
    full = create("wider_resnet16_a2", num_classes=None, norm_act="bn", dilation=True)
    small = create("wider_resnet16_a2", num_classes=None, norm_act="bn", dilation=True,
                   width=1 / 16)
    assert full.out_channels == 4096 and small.out_channels == 256
    convs = [(m.in_channels, m.out_channels) for m in full.modules()
             if isinstance(m, torch.nn.Conv2d)]
    small_convs = [(m.in_channels, m.out_channels) for m in small.modules()
                   if isinstance(m, torch.nn.Conv2d)]
    assert small_convs[0] == (3, 4)
    assert [(i // 16, o // 16) for i, o in convs[1:]] == small_convs[1:]
    x = torch.randn(2, 3, 32, 24)
    assert torch.nn.Sequential(*small.body())(x).shape == (2, 256, 4, 3)
    with pytest.raises(ValueError, match="width=0"):
        create("wider_resnet16_a2", width=0)
