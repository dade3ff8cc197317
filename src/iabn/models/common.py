"""Pieces every model shares: the classifier head, the 3x3 input stem, initialisation."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from .norm_act import NormAct


def classifier_head(channels: int, num_classes: int) -> nn.Sequential:
    """Global average pooling and one linear layer, as ``classifier.fc`` in the checkpoints."""
    return nn.Sequential(OrderedDict([
        ("avg_pool", nn.AdaptiveAvgPool2d(1)), ("flatten", nn.Flatten()),
        ("fc", nn.Linear(channels, num_classes)),
    ]))


def input_3x3_stem(make: NormAct) -> nn.Sequential:
    """Three 3x3 convolutions (the first with stride 2) and a max-pool: ``mod1`` of ResNeXt
    and DenseNet. No norm after ``conv3``: the next block's pre-activation norm follows."""
    return nn.Sequential(OrderedDict([
        ("conv1", nn.Conv2d(3, 64, 3, 2, 1, bias=False)), ("bn1", make(64)),
        ("conv2", nn.Conv2d(64, 64, 3, 1, 1, bias=False)), ("bn2", make(64)),
        ("conv3", nn.Conv2d(64, 64, 3, 1, 1, bias=False)),
        ("pool", nn.MaxPool2d(3, 2, 1)),
    ]))


def init_weights(model: nn.Module) -> None:
    """He initialisation for convolutions (fan-out), as the original training scripts."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.01)
            nn.init.zeros_(module.bias)
