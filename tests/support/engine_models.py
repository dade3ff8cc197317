"""Small models and the float64 gradient comparison of the engine tests (test_engines.py and
the ranks of engine_workers.py): timm's ConvNeXt and ViT at a few channels, converted first,
then wrapped by an engine, against the model as given."""

from __future__ import annotations

import copy

import torch
from torch import nn

import iabn

#: measured: the largest difference of a converted and wrapped model's gradients from the
#: model as given is 1.6e-15, relative to the largest gradient (float64, these models, FSDP2
#: and DDP included); 100x
TOLERANCE = 1.6e-13


class _Block(nn.Module):
    """ConvNeXt's block: depthwise conv, channels-last layer norm, MLP, residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv_dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.fc1 = nn.Linear(channels, 2 * channels)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv_dw(x).permute(0, 2, 3, 1)
        y = self.fc2(self.act(self.fc1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


class _Stage(nn.Module):
    """A downsampling norm on the stage's input (a batch norm here, so that no timm import is
    needed in the ranks' processes), a strided conv, two blocks."""

    def __init__(self, channels_in: int, channels: int) -> None:
        super().__init__()
        self.downsample = nn.Sequential(nn.BatchNorm2d(channels_in),
                                        nn.Conv2d(channels_in, channels, 2, stride=2))
        self.blocks = nn.Sequential(_Block(channels), _Block(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class ConvNeXtLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 2, stride=2)
        self.stages = nn.Sequential(_Stage(8, 8), _Stage(8, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.stages(self.stem(x)).mean((2, 3))))


def convnext_like() -> nn.Module:
    """A ConvNeXt of plain torch modules whose stages start with a batch norm, in place after
    conversion. Input 32 x 32."""
    torch.manual_seed(0)
    return ConvNeXtLike().double()


def convnext() -> nn.Module:
    """Four stages of one block; the last three start with their downsampling norm (a
    LayerNorm2d on the stage's input, in place after conversion). Input 32 x 32."""
    from timm.models.convnext import ConvNeXt

    torch.manual_seed(0)
    return ConvNeXt(in_chans=3, num_classes=5, depths=(1, 1, 1, 1),
                    dims=(8, 8, 16, 16),
                    ls_init_value=0.5).double()


def vit() -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, embed_dim=16, depth=2, num_heads=2,
                             num_classes=5).double()


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units an engine wraps one by one: ConvNeXt's stages, ViT's blocks."""
    return list(model.stages if hasattr(model, "stages") else model.blocks)


def images(model: nn.Module, batch: int = 4, seed: int = 1) -> torch.Tensor:
    """A batch of ``model``'s input size (ConvNeXt 32 x 32, ViT 16 x 16)."""
    size = 32 if hasattr(model, "stages") else 16
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, dtype=torch.float64, generator=generator)


def converted(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """``iabn.convert``'s model of a copy of ``model``, with at least one in-place layer."""
    result, report = iabn.convert(copy.deepcopy(model), x)
    assert any(row.decision.startswith("InPlace") for row in report.rows), report
    return result


def loss(out: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient differs per element (a sum of squares weighted by a fixed
    pattern), so a permuted or misplaced gradient shows."""
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out.square() * weights).sum()


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient, whole (an FSDP2 shard gathered), by its name in the model as
    given (DDP's ``module.`` prefix dropped)."""
    result = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        result[name.removeprefix("module.")] = grad.detach().clone()
    return result


def reference_gradients(model: nn.Module, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mean over ``batches`` of the gradients of :func:`loss` of the model as given: what
    data-parallel ranks, one batch each, end with."""
    model.zero_grad()
    for x in batches:
        (loss(model(x)) / len(batches)).backward()
    return gradients(model)


def largest_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference of any gradient, relative to the largest gradient."""
    assert got.keys() == want.keys()
    largest = max(float(g.abs().max()) for g in want.values())
    return max(float((got[k] - want[k]).abs().max()) for k in want) / largest
