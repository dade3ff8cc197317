"""Which side of the activation's kink: input gradients counted against float64.

A LeakyReLU has two slopes. An element whose pre-activation ``y`` lies within the layer's
rounding error of 0 may land on the other side of the kink than the exact (float64) value,
and its input gradient then uses the other slope: off by ``1 - slope`` relative (0.99 for the
default 0.01), not by a rounding error. How often that happens depends on how accurate the
batch mean is: an error of ``d`` standard deviations moves about ``0.4 * d`` of a channel's
values across the kink (the density of a unit normal at 0 is 0.4). So the measure here is a
count: the elements whose ``dx`` disagrees with a float64 ``nn.BatchNorm`` + ``leaky_relu`` by
more than the dtype's resolution allows, per provider, on the same input and output gradient.

Providers: ``triton`` and ``reference`` (``iabn.InPlaceABN`` on that backend) and ``torch``
(``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=True)``, PyTorch's own layers) in the input's
dtype, all on the same device. In half precision a tiny negative output (``0.01 * y`` below
float16's smallest subnormal, ``|y| < 3e-6``) rounds to ``-0.0``; its sign bit still tells the
branch, so a backward that reads the sign bit, as iabn's Triton kernels do, takes the right
slope. One that tests ``z > 0`` (PyTorch's LeakyReLU, and iabn's reference backend, which runs
ATen's ``leaky_relu_backward``) takes the right one for ``-0.0`` but the wrong one for the
positive values that round to ``+0.0`` (``0 < y < 3e-8``); ``z >= 0`` does the reverse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...kernels.backends import use_backend
from ...layers.batch_norm import InPlaceABN

PROVIDERS = ("triton", "reference", "torch")
SLOPE = 0.01
#: Allowed error of ``dx`` relative to ``|dx64| + rms(dx64)``: 16 units of the dtype's
#: rounding (eps), and at least 2^-10 (float32). Measured on CPU at 100k values per channel,
#: rounding alone gives up to 0.4 eps in bfloat16 and float16 (the rounding of ``dx``) and
#: 43 eps in float32 for PyTorch's own channels-last backward (its sums accumulate in
#: float32), 1.3 eps for iabn's Triton kernels. A wrong slope is off by
#: ``(1 - SLOPE) * |k1 * dy|``, about half the scale or more unless ``dy`` is tiny.
TOLERANCE_EPS = 16
TOLERANCE_FLOOR = 2.0**-10


def tolerance(dtype: torch.dtype) -> float:
    return max(TOLERANCE_EPS * torch.finfo(dtype).eps, TOLERANCE_FLOOR)


def _input_grad(layer: nn.Module, x: Tensor, dz: Tensor) -> tuple[Tensor, Tensor]:
    """``(z, dx)`` of one training step of ``layer`` (fresh statistics) on a copy of ``x``."""
    leaf = x.clone().requires_grad_()
    z = layer(leaf.clone())
    z.backward(dz)
    return z.detach(), leaf.grad


def input_grads(x: Tensor, dz: Tensor, providers: tuple[str, ...] = PROVIDERS
                ) -> tuple[Tensor, Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """``(y64, dx64, {provider: (z, dx)})``: the float64 pre-activation and input gradient,
    and each provider's output and input gradient, for a fresh layer (weight 1, bias 0, the
    initialisation of ``nn.BatchNorm2d``, which puts the most values near the kink) in
    training mode on ``x`` with output gradient ``dz``."""
    channels = x.shape[1]
    bn64 = nn.BatchNorm2d(channels).to(x.device, torch.float64)
    x64 = x.detach().double().requires_grad_()
    y64 = bn64(x64)
    nn.functional.leaky_relu(y64, SLOPE).backward(dz.double())
    results = {}
    for name in providers:
        if name == "torch":
            layer = nn.Sequential(nn.BatchNorm2d(channels),
                                  nn.LeakyReLU(SLOPE, inplace=True)).to(x.device)
            results[name] = _input_grad(layer, x, dz)
        else:
            with use_backend(name):
                layer = InPlaceABN(channels, activation_param=SLOPE, device=x.device)
                results[name] = _input_grad(layer, x, dz)
    return y64.detach(), x64.grad, results


def scaled_error(dx: Tensor, dx64: Tensor) -> Tensor:
    """``|dx - dx64|`` relative to ``|dx64| + rms(dx64)`` (the root mean square keeps
    near-zero gradients, where every provider's rounding is large relative to the value, from
    counting)."""
    return (dx.double() - dx64).abs() / (dx64.abs() + dx64.square().mean().sqrt())


def mismatches(dx: Tensor, dx64: Tensor) -> Tensor:
    """Mask of the elements of ``dx`` off by more than :func:`tolerance` of its dtype."""
    return scaled_error(dx, dx64) > tolerance(dx.dtype)


def study(shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool, seed: int,
          device: torch.device | str, providers: tuple[str, ...] = PROVIDERS
          ) -> dict[str, Any]:
    """One case: ``randn`` input and output gradient (from ``seed``, drawn in float32 on the
    CPU so that every device sees the same values), rounded to ``dtype``. Per provider: the
    count of mismatched ``dx`` elements, how many of those sit on the other side of the kink
    than float64 (output sign bit against ``y64 < 0``), the outputs that rounded to zero (the
    half-precision ambiguity) and the mismatches among them, and the largest error relative to
    ``|dx64| + rms(dx64)`` (a wrong slope makes it about 0.5 or more)."""
    generator = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x, dz = (torch.randn(shape, generator=generator).to(device, dtype)
             .contiguous(memory_format=fmt) for _ in range(2))
    y64, dx64, results = input_grads(x, dz, providers)
    negative64 = y64 < 0
    row: dict[str, Any] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                           "layout": "channels_last" if channels_last else "nchw",
                           "seed": seed, "device": str(torch.device(device)),
                           "per_channel": x.numel() // shape[1], "elements": x.numel(),
                           "tolerance": tolerance(dtype)}
    for name, (z, dx) in results.items():
        error = scaled_error(dx, dx64)
        wrong = error > tolerance(dx.dtype)
        other_side = torch.signbit(z) != negative64
        zero = z == 0
        row[name] = {"mismatched": int(wrong.sum()),
                     "mismatched_on_other_side": int((wrong & other_side).sum()),
                     "other_side": int(other_side.sum()),
                     "zero_outputs": int(zero.sum()),
                     "mismatched_at_zero_outputs": int((wrong & zero).sum()),
                     "max_scaled_error": float(error.max())}
    return row
