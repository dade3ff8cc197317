"""iabn.convert on transformers and ConvNeXt-style models: layer and RMS norms and the GELU
and SiLU of their MLPs become iabn's layers that keep their output instead of their input
(tests/support/transformers.py; timm's ViT and ConvNeXt).

Each converted model computes what the original computes (float64 outputs and the gradients
of every parameter, train and eval mode, PyTorch's own modules as the reference), the
report's bytes are the models' own, and what each new layer alone keeps is exactly its
statistics (RMS and layer norms: one value per row) or its branch bits (activations: one bit
per element), the input it replaced no longer kept."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from conversion_checks import ACTIVATION_TOLERANCE, assert_bytes_are_real, assert_same_model
from transformer_models import Decoder, MixerNet

pytestmark = pytest.mark.usefixtures("analysis")


def _tokens():
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def _images(size=16):
    return torch.randn(2, 3, size, size, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(0))


def _randomise(model):
    """Weights away from their initial ones (ones and zeros), so that a rebuilt normalised
    input that ignored them would be wrong."""
    g = torch.Generator().manual_seed(5)
    for m in model.modules():
        for name in ("weight", "bias"):
            p = getattr(m, name, None)
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and p is not None:
                p.data = (torch.rand(p.shape, generator=g, dtype=p.dtype) + 0.5
                          if name == "weight" else torch.randn(p.shape, generator=g,
                                                               dtype=p.dtype))
    return model


def _decisions(report):
    return {row.name: row.decision for row in report.rows}


def test_a_llama_style_decoder_frees_its_norm_and_gate_inputs():
    model = _randomise(Decoder().double())
    tokens = _tokens()
    converted, report = iabn.convert(model, tokens)
    expected = {}
    for block in ("blocks.0", "blocks.1"):
        expected[f"{block}.attention_norm"] = "InPlaceRMSNorm(overwrite_input=False)"
        expected[f"{block}.mlp_norm"] = "InPlaceRMSNorm(overwrite_input=False)"
        expected[f"{block}.act"] = "InPlaceSiLU"
    expected["norm"] = "InPlaceRMSNorm"
    assert _decisions(report) == expected
    assert_same_model(model, converted, tokens)
    assert_bytes_are_real(model, converted, report, tokens)
    rows = {row.name: row for row in report.rows}
    positions = tokens.numel()
    for block in ("blocks.0", "blocks.1"):
        for norm in ("attention_norm", "mlp_norm"):
            # the norm alone keeps its input (32 float64 per position) and more; iabn's
            # keeps one float64 rstd per position (its output is the next linear's input)
            assert rows[f"{block}.{norm}"].saved_before >= positions * 32 * 8
            assert rows[f"{block}.{norm}"].saved_after == positions * 8
        # SiLU kept the gate's output; the in-place SiLU keeps one bit per element
        assert rows[f"{block}.act"].saved_before == positions * 88 * 8
        assert rows[f"{block}.act"].saved_after == math.ceil(positions * 88 / 8)
    freed = sum(r.saved_before - r.saved_after for r in report.rows)
    assert report.saved_before - report.saved_after == freed


def test_layer_norm_and_both_gelu_forms():
    model = _randomise(MixerNet().double())
    x = _images()
    converted, report = iabn.convert(model, x)
    decisions = _decisions(report)
    assert decisions["blocks.0.token_norm"] == "InPlaceLayerNorm(overwrite_input=False)"
    assert decisions["blocks.0.channel_norm"] == "InPlaceLayerNorm(overwrite_input=False)"
    assert decisions["blocks.1.token_mlp.1"] == "InPlaceGELU"
    assert decisions["blocks.1.channel_mlp.1"] == "InPlaceGELU"
    assert converted.get_submodule("blocks.1.channel_mlp.1").approximate == "tanh"
    assert decisions["norm"] == "InPlaceLayerNorm"
    assert_same_model(model, converted, x)
    assert_bytes_are_real(model, converted, report, x)
    assert report.saved_after < report.saved_before


class _Block(nn.Module):
    def __init__(self, act, combine, norm_first=False):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 6)
        self.act = act
        self.combine = combine
        self.norm_first = norm_first

    def forward(self, x):
        if self.norm_first:
            return self.combine(self.norm(x), x)
        h = self.fc(self.norm(x * 2))
        return self.combine(self.act(h), h)


@pytest.mark.parametrize("case, layer, words", [
    # the activation's input is read again by an addition, which keeps nothing
    ("reused", "InPlaceGELU(overwrite_input=False)", "not overwritten"),
    # ... by a product, which saves it for backward: keeping only the output frees nothing
    ("saved", "untouched", "also save"),
    # the output is written in place later: the new layer keeps it
    ("written", "untouched", "writes into"),
])
def test_the_rules_of_an_activation(case, layer, words):
    combine = {"reused": lambda a, h: a + h, "saved": lambda a, h: a * h,
               "written": lambda a, h: a.add_(h)}[case]
    model = _Block(nn.GELU(), combine).double()
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    row = next(r for r in report.rows if r.name == "act")
    assert row.decision == layer
    assert words in row.reason
    assert_same_model(model, converted, x)


def test_a_norm_of_the_model_input_or_written_later_stays():
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    model = _Block(nn.GELU(), lambda y, x: y + x, norm_first=True).double()
    _, report = iabn.convert(model, x)
    row = next(r for r in report.rows if r.name == "norm")
    assert row.decision == "untouched" and "the model's input" in row.reason

    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.norm = nn.LayerNorm(6)

        def forward(self, x):
            y = self.norm(self.fc(x))
            y.mul_(2)
            return y

    model = Written().double()
    converted, report = iabn.convert(model, x)
    row = next(r for r in report.rows if r.name == "norm")
    assert row.decision == "untouched" and "writes into" in row.reason
    assert_same_model(model, converted, x)


def test_a_shared_activation_module_stays():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
            self.act = nn.SiLU()

        def forward(self, x):
            return self.act(self.a(x)) + self.act(self.b(x))

    model = Shared().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    (row,) = report.rows
    assert row.decision == "untouched" and "more than once" in row.reason
    assert_same_model(model, converted, x)


def test_batch_norm_activations_are_still_fused():
    """An activation after a batch norm goes into the norm's layer, not into one of its own."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.SiLU(), nn.Conv2d(4, 4, 1),
                          nn.GELU()).double()
    x = _images(8)
    converted, report = iabn.convert(model, x)
    decisions = _decisions(report)
    assert decisions == {"1": "InPlaceABN", "4": "untouched"}
    # the last GELU's output is the model's: the caller may write into it, which a layer
    # keeping it for backward would not survive
    assert "returned by the model" in next(r.reason for r in report.rows if r.name == "4")
    assert type(converted[2]) is nn.Identity
    assert_same_model(model, converted, x)


def _timm(name, **kwargs):
    timm = pytest.importorskip("timm", reason="timm is not installed")
    return _randomise(timm.create_model(name, pretrained=False, num_classes=10, **kwargs))


def test_timm_vit_and_convnext_are_exact():
    for model, size in ((_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), 32),
                        (_timm("convnext_atto"), 32)):
        model = model.double()
        x = _images(size)
        converted, report = iabn.convert(model, x)
        assert report.counts.get("untouched", 0) == 0, report
        assert_same_model(model, converted, x, ACTIVATION_TOLERANCE)
        assert_bytes_are_real(model, converted, report, x)


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs, size, untouched", [
    # shifted windows (torch.roll), window partitions, patch merging's reshapes
    ("swin_tiny_patch4_window7_224", {"embed_dim": 24, "depths": (2, 2, 2, 2),
                                      "num_heads": (1, 1, 2, 2)}, 224, 0),
    # stochastic depth between the norms and the residual additions
    ("deit_tiny_patch16_224", {"depth": 2, "drop_path_rate": 0.1}, 224, 0),
    # layer scale (gamma) and relative position bias
    ("beit_base_patch16_224", {"depth": 2, "embed_dim": 96, "num_heads": 2}, 224, 0),
    # SwiGLU as one projection split by chunk: the SiLU's input shares the half a product
    # saves, so it stays (docs/limits.md)
    ("eva02_tiny_patch14_224", {"depth": 2}, 224, 2),
    # ConvNeXt V2's global response norm after the GELU: its 12 GlobalResponseNorm modules
    # (a 1-d weight and bias) are probed as norms and match none, a row each
    ("convnextv2_atto", {}, 64, 12),
])
def test_more_timm_models_are_exact(name, kwargs, size, untouched):
    model = _timm(name, **kwargs).double()
    x = _images(size)
    converted, report = iabn.convert(model, x)
    assert report.counts.get("untouched", 0) == untouched, report
    assert report.saved_after < report.saved_before
    assert_same_model(model, converted, x, ACTIVATION_TOLERANCE)
    assert_bytes_are_real(model, converted, report, x)


def test_a_functional_activation_stays():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.norm = nn.LayerNorm(6)

        def forward(self, x):
            return F.gelu(self.fc(self.norm(x + 1)))

    model = Functional().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    assert _decisions(report) == {"norm": "InPlaceLayerNorm"}
    assert_same_model(model, copy.deepcopy(converted), x)


def test_activations_false_replaces_only_the_norms():
    model = _randomise(Decoder().double())
    tokens = _tokens()
    converted, report = iabn.convert(model, tokens, activations=False)
    rows = {row.name: row for row in report.rows}
    assert rows["blocks.0.act"].decision == "untouched"
    assert "activations=False" in rows["blocks.0.act"].reason
    assert rows["blocks.0.mlp_norm"].decision == "InPlaceRMSNorm(overwrite_input=False)"
    assert type(converted.blocks[0].act) is nn.SiLU
    assert_same_model(model, converted, tokens)
    _, with_activations = iabn.convert(model, tokens)
    assert with_activations.saved_after < report.saved_after < report.saved_before
    with pytest.raises(TypeError, match="activations='no'"):
        iabn.convert(model, tokens, activations="no")
