"""Pixels per batch under an activation-memory budget: the paper's Table 3 from exact byte counts.

The paper (§4.2, Table 3) trains DeepLabV3 on ResNeXt-101 and WideResNet-38 bodies and, for each
norm layer, fills the same GPU with more crops of the same size (FIXED CROP) or larger crops at
the same batch (FIXED BATCH). Here the memory is the *activation bytes* a training forward keeps
for backward (model + cross-entropy loss; docs/design.md, "Memory accounting"), counted exactly
with saved-tensor hooks and de-duplicated by storage; parameters and buffers are excluded. It is
not GPU peak memory (workspaces, gradients, optimiser state, fragmentation and the backward
transient are not in it).

Exact counts at 16 x 512 x 512 would take minutes and tens of GiB on a CPU, so the forward runs
on PyTorch's ``meta`` device: tensors there have shapes, dtypes and storages but no data, and
saved-tensor hooks see the same tensors as on a real device.
``tests/tools/test_pixels_per_batch.py`` checks that the meta counts equal
:func:`iabn.memory.saved_tensor_bytes` and :class:`iabn.OffloadModel`'s kept bytes on real CPU
tensors.

Storages are keyed by their ``StorageImpl`` (``untyped_storage()._cdata``), not by data pointer:
every meta storage has data pointer 0. Every counted tensor stays referenced until counting
ends, so no key is reused for a different storage meanwhile.

Offloading: :class:`iabn.OffloadModel` sends to host memory every saved storage that is the
input of a convolution or pooling layer (:data:`iabn.memory.offloading.DEFAULT_LAYERS`) and has at
least ``min_bytes`` bytes; everything else stays on the device. Its host copies cannot be made
from meta tensors, so :func:`activation_bytes` applies the same rule itself (with forward
pre-hooks on the same layer types) and reports the bytes that rule keeps; the test above checks
it against ``OffloadModel.stats.kept_bytes`` on CPU. (That test holds every conv input alive:
``OffloadModel`` remembers conv inputs by data pointer, so on real memory a later tensor that
reuses a freed input's address can be offloaded too, and its kept bytes then come out lower
than the rule's.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...memory import counting_saves, state_keys, storage_key
from ...memory.offloading import DEFAULT_LAYERS
from ...models import DeepLabV3Head, ResNeXt, SegmentationNet, deeplabv3_wider_resnet38

#: Bodies of Table 3, both at output stride 8 (see :func:`segmentation_model`).
BODIES = ("resnext101", "wider_resnet38_a2")
#: ``bn``: standard BN + LeakyReLU; ``iabn``: InPlace-ABN; ``iabn_offload``: InPlace-ABN with
#: the inputs of convolutions and poolings offloaded to host memory (device bytes only);
#: ``iabn_offload_working``: the same plus the largest offloaded activation, which must be back
#: on the device while backward uses it — the least any offloading schedule needs (prefetching,
#: gradients and the forward's layer outputs come on top).
METHODS = ("bn", "iabn", "iabn_offload", "iabn_offload_working")
#: Offload every convolution / pooling input whatever its size (``OffloadModel(min_bytes=0)``,
#: as ``benchmarks/memory_strategies.py``): with a size threshold, a tensor that grows past it
#: leaves the device, and kept bytes would no longer grow monotonically with batch and crop.
OFFLOAD_MIN_BYTES = 0
#: Cityscapes' 19 training classes.
NUM_CLASSES = 19


def segmentation_model(body: str, norm_act: str, num_classes: int = NUM_CLASSES,
                       depth: int | None = None) -> SegmentationNet:
    """DeepLabV3 (output stride 8) on ``body`` (one of :data:`BODIES`) with ``norm_act``
    (``"bn"``, ``"abn"``, ``"iabn"``, ...) everywhere, LeakyReLU(0.01) as in the paper.

    ``depth`` picks a smaller member of the family (ResNeXt-50, WideResNet-16-A2) for tests.
    Built on the current default device, so ``with torch.device("meta"):`` builds it on meta.
    """
    if body == "wider_resnet38_a2":
        return deeplabv3_wider_resnet38(num_classes, norm_act=norm_act, depth=depth or 38)
    if body == "resnext101":
        trunk = ResNeXt(depth or 101, num_classes=None, norm_act=norm_act, dilation=True)
        head = DeepLabV3Head(2048, 256, 256, norm_act=norm_act)
        return SegmentationNet(trunk, head, 256, num_classes)
    raise ValueError(f"body={body!r}: use one of {', '.join(BODIES)}")


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of distinct storages saved for backward by one training forward."""

    total: int               # everything saved (standard eager training)
    offloaded: int           # what OffloadModel's rule sends to host memory
    largest_offloaded: int   # the largest of those storages

    @property
    def kept_with_offload(self) -> int:
        """Bytes that stay on the device when offloading."""
        return self.total - self.offloaded


@contextmanager
def _offload_candidates(model: nn.Module) -> Iterator[set[tuple[str, int]]]:
    """Collect the storages (keys as iabn.memory counts them) that enter a convolution or
    pooling layer of ``model``."""
    inputs: set[tuple[str, int]] = set()

    def mark(module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], Tensor):
            inputs.add(storage_key(args[0]))

    handles = [m.register_forward_pre_hook(mark) for m in model.modules()
               if isinstance(m, DEFAULT_LAYERS)]
    try:
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


def activation_bytes(model: nn.Module, images: Tensor, target: Tensor | None = None,
                     offload_min_bytes: int = OFFLOAD_MIN_BYTES) -> ActivationBytes:
    """Run ``cross_entropy(model(images), target)`` (``model(images)`` alone when ``target``
    is None) and count what autograd saves.

    ``images``: ``[N, 3, H, W]`` float, ``target``: ``[N, H, W]`` int64, on the model's device
    (``meta`` for free counting at any size). ``model`` must be in training mode for the
    counts to be a training step's.
    """
    with _offload_candidates(model) as conv_inputs, counting_saves(state_keys(model)) as sizes:
        output = model(images)
        if target is not None:
            output = F.cross_entropy(output, target)
        offloaded = [n for key, n in sizes.items()
                     if key in conv_inputs and n >= offload_min_bytes]
        del output
    return ActivationBytes(sum(sizes.values()), sum(offloaded), max(offloaded, default=0))


class ByteCounter:
    """Device bytes of each method at any (batch, crop), counted on ``device`` (default meta).

    ``build(norm_act)`` makes the model (``"bn"`` or ``"iabn"``); it is called once per norm
    layer, on ``device``, and the model is reused for every size. Results are cached.
    """

    def __init__(self, build: Callable[[str], nn.Module], name: str,
                 device: str = "meta") -> None:
        self.build, self.name, self.device = build, name, device
        self._models: dict[str, nn.Module] = {}
        self._cache: dict[tuple[str, int, int], ActivationBytes] = {}

    @classmethod
    def for_body(cls, body: str, depth: int | None = None, num_classes: int = NUM_CLASSES,
                 device: str = "meta") -> ByteCounter:
        """The counter for :func:`segmentation_model` on ``body``."""
        if body not in BODIES:  # before any model is built
            raise ValueError(f"body={body!r}: use one of {', '.join(BODIES)}")
        return cls(lambda norm_act: segmentation_model(body, norm_act, num_classes, depth),
                   body, device)

    def _model(self, norm_act: str) -> nn.Module:
        if norm_act not in self._models:
            with torch.device(self.device):
                self._models[norm_act] = self.build(norm_act).train()
        return self._models[norm_act]

    def device_bytes(self, method: str, batch: int, crop: int) -> int:
        """Activation bytes ``method`` keeps on the device for ``batch`` crops of
        ``crop x crop`` pixels (see :data:`METHODS`)."""
        if method not in METHODS:
            raise ValueError(f"method={method!r}: use one of {', '.join(METHODS)}")
        norm_act = "bn" if method == "bn" else "iabn"
        key = (norm_act, batch, crop)
        if key not in self._cache:
            with torch.device(self.device):
                images = torch.zeros(batch, 3, crop, crop)
                target = torch.zeros(batch, crop, crop, dtype=torch.long)
            self._cache[key] = activation_bytes(self._model(norm_act), images, target)
        counted = self._cache[key]
        if method == "iabn_offload":
            return counted.kept_with_offload
        if method == "iabn_offload_working":
            return counted.kept_with_offload + counted.largest_offloaded
        return counted.total


def largest_fitting(fits: Callable[[int], bool], guess: int, step: int = 1,
                    minimum: int | None = None) -> int:
    """The largest multiple of ``step``, at least ``minimum`` (default ``step``), for which
    ``fits`` holds. ``fits`` must be monotone: true up to some value, false beyond.

    The search gallops from ``guess`` (strides ``step``, 2 ``step``, 4 ``step``, ...) until it
    brackets the answer, then bisects: two calls when the guess is right, a few more per
    doubling of its error. Byte counts are monotone in batch and crop: every saved tensor's
    size is a non-decreasing function of both, and which tensors are saved does not depend on
    them.
    """
    minimum = step if minimum is None else minimum
    if step <= 0 or minimum <= 0 or minimum % step:
        raise ValueError(f"minimum={minimum} must be a positive multiple of step={step}")
    value, stride = max(minimum, guess // step * step), step
    if fits(value):
        low = value
        while fits(low + stride):
            low, stride = low + stride, 2 * stride
        high = low + stride
    else:
        high = value
        while not fits(low := max(minimum, high - stride)):
            if low == minimum:
                raise ValueError(f"minimum={minimum} does not fit the budget")
            high, stride = low, 2 * stride
    while high - low > step:  # low fits, high does not
        middle = (low + high) // 2 // step * step  # strictly between: high - low >= 2 step
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@dataclass(frozen=True)
class PixelsRow:
    """One line of Table 3 for one body and method. Sizes are ``(batch, crop)`` (square
    crops); ``budget`` is the bytes of standard BN at ``baseline``."""

    body: str
    method: str
    baseline: tuple[int, int]
    budget: int
    bytes_at_baseline: int        # this method's bytes at the baseline size
    fixed_crop: tuple[int, int]   # the largest batch at the baseline crop within the budget
    fixed_batch: tuple[int, int]  # the largest crop at the baseline batch within the budget

    @staticmethod
    def _gain(size: tuple[int, int], baseline: tuple[int, int]) -> float:
        return size[0] * size[1] ** 2 / (baseline[0] * baseline[1] ** 2) - 1.0

    @property
    def fixed_crop_gain(self) -> float:
        """Pixels per batch relative to the baseline, minus 1 (0.75 = +75 %)."""
        return self._gain(self.fixed_crop, self.baseline)

    @property
    def fixed_batch_gain(self) -> float:
        return self._gain(self.fixed_batch, self.baseline)


def pixels_per_batch(counter: ByteCounter, batch: int, crop: int, crop_step: int = 8,
                     methods: tuple[str, ...] = METHODS) -> list[PixelsRow]:
    """Table 3 for one body: the budget is what standard BN keeps at ``batch x crop^2``;
    each method gets the largest batch (crop fixed) and the largest crop, a multiple of
    ``crop_step`` (batch fixed), whose bytes stay within it."""
    if batch < 2:
        raise ValueError(f"batch={batch}: use at least 2 (the head's image-pooling BN needs "
                         f"more than one value per channel in training)")
    if crop <= 0 or crop % crop_step:
        raise ValueError(f"crop={crop} must be a positive multiple of crop_step={crop_step}")
    budget = counter.device_bytes("bn", batch, crop)
    rows = []
    for method in methods:
        used = counter.device_bytes(method, batch, crop)

        def fits_batch(b: int, method: str = method) -> bool:
            return counter.device_bytes(method, b, crop) <= budget

        def fits_crop(c: int, method: str = method) -> bool:
            return counter.device_bytes(method, batch, c) <= budget

        # Guesses: bytes grow about linearly with the batch and with the crop's area; the
        # walk from the guess makes the answer exact. Batch 1 cannot train (see above).
        best_batch = largest_fitting(fits_batch, batch * budget // used, minimum=2)
        best_crop = largest_fitting(fits_crop, math.floor(crop * math.sqrt(budget / used)),
                                    crop_step)
        rows.append(PixelsRow(counter.name, method, (batch, crop), budget, used,
                              (best_batch, crop), (batch, best_crop)))
    return rows


__all__ = [
    "BODIES", "METHODS", "NUM_CLASSES", "OFFLOAD_MIN_BYTES", "ActivationBytes", "ByteCounter",
    "PixelsRow", "activation_bytes", "largest_fitting", "pixels_per_batch",
    "segmentation_model",
]
