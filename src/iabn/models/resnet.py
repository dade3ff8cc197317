"""ResNet v1 (post-activation bottlenecks) with a pluggable norm + activation layer.

Module names follow the original ``inplace_abn`` ImageNet models (``mod1`` .. ``mod5``,
``blockN.convs.{conv,bn}{1,2,3}``, ``proj_conv``/``proj_bn``, ``classifier.fc``), so their
checkpoints load after stripping the ``module.`` prefix (with ``gamma_mode="abs"`` layers).

In a bottleneck the last norm and the projection norm have no activation (``identity``); the
activation follows the residual sum, applied in place to the sum (a fresh tensor). The block's
input is read by the first convolution and by the shortcut and never written, so in-place norm
layers are safe.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from ..kernels import activations as act
from .common import classifier_head, init_weights
from .norm_act import NormAct, norm_act_factory

DEPTHS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3),
          152: (3, 8, 36, 3)}


class _ResidualV1(nn.Module):
    """``act(convs(x) + shortcut)``: the shortcut is ``x``, or ``proj_bn(proj_conv(x))`` when
    the block changes stride or width. Subclasses build ``convs`` (ending in a norm without
    activation)."""

    expansion = 1

    def __init__(self, in_channels: int, out_channels: int, stride: int, make: NormAct,
                 activation: str, activation_param: float, convs: nn.Sequential) -> None:
        super().__init__()
        self.convs = convs
        self.proj_conv = self.proj_bn = None
        if stride != 1 or in_channels != out_channels:
            self.proj_conv = nn.Conv2d(in_channels, out_channels, 1, stride, bias=False)
            self.proj_bn = make(out_channels, "identity")
        self.activation, self.activation_param = activation, activation_param

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x if self.proj_conv is None else self.proj_bn(self.proj_conv(x))
        out = self.convs(x) + shortcut
        return act.apply_(out, self.activation, self.activation_param)


class BasicBlock(_ResidualV1):
    """Two 3x3 convolutions (ResNet-18/34); the first carries the stride."""

    def __init__(self, in_channels: int, width: int, stride: int, make: NormAct,
                 activation: str, activation_param: float) -> None:
        convs = nn.Sequential(OrderedDict([
            ("conv1", nn.Conv2d(in_channels, width, 3, stride, 1, bias=False)),
            ("bn1", make(width)),
            ("conv2", nn.Conv2d(width, width, 3, 1, 1, bias=False)),
            ("bn2", make(width, "identity")),
        ]))
        super().__init__(in_channels, width, stride, make, activation, activation_param, convs)


class Bottleneck(_ResidualV1):
    """1x1 -> 3x3 (carries the stride) -> 1x1 expanding to ``4 * width`` (ResNet-50+)."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int, make: NormAct,
                 activation: str, activation_param: float) -> None:
        out_channels = width * self.expansion
        convs = nn.Sequential(OrderedDict([
            ("conv1", nn.Conv2d(in_channels, width, 1, bias=False)),
            ("bn1", make(width)),
            ("conv2", nn.Conv2d(width, width, 3, stride, 1, bias=False)),
            ("bn2", make(width)),
            ("conv3", nn.Conv2d(width, out_channels, 1, bias=False)),
            ("bn3", make(out_channels, "identity")),
        ]))
        super().__init__(in_channels, out_channels, stride, make, activation, activation_param,
                         convs)


class ResNet(nn.Module):
    """ResNet-18/34 (basic blocks) and 50/101/152 (bottlenecks), v1. ``norm_act``: ``"bn"``,
    ``"abn"``, ``"iabn"``, ``"iabn_sync"`` or a callable (see :mod:`iabn.models.norm_act`)."""

    def __init__(self, depth: int = 50, num_classes: int = 1000, norm_act: str | NormAct = "iabn",
                 activation: str = "leaky_relu", activation_param: float = 0.01) -> None:
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"depth={depth}: use one of {sorted(DEPTHS)}")
        make = norm_act_factory(norm_act, activation, activation_param)
        self.mod1 = nn.Sequential(OrderedDict([
            ("conv1", nn.Conv2d(3, 64, 7, 2, 3, bias=False)), ("bn1", make(64)),
            ("pool1", nn.MaxPool2d(3, 2, 1)),
        ]))
        channels = 64
        block_type = BasicBlock if depth < 50 else Bottleneck
        for index, blocks in enumerate(DEPTHS[depth]):
            width = 64 * 2**index
            layers = OrderedDict()
            for b in range(blocks):
                stride = 2 if b == 0 and index > 0 else 1
                layers[f"block{b + 1}"] = block_type(channels, width, stride, make, activation,
                                                     activation_param)
                channels = width * block_type.expansion
            self.add_module(f"mod{index + 2}", nn.Sequential(layers))
        self.classifier = classifier_head(channels, num_classes)
        init_weights(self)

    def body(self) -> list[nn.Module]:
        """The stem and every block, in order (for checkpointing and offloading by segment)."""
        return [self.mod1, *(block for i in range(2, 6) for block in getattr(self, f"mod{i}"))]

    def forward(self, x: Tensor) -> Tensor:
        for module in self.body():
            x = module(x)
        return self.classifier(x)
