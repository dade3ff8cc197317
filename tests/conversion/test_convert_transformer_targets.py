"""The activation-memory targets of the conversion of transformers: timm's ViT-S/16 and
ConvNeXt-T at 2x3x224x224, float32, random weights, lossless. Exact bytes (the report's, and
the models' own counted again); on fx's trace only (test_convert_transformers.py checks the
recorded run's decisions on the same kinds of layers)."""

import pytest
import torch

import iabn
from conversion_checks import assert_bytes_are_real


def _timm(name):
    timm = pytest.importorskip("timm", reason="timm is not installed")
    return timm.create_model(name, pretrained=False)


@pytest.mark.slow
@pytest.mark.parametrize("name, target", [("vit_small_patch16_224", 0.66),
                                          ("convnext_tiny", 0.60)])
def test_the_activation_memory_targets(name, target):
    """timm's ViT-S/16 and ConvNeXt-T at 2x3x224x224, float32, random weights: lossless
    conversion keeps at most 0.66x and 0.60x of their activation bytes."""
    model = _timm(name)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    converted, report = iabn.convert(model, x, verify=False)
    print(report)
    assert_bytes_are_real(model, converted, report, x)
    assert report.saved_after <= target * report.saved_before
