"""Models with a pluggable norm + activation layer (``norm_act="bn"|"abn"|"iabn"|"iabn_sync"``
or a callable). ``create(name, **kw)`` builds one by name; ``MODELS`` lists the names.

This is the subset the memory benchmarks need (ResNet-50/101/152 v1, VGG-19, MobileNetV2);
the rest of the zoo and the training tools are separate work.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .mobilenet import MobileNetV2
from .norm_act import NAMES as NORM_ACT_NAMES
from .norm_act import norm_act_factory
from .resnet import ResNet
from .vgg import VGG

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet50": lambda **kw: ResNet(50, **kw),
    "resnet101": lambda **kw: ResNet(101, **kw),
    "resnet152": lambda **kw: ResNet(152, **kw),
    "vgg19": lambda **kw: VGG(**kw),
    "mobilenet_v2": lambda **kw: MobileNetV2(**kw),
}


def create(name: str, **kwargs) -> nn.Module:
    """Build model ``name`` (one of ``MODELS``); keyword arguments go to its constructor."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")
    return MODELS[name](**kwargs)


__all__ = [
    "MODELS", "NORM_ACT_NAMES", "VGG", "MobileNetV2", "ResNet", "create", "norm_act_factory",
]
