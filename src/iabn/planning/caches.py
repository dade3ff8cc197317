"""Emptying the caches before a timed call, for the planner's measurements (:mod:`.cost`'s
products, :mod:`.recovery`'s converted layers).

Inside a training step an operation runs after others have passed through the caches: its
weights and the activations its backward reads come from memory, and so do the host's own code
and data around the call. Timed back to back, a call finds all of that in the caches. Measured
on the 2-core VM (one thread, 7 repeats): the planner's predicted step of ResNet-50 at
4x3x64x64 as given, its products timed warm, 11.0 % below the measured median, from emptied
caches 1.2 %; a converted ViT-S/16's plan at batch 2 -10.6 % and -12.8 % warm, -0.2 % and
-4.9 % cold; the output-only layer norm's backward took 110 us warm and 390 us cold.

The caches are emptied by writing over buffers of twice the largest cache (the host's, from
sysfs on Linux, :data:`FALLBACK_CACHE_BYTES` where unknown; and a GPU's L2 where the call
runs on one). The buffers are made on first use and kept until :func:`release` (a plan
releases them when it ends: on a GPU they hold twice its L2)."""

from __future__ import annotations

import functools
import glob
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: The largest cache assumed where the machine does not say.
FALLBACK_CACHE_BYTES = 64 << 20
#: Linux's sizes of the first processor's caches ("32K", "1024K", "32768K").
CPU_CACHE_SIZES = "/sys/devices/system/cpu/cpu0/cache/index*/size"

_BUFFERS: dict[str, Tensor] = {}


@functools.cache
def largest_cache(device: str) -> int:
    """The largest cache between ``device``'s memory and its processors, in bytes."""
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).L2_cache_size)
    sizes = []
    for path in glob.glob(CPU_CACHE_SIZES):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else FALLBACK_CACHE_BYTES


def _buffer(device: str) -> Tensor:
    if device not in _BUFFERS:
        _BUFFERS[device] = torch.zeros(2 * largest_cache(device), dtype=torch.uint8,
                                       device=device)
    return _BUFFERS[device]


def evict(device: torch.device) -> None:
    """Reads and writes every byte of the host's buffer, and of ``device``'s where it is a GPU:
    what the caches held before is gone (on a GPU, synchronised)."""
    _buffer("cpu").add_(1)
    if device.type == "cuda":
        name = str(device if device.index is not None
                   else torch.device("cuda", torch.cuda.current_device()))
        _buffer(name).add_(1)
        torch.cuda.synchronize(device)


def timed_cold(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """``(seconds, result)`` of one call of ``fn`` after :func:`evict` (not timed), timed to
    its end on the device (CUDA: synchronised)."""
    evict(device)  # (on a GPU it ends synchronised: nothing queued is timed)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def release() -> None:
    """Frees the buffers :func:`evict` made."""
    _BUFFERS.clear()


__all__ = ["CPU_CACHE_SIZES", "FALLBACK_CACHE_BYTES", "evict", "largest_cache", "release",
           "timed_cold"]
