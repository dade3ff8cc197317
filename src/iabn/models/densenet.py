"""DenseNet-121/169/201/264 (growth 32, bottleneck 4, compression 0.5) with a 3x3 input stem
and pre-activation layers, named like the original ``inplace_abn`` checkpoints (``mod1``,
``modN.convs1.i``/``convs3.i`` ``{bn, conv}``, ``traN``, ``bn_out``, ``classifier.fc``).

Each layer normalises the concatenation of its module's input and all earlier outputs; the
concatenation is a fresh tensor, so an in-place norm may overwrite it. (The concatenations
are rebuilt per layer, which costs memory quadratic in the module's depth; the original
package's shared-buffer trick is not reproduced.)
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from .common import classifier_head, init_weights, input_3x3_stem
from .norm_act import NormAct, norm_act_factory

LAYERS = {121: (6, 12, 24, 16), 169: (6, 12, 32, 32), 201: (6, 12, 48, 32),
          264: (6, 12, 64, 48)}


def _bn_conv(make: NormAct, in_channels: int, out_channels: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(OrderedDict([
        ("bn", make(in_channels)),
        ("conv", nn.Conv2d(in_channels, out_channels, kernel, padding=kernel // 2, bias=False)),
    ]))


class DenseModule(nn.Module):
    def __init__(self, in_channels: int, layers: int, make: NormAct, growth: int = 32,
                 bottleneck: int = 4) -> None:
        super().__init__()
        width = growth * bottleneck
        self.convs1 = nn.ModuleList(
            _bn_conv(make, in_channels + growth * i, width, 1) for i in range(layers))
        self.convs3 = nn.ModuleList(_bn_conv(make, width, growth, 3) for _ in range(layers))
        self.out_channels = in_channels + growth * layers

    def forward(self, x: Tensor) -> Tensor:
        features = [x]
        for conv1, conv3 in zip(self.convs1, self.convs3, strict=True):
            features.append(conv3(conv1(torch.cat(features, 1))))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    def __init__(self, depth: int = 121, num_classes: int = 1000,
                 norm_act: str | NormAct = "iabn", activation: str = "leaky_relu",
                 activation_param: float = 0.01) -> None:
        super().__init__()
        if depth not in LAYERS:
            raise ValueError(f"depth={depth}: use one of {sorted(LAYERS)}")
        make = norm_act_factory(norm_act, activation, activation_param)
        self.mod1 = input_3x3_stem(make)
        self._body: list[nn.Module] = [self.mod1]
        channels = 64
        for index, layers in enumerate(LAYERS[depth]):
            if index > 0:
                transition = nn.Sequential(OrderedDict([
                    ("bn", make(channels)),
                    ("conv", nn.Conv2d(channels, channels // 2, 1, bias=False)),
                    ("pool", nn.AvgPool2d(2, 2)),
                ]))
                self.add_module(f"tra{index + 1}", transition)
                self._body.append(transition)
                channels //= 2
            module = DenseModule(channels, layers, make)
            self.add_module(f"mod{index + 2}", module)
            self._body.append(module)
            channels = module.out_channels
        self.bn_out = make(channels)
        self.classifier = classifier_head(channels, num_classes)
        init_weights(self)

    def body(self) -> list[nn.Module]:
        return list(self._body)

    def forward(self, x: Tensor) -> Tensor:
        for module in self._body:
            x = module(x)
        return self.classifier(self.bn_out(x))
