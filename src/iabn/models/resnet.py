"""ResNet v1 (post-activation bottlenecks) with a pluggable norm + activation layer.

In a bottleneck, the last norm has no activation (``identity``): the activation follows the
residual sum, applied in place to the sum (a fresh tensor). The block's input is read by the
first convolution and by the shortcut and is never written, so in-place norm layers are safe.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .norm_act import NormAct, norm_act_factory

DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int, make: NormAct,
                 activation: str, activation_param: float) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = make(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = make(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = make(out_channels, "identity")
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                make(out_channels, "identity"),
            )
        self.activation, self.activation_param = activation, activation_param

    def forward(self, x: Tensor) -> Tensor:
        residual = x if self.shortcut is None else self.shortcut(x)
        out = self.bn1(self.conv1(x))
        out = self.bn2(self.conv2(out))
        out = self.bn3(self.conv3(out)) + residual
        return _activate_(out, self.activation, self.activation_param)


def _activate_(x: Tensor, activation: str, param: float) -> Tensor:
    if activation == "leaky_relu":
        return F.leaky_relu_(x, param)
    if activation == "elu":
        return F.elu_(x, param)
    if activation == "relu":
        return F.relu_(x)
    return x


class ResNet(nn.Module):
    """ResNet-50/101/152 v1. ``norm_act``: ``"bn"``, ``"abn"``, ``"iabn"``, ``"iabn_sync"`` or a
    callable (see :mod:`iabn.models.norm_act`)."""

    def __init__(self, depth: int = 50, num_classes: int = 1000, norm_act: str | NormAct = "iabn",
                 activation: str = "leaky_relu", activation_param: float = 0.01) -> None:
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"depth={depth}: use one of {sorted(DEPTHS)}")
        make = norm_act_factory(norm_act, activation, activation_param)
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), make(64),
                                  nn.MaxPool2d(3, 2, 1))
        stages, channels = [], 64
        for index, blocks in enumerate(DEPTHS[depth]):
            width = 64 * 2**index
            layers = []
            for b in range(blocks):
                stride = 2 if b == 0 and index > 0 else 1
                layers.append(Bottleneck(channels, width, stride, make, activation,
                                         activation_param))
                channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        _init(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.pool(self.stages(self.stem(x))).flatten(1))



def _init(model: nn.Module) -> None:
    """He initialisation for convolutions (fan-out), as the original training scripts."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.01)
            nn.init.zeros_(module.bias)
