"""Models with a pluggable norm + activation layer (``norm_act="bn"|"abn"|"iabn"|"iabn_sync"``
or a callable). ``create(name, **kw)`` builds one by name; ``MODELS`` lists the names.

ResNet-18/34/50/101/152 v1, ResNeXt-50/101/152, WideResNet-16/20/38 (and A2, optionally
dilated) and DenseNet-121/169/201/264 are named like the original package's checkpoints
(:func:`iabn.models.load_original` loads those); VGG-19 and MobileNetV2 complete the set.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .checkpoints import LoadReport, load_original, original_state_dict
from .deeplab import DeepLabV3Head, SegmentationNet, deeplabv3_wider_resnet38
from .densenet import DenseNet
from .mobilenet import MobileNetV2
from .norm_act import NAMES as NORM_ACT_NAMES
from .norm_act import norm_act_factory
from .preact import ResNeXt, WiderResNet
from .resnet import ResNet
from .vgg import VGG

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": lambda **kw: ResNet(18, **kw),
    "resnet34": lambda **kw: ResNet(34, **kw),
    "resnet50": lambda **kw: ResNet(50, **kw),
    "resnet101": lambda **kw: ResNet(101, **kw),
    "resnet152": lambda **kw: ResNet(152, **kw),
    "vgg19": lambda **kw: VGG(**kw),
    "mobilenet_v2": lambda **kw: MobileNetV2(**kw),
    "resnext50": lambda **kw: ResNeXt(50, **kw),
    "resnext101": lambda **kw: ResNeXt(101, **kw),
    "resnext152": lambda **kw: ResNeXt(152, **kw),
    "wider_resnet16": lambda **kw: WiderResNet(depth=16, **kw),
    "wider_resnet20": lambda **kw: WiderResNet(depth=20, **kw),
    "wider_resnet38": lambda **kw: WiderResNet(**kw),
    "wider_resnet16_a2": lambda **kw: WiderResNet(depth=16, a2=True, **kw),
    "wider_resnet20_a2": lambda **kw: WiderResNet(depth=20, a2=True, **kw),
    "wider_resnet38_a2": lambda **kw: WiderResNet(a2=True, **kw),
    "densenet121": lambda **kw: DenseNet(121, **kw),
    "densenet169": lambda **kw: DenseNet(169, **kw),
    "densenet201": lambda **kw: DenseNet(201, **kw),
    "densenet264": lambda **kw: DenseNet(264, **kw),
}


def create(name: str, **kwargs) -> nn.Module:
    """Build model ``name`` (one of ``MODELS``); keyword arguments go to its constructor."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join(MODELS)}")
    return MODELS[name](**kwargs)


__all__ = [
    "MODELS",
    "NORM_ACT_NAMES",
    "VGG",
    "DeepLabV3Head",
    "DenseNet",
    "LoadReport",
    "MobileNetV2",
    "ResNeXt",
    "ResNet",
    "SegmentationNet",
    "WiderResNet",
    "create",
    "deeplabv3_wider_resnet38",
    "load_original",
    "norm_act_factory",
    "original_state_dict",
]
