"""Model families people train today whose forward ``torch.fx`` cannot trace, written here in
the style of their libraries (small sizes), for tests/conversion/test_convert_families.py and
the ``iabn memory``/``iabn plan`` tests (``model_families:detector``...).

- :class:`Detector`: a one-stage detector as YOLO-style libraries build it: a module list
  run in a loop, each module taking the output of stored indices (``m.f``), outputs kept in a
  list; conv + BN + SiLU everywhere; CSP blocks that ``chunk`` a tensor into a list, extend it
  in a loop and concatenate; spatial pyramid pooling by repeated max-pooling; a head that
  writes into its input list (fx: "Proxy object cannot be iterated").
- :class:`Segmenter`: an encoder-decoder as segmentation libraries build it: the forward checks
  the input's size (fx: a proxy in control flow), the encoder returns its feature list, and one
  of these decoders reads it: ``unet`` (a loop over skips, ``None`` past the last), ``unet++``
  (blocks in a dict keyed by position, dense skips gathered in a loop), ``fpn`` (top-down adds,
  group norm + ReLU blocks, ``sum`` of a list), ``deeplabv3+`` (ASPP with an image-pooling
  branch interpolated to the input's size), ``pspnet`` (pyramid pooling), ``linknet``
  (``x + skip`` decoder blocks).
"""

import itertools

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------- detector


class Conv(nn.Module):
    """conv + BN + SiLU."""

    def __init__(self, c1, c2, k=1, s=1):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(c2)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Bottleneck(nn.Module):
    def __init__(self, c1, c2, shortcut=True):
        super().__init__()
        self.cv1, self.cv2 = Conv(c1, c2, 3), Conv(c2, c2, 3)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        return x + self.cv2(self.cv1(x)) if self.add else self.cv2(self.cv1(x))


class C2f(nn.Module):
    """CSP block: split in two, run bottlenecks on the last part, concatenate all parts."""

    def __init__(self, c1, c2, n=1, shortcut=False):
        super().__init__()
        self.c = c2 // 2
        self.cv1, self.cv2 = Conv(c1, 2 * self.c), Conv((2 + n) * self.c, c2)
        self.m = nn.ModuleList(Bottleneck(self.c, self.c, shortcut) for _ in range(n))

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class SPPF(nn.Module):
    def __init__(self, c1, c2):
        super().__init__()
        c = c1 // 2
        self.cv1, self.cv2 = Conv(c1, c), Conv(c * 4, c2)
        self.m = nn.MaxPool2d(5, 1, 2)

    def forward(self, x):
        y = [self.cv1(x)]
        y.extend(self.m(y[-1]) for _ in range(3))
        return self.cv2(torch.cat(y, 1))


class Concat(nn.Module):
    def forward(self, x):
        return torch.cat(x, 1)


class Detect(nn.Module):
    """Box and class branches per level; in eval mode, the levels flattened and joined."""

    def __init__(self, classes, channels):
        super().__init__()
        self.no = classes + 16
        self.box = nn.ModuleList(nn.Sequential(Conv(c, 16, 3), Conv(16, 16, 3),
                                               nn.Conv2d(16, 16, 1)) for c in channels)
        self.cls = nn.ModuleList(nn.Sequential(Conv(c, 16, 3), Conv(16, 16, 3),
                                               nn.Conv2d(16, classes, 1)) for c in channels)

    def forward(self, x):
        for i in range(len(x)):
            x[i] = torch.cat((self.box[i](x[i]), self.cls[i](x[i])), 1)
        if self.training:
            return x
        y = torch.cat([xi.view(xi.shape[0], self.no, -1) for xi in x], 2)
        box, cls = y.split((16, self.no - 16), 1)
        return torch.cat((box, cls.sigmoid()), 1)


class Detector(nn.Module):
    """Layers in one ``nn.Sequential`` run by a loop that routes by ``m.f`` (-1: the previous
    output; an index or a list of indices: stored outputs)."""

    def __init__(self, classes=3):
        super().__init__()
        spec = [(-1, Conv(3, 8, 3, 2)), (-1, Conv(8, 16, 3, 2)), (-1, C2f(16, 16, 1, True)),
                (-1, Conv(16, 32, 3, 2)), (-1, C2f(32, 32, 2, True)), (-1, SPPF(32, 32)),
                (-1, nn.Upsample(scale_factor=2)), ([-1, 2], Concat()), (-1, C2f(48, 16)),
                (-1, Conv(16, 16, 3, 2)), ([-1, 5], Concat()), (-1, C2f(48, 32)),
                ([8, 11], Detect(classes, (16, 32)))]
        for i, (f, m) in enumerate(spec):
            m.f, m.i = f, i
        self.model = nn.Sequential(*(m for _, m in spec))
        self.save = {j for f, _ in spec for j in ([f] if isinstance(f, int) else f) if j != -1}

    def forward(self, x):
        y = []
        for m in self.model:
            if m.f != -1:
                x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
            x = m(x)
            y.append(x if m.i in self.save else None)
        return x


def detector() -> nn.Module:
    return Detector()


# ---------------------------------------------------------------- segmentation


def conv_bn_relu(c1, c2, k=3, s=1, d=1):
    return nn.Sequential(nn.Conv2d(c1, c2, k, s, d * (k // 2), dilation=d, bias=False),
                         nn.BatchNorm2d(c2), nn.ReLU(inplace=True))


class Encoder(nn.Module):
    """A small ResNet-like encoder returning ``[input, stride 2, 4, 8, 16]`` features."""

    channels = (3, 8, 8, 16, 24)

    def __init__(self):
        super().__init__()
        c = self.channels
        self.stages = nn.ModuleList(
            nn.Sequential(conv_bn_relu(c[i], c[i + 1], s=2), conv_bn_relu(c[i + 1], c[i + 1]))
            for i in range(4))

    def forward(self, x):
        features = [x]
        for stage in self.stages:
            features.append(stage(features[-1]))
        return features


class UnetDecoder(nn.Module):
    def __init__(self, enc, out=8):
        super().__init__()
        skips = [*enc[1:-1][::-1], 0]
        ins = [enc[-1], 16, 12, 8]
        outs = [16, 12, 8, out]
        self.blocks = nn.ModuleList(
            nn.Sequential(conv_bn_relu(i + s, o), conv_bn_relu(o, o))
            for i, s, o in zip(ins, skips, outs, strict=True))

    def forward(self, features):
        features = features[1:][::-1]
        x, skips = features[0], features[1:]
        for i, block in enumerate(self.blocks):
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            skip = skips[i] if i < len(skips) else None
            if skip is not None:
                x = torch.cat([x, skip], dim=1)
            x = block(x)
        return x


class UnetPlusPlusDecoder(nn.Module):
    """Nested skips: block ``x_{d}_{layer}`` (at the resolution of the encoder's feature
    ``d + 1``, deepest first) in a dict; it reads the upsampled block one level deeper and
    one layer earlier, the encoder's feature, and every earlier block at its resolution,
    gathered in a loop."""

    def __init__(self, enc, out=8):
        super().__init__()
        enc = list(enc[1:][::-1])          # deepest first: 24, 16, 8, 8
        self.depth = len(enc) - 1
        blocks = {}
        for layer in range(self.depth):
            for d in range(layer, self.depth):
                blocks[f"x_{d}_{layer}"] = conv_bn_relu(enc[d] + enc[d + 1] * (layer + 1),
                                                        enc[d + 1])
        blocks["final"] = conv_bn_relu(enc[-1], out)
        self.blocks = nn.ModuleDict(blocks)

    def forward(self, features):
        features = features[1:][::-1]
        dense = {}
        for layer in range(self.depth):
            for d in range(layer, self.depth):
                below = features[d] if layer == 0 else dense[f"x_{d - 1}_{layer - 1}"]
                skips = [features[d + 1]] + [dense[f"x_{d}_{i}"] for i in range(layer)]
                up = F.interpolate(below, scale_factor=2.0, mode="nearest")
                dense[f"x_{d}_{layer}"] = self.blocks[f"x_{d}_{layer}"](
                    torch.cat([up, *skips], 1))
        last = dense[f"x_{self.depth - 1}_{self.depth - 1}"]
        return self.blocks["final"](F.interpolate(last, scale_factor=2.0))


class FPNDecoder(nn.Module):
    """Lateral 1x1 convs, a top-down pathway of adds, group norm + ReLU segmentation blocks
    upsampled to stride 4 and summed."""

    def __init__(self, enc, pyramid=16, out=8):
        super().__init__()
        self.p5 = nn.Conv2d(enc[-1], pyramid, 1)
        self.laterals = nn.ModuleList(nn.Conv2d(c, pyramid, 1) for c in enc[2:-1][::-1])
        self.seg = nn.ModuleList(
            nn.Sequential(nn.Conv2d(pyramid, out, 3, padding=1, bias=False),
                          nn.GroupNorm(4, out), nn.ReLU(inplace=True))
            for _ in range(len(enc) - 2))

    def forward(self, features):
        c = features[2:][::-1]
        pyramid = [self.p5(c[0])]
        for lateral, skip in zip(self.laterals, c[1:], strict=True):
            pyramid.append(F.interpolate(pyramid[-1], scale_factor=2.0) + lateral(skip))
        size = pyramid[-1].shape[-2:]
        outs = [F.interpolate(block(p), size=size, mode="bilinear", align_corners=False)
                for block, p in zip(self.seg, pyramid, strict=True)]
        return sum(outs)


class ASPP(nn.Module):
    def __init__(self, c1, c2, rates=(1, 2)):
        super().__init__()
        self.branches = nn.ModuleList([conv_bn_relu(c1, c2, 1)] +
                                      [conv_bn_relu(c1, c2, 3, d=r) for r in rates])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c1, c2, 1, bias=False),
                                  nn.BatchNorm2d(c2), nn.ReLU())
        self.project = conv_bn_relu(c2 * (len(rates) + 2), c2, 1)

    def forward(self, x):
        size = x.shape[-2:]
        pooled = F.interpolate(self.pool(x), size=size, mode="bilinear", align_corners=False)
        return self.project(torch.cat([b(x) for b in self.branches] + [pooled], 1))


class DeepLabV3PlusDecoder(nn.Module):
    def __init__(self, enc, out=8):
        super().__init__()
        self.aspp = nn.Sequential(ASPP(enc[-1], 16), conv_bn_relu(16, 16))
        self.low = conv_bn_relu(enc[2], 8, 1)
        self.fuse = conv_bn_relu(16 + 8, out)

    def forward(self, features):
        high = self.aspp(features[-1])
        high = F.interpolate(high, scale_factor=4.0, mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([high, self.low(features[2])], 1))


class PSPDecoder(nn.Module):
    def __init__(self, enc, out=8, sizes=(1, 2, 3)):
        super().__init__()
        c = enc[-1]
        self.stages = nn.ModuleList(nn.Sequential(nn.AdaptiveAvgPool2d(s),
                                                  conv_bn_relu(c, c // len(sizes), 1))
                                    for s in sizes)
        self.conv = conv_bn_relu(c + c // len(sizes) * len(sizes), out, 1)

    def forward(self, features):
        x = features[-1]
        h, w = x.shape[-2:]
        pooled = [F.interpolate(stage(x), size=(h, w), mode="bilinear", align_corners=True)
                  for stage in self.stages]
        return self.conv(torch.cat([*pooled, x], 1))


class LinknetDecoder(nn.Module):
    """Blocks of 1x1 conv, transposed conv (x2), 1x1 conv, each + BN + ReLU; ``x + skip``."""

    def __init__(self, enc, out=8):
        super().__init__()
        chans = [*enc[1:][::-1], out]   # 24, 16, 8, 8, out

        def block(a, b):
            mid = max(a // 4, 4)
            return nn.Sequential(conv_bn_relu(a, mid, 1),
                                 nn.ConvTranspose2d(mid, mid, 4, 2, 1, bias=False),
                                 nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                                 conv_bn_relu(mid, b, 1))

        self.blocks = nn.ModuleList(block(a, b) for a, b in itertools.pairwise(chans))

    def forward(self, features):
        features = features[1:][::-1]
        x = features[0]
        for block, skip in zip(self.blocks, [*features[1:], None], strict=True):
            x = block(x)
            if skip is not None:
                x = x + skip
        return x


DECODERS = {"unet": UnetDecoder, "unet++": UnetPlusPlusDecoder, "fpn": FPNDecoder,
            "deeplabv3+": DeepLabV3PlusDecoder, "pspnet": PSPDecoder, "linknet": LinknetDecoder}
#: the decoders' output stride (their head upsamples the rest of the way)
UPSAMPLING = {"unet": 1, "unet++": 1, "fpn": 4, "deeplabv3+": 4, "pspnet": 16, "linknet": 1}


class Segmenter(nn.Module):
    def __init__(self, decoder="unet", classes=3):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = DECODERS[decoder](Encoder.channels)
        self.head = nn.Sequential(nn.Conv2d(8, classes, 3, padding=1),
                                  nn.Upsample(scale_factor=UPSAMPLING[decoder],
                                              mode="bilinear"))

    def check_input_shape(self, x):
        h, w = x.shape[-2:]
        if h % 16 or w % 16:
            raise RuntimeError(f"the input's height and width must be multiples of 16, "
                               f"got {h}x{w}")

    def forward(self, x):
        self.check_input_shape(x)
        return self.head(self.decoder(self.encoder(x)))


def segmenter(decoder: str = "unet") -> nn.Module:
    return Segmenter(decoder)
