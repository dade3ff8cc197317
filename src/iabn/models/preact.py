"""Pre-activation ("identity mapping") residual networks of the original ``inplace_abn``
ImageNet and segmentation models: ResNeXt-50/101/152 and WideResNet-38 (and its A2 variant,
optionally dilated to output stride 8). Module names match the original checkpoints
(``modN.blockM.{bn1, convs.*, proj_conv}``, ``bn_out``, ``classifier.fc``).

Block: ``t = bn1(x)``; the shortcut is ``proj_conv(t)`` when the block changes shape, else the
raw input ``x``; ``out = convs(t) + shortcut``, with no activation after the sum. When
``bn1`` works in place it would destroy ``x`` before the shortcut reads it, so the block copies
``x`` first — the one copy the in-place contract requires here.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor, nn

from .common import classifier_head, init_weights, input_3x3_stem
from .norm_act import NormAct, norm_act_factory


def _writes_input(module: nn.Module) -> bool:
    """True for norm layers that overwrite their input (iabn's in-place layers)."""
    return bool(getattr(module, "_in_place", False))


class IdentityResidualBlock(nn.Module):
    """``channels`` of length 2 (two 3x3 convs) or 3 (1x1, 3x3 with ``groups``, 1x1)."""

    def __init__(self, in_channels: int, channels: tuple[int, ...], make: NormAct,
                 stride: int = 1, dilation: int = 1, groups: int = 1,
                 dropout: float | None = None) -> None:
        super().__init__()
        self.bn1 = make(in_channels)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        if len(channels) == 2:
            layers["conv1"] = nn.Conv2d(in_channels, channels[0], 3, stride, dilation, dilation,
                                        bias=False)
            layers["bn2"] = make(channels[0])
            if dropout:
                layers["dropout"] = nn.Dropout2d(dropout)
            layers["conv2"] = nn.Conv2d(channels[0], channels[1], 3, 1, dilation, dilation,
                                        bias=False)
        elif len(channels) == 3:
            layers["conv1"] = nn.Conv2d(in_channels, channels[0], 1, stride, bias=False)
            layers["bn2"] = make(channels[0])
            layers["conv2"] = nn.Conv2d(channels[0], channels[1], 3, 1, dilation, dilation,
                                        groups=groups, bias=False)
            layers["bn3"] = make(channels[1])
            if dropout:
                layers["dropout"] = nn.Dropout2d(dropout)
            layers["conv3"] = nn.Conv2d(channels[1], channels[2], 1, bias=False)
        else:
            raise ValueError(f"channels={channels}: give 2 or 3 widths")
        self.convs = nn.Sequential(layers)
        self.proj_conv = None
        if stride != 1 or in_channels != channels[-1]:
            self.proj_conv = nn.Conv2d(in_channels, channels[-1], 1, stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.proj_conv is not None:
            t = self.bn1(x)
            shortcut = self.proj_conv(t)
        else:
            shortcut = x.clone() if _writes_input(self.bn1) else x
            t = self.bn1(x)
        return self.convs(t) + shortcut


class _PreActNet(nn.Module):
    """Shared tail: the blocks in ``mod2..``, ``bn_out`` and the classifier."""

    def body(self) -> list[nn.Module]:
        """Stem, pools and blocks in order (for checkpointing and offloading by segment)."""
        return list(self._body)

    def features(self, x: Tensor) -> Tensor:
        for module in self._body:
            x = module(x)
        return self.bn_out(x)

    def forward(self, x: Tensor) -> Tensor:
        features = self.features(x)
        return features if self.classifier is None else self.classifier(features)

    def _finish(self, channels: int, num_classes: int | None, make: NormAct) -> None:
        self.out_channels = channels
        self.bn_out = make(channels)
        self.classifier = None
        if num_classes:
            self.classifier = classifier_head(channels, num_classes)
        init_weights(self)


RESNEXT_DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


class ResNeXt(_PreActNet):
    """Pre-activation ResNeXt with cardinality ``groups`` (64 in the paper), 3x3 input stem.

    ``dilation=True`` keeps output stride 8 for segmentation: the first blocks of ``mod4`` and
    ``mod5`` do not downsample and their stages' 3x3 convolutions use dilation 2 and 4
    (dilations 1, 1, 2, 4 per stage). The weights' shapes do not change."""

    def __init__(self, depth: int = 101, num_classes: int | None = 1000, groups: int = 64,
                 norm_act: str | NormAct = "iabn", activation: str = "leaky_relu",
                 activation_param: float = 0.01, dilation: bool = False) -> None:
        super().__init__()
        if depth not in RESNEXT_DEPTHS:
            raise ValueError(f"depth={depth}: use one of {sorted(RESNEXT_DEPTHS)}")
        make = norm_act_factory(norm_act, activation, activation_param)
        self.mod1 = input_3x3_stem(make)
        body: list[nn.Module] = [self.mod1]
        channels = 64
        for index, blocks in enumerate(RESNEXT_DEPTHS[depth]):
            widths = (128 * 2**index, 128 * 2**index, 256 * 2**index)
            layers = OrderedDict()
            dil = (1, 1, 2, 4)[index] if dilation else 1
            for b in range(blocks):
                stride = 2 if b == 0 and index > 0 and dil == 1 else 1
                layers[f"block{b + 1}"] = IdentityResidualBlock(channels, widths, make, stride,
                                                                dil, groups=groups)
                channels = widths[-1]
            module = nn.Sequential(layers)
            self.add_module(f"mod{index + 2}", module)
            body += list(module)
        self._body = body
        self._finish(channels, num_classes, make)


#: blocks per module mod2..mod7 of WideResNet-16/20/38
WRN_STRUCTURES = {16: (1, 1, 1, 1, 1, 1), 20: (1, 1, 1, 3, 1, 1), 38: (3, 3, 6, 3, 1, 1)}
WRN_CHANNELS = ((128, 128), (256, 256), (512, 512), (512, 1024), (512, 1024, 2048),
                (1024, 2048, 4096))


class WiderResNet(_PreActNet):
    """WideResNet-16/20/38 of the paper (``depth``; ``a2=False``: max-pool before mod2..mod6,
    output stride 32) or the A2 variant (``a2=True``: pools before mod2/mod3 only, strided
    blocks instead, dropout 0.3/0.5 in mod6/mod7; ``dilation=True`` keeps output stride 8 for
    segmentation). ``num_classes=None`` gives the trunk only (4096 channels after ``bn_out``).

    ``width`` scales every layer's channel count (default 1.0, the paper's network; e.g. 1/16
    gives a trunk small enough to train on a CPU in minutes); :attr:`out_channels` is the
    trunk's output width."""

    def __init__(self, num_classes: int | None = 1000, a2: bool = False, dilation: bool = False,
                 norm_act: str | NormAct = "iabn", activation: str = "leaky_relu",
                 activation_param: float = 0.01, depth: int = 38, width: float = 1.0) -> None:
        super().__init__()
        if depth not in WRN_STRUCTURES:
            raise ValueError(f"depth={depth}: use one of {sorted(WRN_STRUCTURES)}")
        if not 0 < width <= 1 or 64 * width < 1:
            raise ValueError(f"width={width}: must be in (0, 1] and keep at least one channel "
                             f"in the stem (width >= 1/64)")

        def scaled(channels: int) -> int:
            return max(1, round(channels * width))

        if dilation and not a2:
            raise ValueError("dilation=True is defined for the A2 variant: pass a2=True")
        make = norm_act_factory(norm_act, activation, activation_param)
        stem = scaled(64)
        self.mod1 = nn.Sequential(OrderedDict([("conv1", nn.Conv2d(3, stem, 3, 1, 1,
                                                                   bias=False))]))
        body: list[nn.Module] = [self.mod1]
        channels = stem
        for mod_id, blocks in enumerate(WRN_STRUCTURES[depth]):
            widths = tuple(scaled(c) for c in WRN_CHANNELS[mod_id])
            if mod_id < (2 if a2 else 5):
                pool = nn.MaxPool2d(3, 2, 1)
                self.add_module(f"pool{mod_id + 2}", pool)
                body.append(pool)
            layers = OrderedDict()
            for b in range(blocks):
                stride, dil, dropout = 1, 1, None
                if a2:
                    if dilation:
                        dil = 2 if mod_id == 3 else 4 if mod_id > 3 else 1
                        stride = 2 if b == 0 and mod_id == 2 else 1
                    else:
                        stride = 2 if b == 0 and 2 <= mod_id <= 4 else 1
                    dropout = {4: 0.3, 5: 0.5}.get(mod_id)
                layers[f"block{b + 1}"] = IdentityResidualBlock(
                    channels, widths, make, stride, dil, dropout=dropout)
                channels = widths[-1]
            module = nn.Sequential(layers)
            self.add_module(f"mod{mod_id + 2}", module)
            body += list(module)
        self._body = body
        self._finish(channels, num_classes, make)
