"""Models of the conversion figures in docs/usage/conversion.md that are not a plain
torchvision or timm name, as factories for ``iabn memory pkg.module:factory``. From the
repository root (``examples`` is imported from the current folder, so put it on PYTHONPATH)::

    PYTHONPATH=. iabn memory examples.zoo_models:resnet50_group_norm --input 8,3,224,224

tests/conversion/test_convert_zoo.py builds the same models from these factories.
"""

from __future__ import annotations

from torch import nn


def resnet50_group_norm(num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50 with ``nn.GroupNorm(32, C)`` in place of every batch norm
    (the usual choice for small per-device batches: detection, segmentation)."""
    import torchvision

    return torchvision.models.resnet50(num_classes=num_classes,
                                       norm_layer=lambda c: nn.GroupNorm(32, c))


class _ResBlock(nn.Module):
    """A diffusion UNet's residual block (as in DDPM's and Stable Diffusion's UNets, without
    the time embedding): ``x + conv(SiLU(GN(conv(SiLU(GN(x))))))``."""

    def __init__(self, channels: int, groups: int = 32) -> None:
        super().__init__()
        self.norm1, self.act1 = nn.GroupNorm(groups, channels), nn.SiLU()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2, self.act2 = nn.GroupNorm(groups, channels), nn.SiLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(self.act2(self.norm2(self.conv1(self.act1(self.norm1(x))))))


def diffusion_resblocks(channels: int = 128, blocks: int = 4) -> nn.Module:
    """A stem convolution and ``blocks`` diffusion-UNet residual blocks (GroupNorm(32) +
    SiLU before each convolution) at one resolution."""
    return nn.Sequential(nn.Conv2d(3, channels, 3, padding=1),
                         *[_ResBlock(channels) for _ in range(blocks)])


def _smp(architecture: str, **kwargs) -> nn.Module:
    """A segmentation_models_pytorch model with a ResNet-18 encoder, random weights (nothing
    is downloaded). Its package is not a dependency of iabn: ``pip install
    segmentation-models-pytorch``."""
    import segmentation_models_pytorch as smp

    return getattr(smp, architecture)(encoder_name="resnet18", encoder_weights=None,
                                      classes=21, **kwargs)


def smp_fpn() -> nn.Module:
    return _smp("FPN")


def smp_deeplabv3plus() -> nn.Module:
    return _smp("DeepLabV3Plus")


def smp_unetplusplus() -> nn.Module:
    return _smp("UnetPlusPlus")
