"""VGG-19 with a norm + activation layer after every convolution (VGG-19-BN layout).

The classifier is global average pooling + one linear layer rather than the original three
4096-wide layers: they hold 120 M parameters but no activations worth offloading, and would
dominate the memory of CPU tests and benchmarks.
"""

from __future__ import annotations

from torch import Tensor, nn

from .common import classifier_head, init_weights
from .norm_act import NormAct, norm_act_factory

CONFIG_19 = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
             512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


class VGG(nn.Module):
    def __init__(self, num_classes: int = 1000, norm_act: str | NormAct = "iabn",
                 activation: str = "leaky_relu", activation_param: float = 0.01) -> None:
        super().__init__()
        make = norm_act_factory(norm_act, activation, activation_param)
        layers: list[nn.Module] = []
        channels = 3
        for item in CONFIG_19:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, item, 3, padding=1, bias=False), make(item)]
                channels = item
        self.features = nn.Sequential(*layers)
        self.classifier = classifier_head(channels, num_classes)
        init_weights(self)

    def body(self) -> list[nn.Module]:
        """The feature layers in order (for checkpointing and offloading by segment)."""
        return list(self.features)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))

