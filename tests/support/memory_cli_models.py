"""Factories for ``iabn memory pkg.module:factory`` in tests/tools/test_memory_cli.py
(tests/support is on ``sys.path``: pyproject.toml's pytest option ``pythonpath``)."""

from torch import nn


def small_net() -> nn.Module:
    """conv -> BN -> ReLU -> conv -> BN -> LeakyReLU -> pool -> linear: the first norm goes in
    place only under ``policy="leaky_relu"``, the second under both policies."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.LeakyReLU(0.01),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def input_norm_net() -> nn.Module:
    """A norm on the network's input stays ``nn.BatchNorm2d`` (nothing proves the input is
    not used elsewhere); in bfloat16 PyTorch's meta kernel for it saves float32 statistics
    where the CPU kernel saves bfloat16 ones, so the batch search cannot count on meta."""
    return nn.Sequential(
        nn.BatchNorm2d(3), nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def not_a_module():
    return "a model"


def broken():
    raise RuntimeError("the factory failed")


NOT_CALLABLE = 3


def exits():
    """A factory that ends the process its own way: an error of the model, not success."""
    exit(0)


class _ExitsInForward(nn.Module):
    def forward(self, x):
        raise SystemExit(3)


def exits_in_forward() -> nn.Module:
    return _ExitsInForward()


class _Excite(nn.Module):
    """conv -> BN (no activation, weight zero-initialised) -> a squeeze-excitation multiply,
    which saves the norm's output for its backward: the pattern of TResNet's blocks. The zero
    weight keeps the lossless conversion from going in place (InPlaceABN would clamp it to
    eps), so it gives ABN; policy="leaky_relu" accepts the clamp and gives InPlaceABN."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        nn.init.zeros_(self.bn.weight)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        y = y * y.mean((2, 3), keepdim=True).sigmoid()
        return self.head(y.mean((2, 3)))


def excite_net() -> nn.Module:
    return _Excite()
