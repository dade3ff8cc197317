"""Image transforms of the ImageNet training and evaluation pipelines, on Pillow and torch.

Training (as the original scripts): a random crop (random area and aspect ratio, or a fixed
shorter side then a random square), a horizontal flip, colour jitter (brightness, contrast and
saturation), AlexNet's PCA lighting noise, normalisation. Evaluation: shorter
side resized to ``scale``, then the centre ``crop`` or ten crops (four corners and the centre,
and their mirror images).

Randomness comes only from the ``numpy.random.Generator`` passed in, never from global state,
so a sample's augmentation is a function of its seed (see :mod:`iabn.data.samplers`).
Tensors are ``float32 [3, H, W]`` RGB in ``[0, 1]`` until :func:`normalize`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

# AlexNet's principal components of ImageNet RGB pixels in [0, 1] (eigenvalues, and the
# eigenvectors as columns), the constants every ImageNet "lighting" augmentation uses.
LIGHTING_EIGENVALUES = (0.2175, 0.0188, 0.0045)
LIGHTING_EIGENVECTORS = (
    (-0.5675, 0.7192, 0.4009),
    (-0.5808, -0.0045, -0.8140),
    (-0.5836, -0.6948, 0.4203),
)
# ITU-R 601 luma, the grey level colour jitter blends towards.
LUMA_WEIGHTS = (0.299, 0.587, 0.114)

Image = Any  # a PIL.Image.Image; Pillow is imported only where images are read


def _bilinear() -> int:
    from PIL import Image as PILImage

    return PILImage.Resampling.BILINEAR


def to_tensor(image: Image) -> Tensor:
    """An RGB PIL image as ``float32 [3, H, W]`` in ``[0, 1]``."""
    array = np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(array.transpose(2, 0, 1).copy())


def resize_shorter_side(image: Image, size: int) -> Image:
    """Scale ``image`` so its shorter side is ``size`` pixels, keeping the aspect ratio."""
    width, height = image.size
    if min(width, height) == size:
        return image
    factor = size / min(width, height)
    new_size = (max(size, round(width * factor)), max(size, round(height * factor)))
    return image.resize(new_size, _bilinear())


def center_crop(image: Image, size: int) -> Image:
    """The central ``size x size`` square (``image`` must be at least that large)."""
    width, height = image.size
    left, top = (width - size) // 2, (height - size) // 2
    return image.crop((left, top, left + size, top + size))


def ten_crops(image: Image, size: int) -> list[Image]:
    """Top-left, top-right, bottom-left, bottom-right and centre crops, then their mirrors."""
    from PIL import Image as PILImage

    width, height = image.size
    corners = [(0, 0), (width - size, 0), (0, height - size), (width - size, height - size)]
    crops = [image.crop((x, y, x + size, y + size)) for x, y in corners]
    crops.append(center_crop(image, size))
    return crops + [crop.transpose(PILImage.Transpose.FLIP_LEFT_RIGHT) for crop in crops]


def random_resized_crop(image: Image, size: int, area_range: Sequence[float],
                        ratio_range: Sequence[float], rng: np.random.Generator) -> Image:
    """A random region with ``area_range`` of the image's area and an aspect ratio (w/h) drawn
    log-uniformly from ``ratio_range``, resized to ``size x size``. After ten draws that do not
    fit, the central square of the shorter side is used instead."""
    width, height = image.size
    log_ratios = (math.log(ratio_range[0]), math.log(ratio_range[1]))
    for _ in range(10):
        area = width * height * rng.uniform(*area_range)
        ratio = math.exp(rng.uniform(*log_ratios))
        crop_w, crop_h = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = int(rng.integers(0, width - crop_w + 1))
            top = int(rng.integers(0, height - crop_h + 1))
            box = (left, top, left + crop_w, top + crop_h)
            return image.resize((size, size), _bilinear(), box=box)
    side = min(width, height)
    return center_crop(image, side).resize((size, size), _bilinear())


def random_crop(image: Image, size: int, rng: np.random.Generator) -> Image:
    """A ``size x size`` square at a uniformly random position."""
    width, height = image.size
    left = int(rng.integers(0, width - size + 1))
    top = int(rng.integers(0, height - size + 1))
    return image.crop((left, top, left + size, top + size))


def _grey(x: Tensor) -> Tensor:
    weights = torch.tensor(LUMA_WEIGHTS, dtype=x.dtype).view(3, 1, 1)
    return (x * weights).sum(0, keepdim=True)


def color_jitter(x: Tensor, strength: float, rng: np.random.Generator) -> Tensor:
    """Brightness, contrast and saturation changes: blend ``x`` with black, with its mean grey
    level and with its grey image, by factors drawn from ``[1 - s, 1 + s]``; the result is
    clipped to ``[0, 1]``. (The three blends are linear maps that commute, so the random order
    some implementations draw would change nothing.)"""
    brightness, contrast, saturation = rng.uniform(1.0 - strength, 1.0 + strength, size=3)
    x = x * float(brightness)
    x = contrast * x + (1.0 - contrast) * _grey(x).mean()
    x = saturation * x + (1.0 - saturation) * _grey(x)
    return x.clamp_(0.0, 1.0)


def pca_lighting(x: Tensor, std: float, rng: np.random.Generator) -> Tensor:
    """AlexNet's lighting noise: add ``V @ (alpha * eigenvalues)`` to every pixel, where ``V``
    holds the eigenvectors as columns and ``alpha ~ N(0, std)`` per component."""
    alpha = rng.normal(0.0, std, size=3)
    vectors = np.asarray(LIGHTING_EIGENVECTORS, dtype=np.float64)
    shift = vectors @ (alpha * np.asarray(LIGHTING_EIGENVALUES))
    return x + torch.tensor(shift, dtype=x.dtype).view(3, 1, 1)


def normalize(x: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """``(x - mean) / std`` per channel (``x`` is ``[..., 3, H, W]``)."""
    mean_t = torch.tensor(mean, dtype=x.dtype).view(3, 1, 1)
    std_t = torch.tensor(std, dtype=x.dtype).view(3, 1, 1)
    return (x - mean_t) / std_t


class TrainTransform:
    """The training augmentation (module doc). ``scale=None``: :func:`random_resized_crop`;
    an integer: shorter side resized to ``scale``, then :func:`random_crop`. ``jitter`` and
    ``lighting`` of 0 switch those steps off."""

    def __init__(self, crop: int, scale: int | None, area_range: Sequence[float],
                 ratio_range: Sequence[float], flip: bool, jitter: float, lighting: float,
                 mean: Sequence[float], std: Sequence[float]) -> None:
        self.crop, self.scale = crop, scale
        self.area_range, self.ratio_range = tuple(area_range), tuple(ratio_range)
        self.flip, self.jitter, self.lighting = flip, jitter, lighting
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, image: Image, rng: np.random.Generator) -> Tensor:
        if self.scale is None:
            image = random_resized_crop(image, self.crop, self.area_range, self.ratio_range, rng)
        else:
            image = random_crop(resize_shorter_side(image, self.scale), self.crop, rng)
        x = to_tensor(image)
        if self.flip and rng.random() < 0.5:
            x = x.flip(-1)
        if self.jitter > 0:
            x = color_jitter(x, self.jitter, rng)
        if self.lighting > 0:
            x = pca_lighting(x, self.lighting, rng)
        return normalize(x, self.mean, self.std)


class EvalTransform:
    """Shorter side to ``scale``, then the centre ``crop`` (``[3, crop, crop]``) or, with
    ``ten_crops``, a ``[10, 3, crop, crop]`` stack (:func:`ten_crops`), normalised."""

    def __init__(self, scale: int, crop: int, ten_crops: bool, mean: Sequence[float],
                 std: Sequence[float]) -> None:
        if crop > scale:
            raise ValueError(f"crop {crop} is larger than scale {scale}: the crop must fit "
                             f"inside the resized image")
        self.scale, self.crop, self.ten_crops = scale, crop, ten_crops
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, image: Image, rng: np.random.Generator | None = None) -> Tensor:
        image = resize_shorter_side(image, self.scale)
        if self.ten_crops:
            x = torch.stack([to_tensor(crop) for crop in ten_crops(image, self.crop)])
        else:
            x = to_tensor(center_crop(image, self.crop))
        return normalize(x, self.mean, self.std)


Transform = Callable[[Image, "np.random.Generator | None"], Tensor]


class TransformedDataset(Dataset):
    """``(transform(image, rng), label)`` for every ``(image, label)`` of ``source``.

    Keys are plain indices (``rng=None``: deterministic transforms) or the ``(index, seed)``
    pairs of :class:`~iabn.data.samplers.ShuffledShardSampler`, whose seed starts the sample's
    own generator.
    """

    def __init__(self, source: Dataset, transform: Transform) -> None:
        self.source, self.transform = source, transform

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[Tensor, int]:
        index, seed = key if isinstance(key, tuple) else (key, None)
        image, label = self.source[index]
        rng = None if seed is None else np.random.default_rng(seed)
        return self.transform(image, rng), label


__all__ = [
    "EvalTransform",
    "TrainTransform",
    "TransformedDataset",
    "center_crop",
    "color_jitter",
    "normalize",
    "pca_lighting",
    "random_crop",
    "random_resized_crop",
    "resize_shorter_side",
    "ten_crops",
    "to_tensor",
]
