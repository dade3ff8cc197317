"""MobileNetV2 (inverted residuals) with a pluggable norm + activation layer.

The projection's norm has no activation (linear bottleneck); where a block adds its input,
that input is only read (by the expansion convolution and by the sum), never written.
"""

from __future__ import annotations

from torch import Tensor, nn

from .common import classifier_head, init_weights
from .norm_act import NormAct, norm_act_factory

# (expansion, output channels, repeats, first stride)
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
            (6, 160, 3, 2), (6, 320, 1, 1))


class InvertedResidual(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int,
                 make: NormAct) -> None:
        super().__init__()
        hidden = in_channels * expansion
        layers: list[nn.Module] = []
        if expansion != 1:
            layers += [nn.Conv2d(in_channels, hidden, 1, bias=False), make(hidden)]
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), make(hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False), make(out_channels, "identity"),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x: Tensor) -> Tensor:
        out = self.body(x)
        return out + x if self.residual else out


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = 1000, norm_act: str | NormAct = "iabn",
                 activation: str = "leaky_relu", activation_param: float = 0.01) -> None:
        super().__init__()
        make = norm_act_factory(norm_act, activation, activation_param)
        layers: list[nn.Module] = [nn.Conv2d(3, 32, 3, 2, 1, bias=False), make(32)]
        channels = 32
        for expansion, out_channels, repeats, stride in SETTINGS:
            for index in range(repeats):
                layers.append(InvertedResidual(channels, out_channels,
                                               stride if index == 0 else 1, expansion, make))
                channels = out_channels
        layers += [nn.Conv2d(channels, 1280, 1, bias=False), make(1280)]
        self.features = nn.Sequential(*layers)
        self.classifier = classifier_head(1280, num_classes)
        init_weights(self)

    def body(self) -> list[nn.Module]:
        """The feature layers in order (for checkpointing and offloading by segment)."""
        return list(self.features)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

