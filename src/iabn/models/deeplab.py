"""DeepLabV3 head and a segmentation network around a trunk, laid out like the original
``inplace_abn`` Mapillary Vistas model (``snapshot["state_dict"]["body" | "head" | "cls"]``).

Head: four parallel branches on the trunk's features — a 1x1 convolution and three 3x3
convolutions with dilations 12/24/36 (at output stride 8) — concatenated and normalised
(``map_bn``), reduced by a 1x1 convolution (``red_conv``); plus an image-pooling branch
(``global_pooling_conv`` -> ``global_pooling_bn`` -> ``pool_red_conv``) added to it, then
``red_bn``. The classifier ``cls`` is a 1x1 convolution; logits are upsampled bilinearly to
the input size.

Image pooling: in training the spatial mean, broadcast back to the feature map; in eval a
stride-1 average pool with a window of ``pooling_size`` (clipped to the feature map) and
replicate padding back to its size — the released model used 84x84, which makes it local on
large images and global on small ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import init_weights
from .norm_act import NormAct, norm_act_factory


class DeepLabV3Head(nn.Module):
    def __init__(self, in_channels: int = 4096, hidden_channels: int = 256,
                 out_channels: int = 256, dilations: tuple[int, int, int] = (12, 24, 36),
                 pooling_size: tuple[int, int] | None = (84, 84),
                 norm_act: str | NormAct = "iabn", activation: str = "leaky_relu",
                 activation_param: float = 0.01) -> None:
        super().__init__()
        make = norm_act_factory(norm_act, activation, activation_param)
        self.pooling_size = pooling_size
        self.map_convs = nn.ModuleList(
            [nn.Conv2d(in_channels, hidden_channels, 1, bias=False)]
            + [nn.Conv2d(in_channels, hidden_channels, 3, padding=d, dilation=d, bias=False)
               for d in dilations]
        )
        self.map_bn = make(hidden_channels * 4)
        self.global_pooling_conv = nn.Conv2d(in_channels, hidden_channels, 1, bias=False)
        self.global_pooling_bn = make(hidden_channels)
        self.red_conv = nn.Conv2d(hidden_channels * 4, out_channels, 1, bias=False)
        self.pool_red_conv = nn.Conv2d(hidden_channels, out_channels, 1, bias=False)
        self.red_bn = make(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        # The branches only read x; the norms work on fresh tensors (the concatenation, the
        # pooled convolution, the sum), so in-place norm layers are safe here.
        out = self.map_bn(torch.cat([conv(x) for conv in self.map_convs], 1))
        out = self.red_conv(out)
        pooled = self.pool_red_conv(self.global_pooling_bn(
            self.global_pooling_conv(self._image_pool(x))))
        if pooled.shape[-2:] != out.shape[-2:]:
            pooled = pooled.expand_as(out)
        return self.red_bn(out + pooled)

    def _image_pool(self, x: Tensor) -> Tensor:
        if self.training or self.pooling_size is None:
            return x.mean((2, 3), keepdim=True)
        kh, kw = (min(self.pooling_size[0], x.shape[2]), min(self.pooling_size[1], x.shape[3]))
        pooled = F.avg_pool2d(x, (kh, kw), stride=1)
        # replicate-pad the (H - kh + 1) x (W - kw + 1) result back to H x W
        top, left = (kh - 1) // 2, (kw - 1) // 2
        return F.pad(pooled, (left, kw - 1 - left, top, kh - 1 - top), mode="replicate")


class SegmentationNet(nn.Module):
    """``body`` (a trunk returning features) -> ``head`` -> ``cls`` (1x1 conv), logits
    upsampled to the input size."""

    def __init__(self, body: nn.Module, head: nn.Module, head_channels: int,
                 num_classes: int) -> None:
        super().__init__()
        self.body, self.head = body, head
        self.cls = nn.Conv2d(head_channels, num_classes, 1)
        init_weights(self.head)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.cls(self.head(self.body(x)))
        return F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)


def deeplabv3_wider_resnet38(num_classes: int = 65, norm_act: str | NormAct = "iabn",
                             activation: str = "leaky_relu", activation_param: float = 0.01,
                             pooling_size: tuple[int, int] | None = (84, 84),
                             depth: int = 38, width: float = 1.0,
                             head_channels: int = 256) -> SegmentationNet:
    """The Vistas model: WideResNet-38-A2 trunk dilated to output stride 8 + DeepLabV3 head
    with ``head_channels`` per branch (256 in the paper). ``depth`` 16/20 and ``width`` < 1
    give the same layout with a smaller trunk (tests, CPU training on the embedded data)."""
    from .preact import WiderResNet

    kwargs = {"norm_act": norm_act, "activation": activation,
              "activation_param": activation_param}
    body = WiderResNet(num_classes=None, a2=True, dilation=True, depth=depth, width=width,
                       **kwargs)
    head = DeepLabV3Head(body.out_channels, head_channels, head_channels,
                         pooling_size=pooling_size, **kwargs)
    return SegmentationNet(body, head, head_channels, num_classes)
