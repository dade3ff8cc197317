"""Semantic segmentation data: the embedded :class:`DigitsCanvas` set, :class:`SegmentationFolder`
for images with label PNGs, and joint image/label transforms (paper §4.2).

A sample is ``(image, label)``: ``image`` ``[3, H, W]`` (``uint8`` from the datasets, ``float32``
normalised after a transform), ``label`` ``int64 [H, W]`` of class ids, ``ignore_index`` (255 by
default) where a pixel has no class (padding, void).

Randomness comes only from the ``torch.Generator`` a transform is given. Dataset keys are an
index, or an ``(index, seed)`` pair such as :class:`iabn.data.samplers.ShuffledShardSampler`
yields: the pair seeds the sample's own generator, so its augmentation depends on nothing but
the pair (not on workers or ranks); a plain index draws from torch's global generator.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

from .digits import IMAGE_SIZE, load_digits_uint8, split_indices
from .imagefolder import DataLayoutError

IGNORE_INDEX = 255
#: DigitsCanvas classes: label 0 is the background, label ``d + 1`` the ink of digit ``d``.
CANVAS_CLASSES = ("background", *(f"digit {d}" for d in range(10)))
NUM_CANVAS_CLASSES = len(CANVAS_CLASSES)
#: Per-channel mean and standard deviation of DigitsCanvas pixels in [0, 1], measured over
#: 1,000 training canvases (seed 0, 64x64); use them to normalise that set.
CANVAS_MEAN = (0.501, 0.497, 0.497)
CANVAS_STD = (0.209, 0.212, 0.215)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
SampleKey = int | tuple[int, int]
JointTransform = Callable[[Tensor, Tensor, "torch.Generator | None"], tuple[Tensor, Tensor]]


def _split_key(key: SampleKey) -> tuple[int, torch.Generator | None]:
    """``index`` -> (index, None); ``(index, seed)`` -> (index, a generator seeded by seed)."""
    if isinstance(key, tuple):
        index, seed = key
        return int(index), torch.Generator().manual_seed(int(seed))
    return int(key), None


# Read once per process: every DigitsCanvas (train, val, each worker's copy) needs the digits.
_digits = functools.cache(load_digits_uint8)


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as error:  # an optional dependency: say how to get it
        raise ImportError("segmentation data needs Pillow: pip install 'iabn[tools]'") from error
    return Image


# --------------------------------------------------------------------------- DigitsCanvas


class DigitsCanvas(Dataset):
    """scikit-learn's real handwritten digits pasted onto textured colour canvases.

    Each ``size x size`` RGB canvas has a smoothly varying coloured background with noise and
    1 to ``max_digits`` digits, each upscaled (bilinear) from 8x8 to a random side of
    ``digit_scale`` times 8 pixels, drawn in a colour that differs from the background by at
    least 0.35 per channel, at a random position (later digits cover earlier ones). Label:
    ``d + 1`` on the ink pixels of digit ``d`` (upscaled intensity >= ``ink_threshold``), 0
    elsewhere: 11 classes, named in :data:`CANVAS_CLASSES`.

    Canvas ``index`` is a pure function of ``(seed, split, index)``. ``"train"`` canvases use
    only the training digits and ``"val"`` only the validation digits of
    :func:`iabn.data.digits.split_indices` (``val_fraction``, ``split_seed``), so no
    handwritten digit appears in both.

    Without ``transform`` samples are the raw canvases; a model wants e.g.
    ``TrainTransform(crop, CANVAS_MEAN, CANVAS_STD)`` or ``EvalTransform(CANVAS_MEAN,
    CANVAS_STD)``.
    """

    def __init__(self, split: str = "train", length: int = 1000, size: int = 64,
                 max_digits: int = 4, digit_scale: tuple[float, float] = (3.0, 5.0),
                 seed: int = 0, val_fraction: float = 0.2, split_seed: int = 0,
                 ink_threshold: float = 0.5, transform: JointTransform | None = None) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: use 'train' or 'val'")
        if length < 1:
            raise ValueError(f"length={length}: need at least one canvas")
        if max_digits < 1:
            raise ValueError(f"max_digits={max_digits}: need at least one digit per canvas")
        low, high = digit_scale
        if not 1.0 <= low <= high:
            raise ValueError(f"digit_scale={digit_scale}: need 1 <= low <= high")
        if size < math.ceil(IMAGE_SIZE * high):
            raise ValueError(f"size={size} is smaller than the largest digit "
                             f"({math.ceil(IMAGE_SIZE * high)} px at digit_scale {high}): "
                             f"raise size or lower digit_scale")
        if not 0.0 < ink_threshold < 1.0:
            raise ValueError(f"ink_threshold={ink_threshold}: must be in (0, 1)")
        images, labels = _digits()
        train, val = split_indices(labels, val_fraction, split_seed)
        pool = train if split == "train" else val
        self.digits, self.digit_labels = images[pool], labels[pool]
        self.split, self.length, self.size, self.max_digits = split, length, size, max_digits
        self.side_range = (round(IMAGE_SIZE * low), round(IMAGE_SIZE * high))
        self.seed, self.ink_threshold, self.transform = seed, ink_threshold, transform
        self.classes = CANVAS_CLASSES

    def __len__(self) -> int:
        return self.length

    def canvas(self, index: int) -> tuple[Tensor, Tensor]:
        """Canvas ``index`` before any transform: ``uint8 [3, S, S]``, ``int64 [S, S]``."""
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for {self.length} canvases")
        rng = np.random.default_rng([self.seed, ("train", "val").index(self.split), index])
        base = rng.uniform(0.15, 0.85, 3)
        image = self._background(rng, base)
        label = np.zeros((self.size, self.size), dtype=np.int64)
        for _ in range(rng.integers(1, self.max_digits + 1)):
            which = rng.integers(len(self.digits))
            side = int(rng.integers(self.side_range[0], self.side_range[1] + 1))
            top, left = rng.integers(0, self.size - side + 1, size=2)
            alpha = self._upscaled(self.digits[which], side)
            # at least 0.35 away from the background's base colour in every channel
            offset = rng.uniform(0.35, 0.6, 3)
            colour = np.where(base > 0.5, base - offset, base + offset)
            region = (slice(top, top + side), slice(left, left + side))
            image[region] = image[region] * (1 - alpha[..., None]) + colour * alpha[..., None]
            label[region][alpha >= self.ink_threshold] = self.digit_labels[which] + 1
        image += rng.normal(0.0, 0.03, image.shape)  # sensor-like pixel noise
        pixels = np.round(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)
        return torch.from_numpy(pixels.transpose(2, 0, 1).copy()), torch.from_numpy(label)

    def _background(self, rng: np.random.Generator, base: np.ndarray) -> np.ndarray:
        """``float64 [S, S, 3]``: the base colour, a linear gradient and blotchy low-frequency
        colour noise (a 5x5 random grid, upsampled bilinearly)."""
        ramp = np.linspace(-0.5, 0.5, self.size)
        angle = rng.uniform(0, 2 * np.pi)
        gradient = np.cos(angle) * ramp[None, :] + np.sin(angle) * ramp[:, None]
        coarse = torch.from_numpy(rng.normal(0.0, 0.08, (1, 3, 5, 5)))
        blotches = F.interpolate(coarse, size=(self.size, self.size), mode="bilinear",
                                 align_corners=True)[0].numpy().transpose(1, 2, 0)
        return base + rng.uniform(0.05, 0.2) * gradient[..., None] + blotches

    @staticmethod
    def _upscaled(digit: np.ndarray, side: int) -> np.ndarray:
        """The 8x8 digit resized bilinearly to ``side x side``, as coverage in [0, 1]."""
        resized = _pil().fromarray(digit).resize((side, side), _pil().Resampling.BILINEAR)
        return np.asarray(resized, dtype=np.float64) / 255.0

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, Tensor]:
        index, generator = _split_key(key)
        image, label = self.canvas(index)
        return (image, label) if self.transform is None else self.transform(image, label,
                                                                            generator)


# --------------------------------------------------------------------------- folders


class SegmentationFolder(Dataset):
    """Images with label PNGs, Cityscapes-like::

        ROOT/SPLIT/images/NAME.png|.jpg|.jpeg     (any mode; read as RGB)
        ROOT/SPLIT/labels/NAME.png                (single channel: mode L, P, I or I;16)

    An image and its label share the file name stem (``NAME``) and their size. Label values
    are class ids (a palette PNG's indices, not its colours); ``ignore_index`` marks void
    pixels. With ``num_classes``, any other value outside ``[0, num_classes)`` is an error
    naming the file. The layout is checked when the dataset is made (missing or empty folders,
    images without labels and labels without images are errors naming them); pixels are read
    when a sample is.
    """

    def __init__(self, root: str | Path, split: str = "train",
                 transform: JointTransform | None = None, ignore_index: int = IGNORE_INDEX,
                 num_classes: int | None = None) -> None:
        self.root = Path(root) / split
        image_dir, label_dir = self.root / "images", self.root / "labels"
        images = self._files(image_dir, IMAGE_SUFFIXES)
        labels = self._files(label_dir, (".png",))
        missing_labels = sorted(set(images) - set(labels))
        missing_images = sorted(set(labels) - set(images))
        problems = []
        if missing_labels:
            problems.append(f"{len(missing_labels)} image(s) in {image_dir} have no "
                            f"{label_dir}/NAME.png: {_some(missing_labels)}")
        if missing_images:
            problems.append(f"{len(missing_images)} label(s) in {label_dir} have no image "
                            f"in {image_dir}: {_some(missing_images)}")
        if problems:
            raise DataLayoutError("; ".join(problems) + " (images and labels pair by file stem)")
        self.samples = [(images[stem], labels[stem]) for stem in sorted(images)]
        self.transform, self.ignore_index, self.num_classes = transform, ignore_index, num_classes

    @staticmethod
    def _files(folder: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
        if not folder.is_dir():
            raise DataLayoutError(f"{folder} is not a folder: expected the layout ROOT/SPLIT/"
                                    f"images/NAME.png|jpg and ROOT/SPLIT/labels/NAME.png")
        found: dict[str, Path] = {}
        for path in sorted(folder.iterdir()):
            if path.suffix.lower() not in suffixes:
                continue
            if path.stem in found:
                raise DataLayoutError(f"{found[path.stem].name} and {path.name} in {folder} have "
                                 f"the same stem: keep one file per name")
            found[path.stem] = path
        if not found:
            raise DataLayoutError(f"{folder} has no {'/'.join(suffixes)} files")
        return found

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[Tensor, Tensor]:
        """Sample ``index`` as read: ``uint8 [3, H, W]``, ``int64 [H, W]``."""
        image_path, label_path = self.samples[index]
        Image = _pil()
        with Image.open(image_path) as file:
            image = np.asarray(file.convert("RGB"))
        with Image.open(label_path) as file:
            if file.mode not in ("L", "P", "I", "I;16"):
                raise ValueError(f"{label_path} is a mode {file.mode} image: labels must be "
                                 f"single-channel class ids (mode L, P, I or I;16), not colours")
            label = np.asarray(file).astype(np.int64)
        if image.shape[:2] != label.shape:
            raise ValueError(f"{image_path} is {image.shape[1]}x{image.shape[0]} but "
                             f"{label_path} is {label.shape[1]}x{label.shape[0]}: an image "
                             f"and its label must have the same size")
        if self.num_classes is not None:
            bad = np.unique(label[(label >= self.num_classes) | (label < 0)])
            bad = bad[bad != self.ignore_index]
            if bad.size:
                raise ValueError(f"{label_path} has values {_some(bad.tolist())} outside "
                                 f"[0, {self.num_classes}) that are not the ignore index "
                                 f"{self.ignore_index}")
        return (torch.from_numpy(image.transpose(2, 0, 1).copy()), torch.from_numpy(label))

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, Tensor]:
        index, generator = _split_key(key)
        image, label = self.load(index)
        return (image, label) if self.transform is None else self.transform(image, label,
                                                                            generator)


def _some(names: Sequence[Any], limit: int = 5) -> str:
    shown = ", ".join(str(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------- transforms


def _check_pair(image: Tensor, label: Tensor) -> None:
    if image.dim() != 3 or label.dim() != 2 or image.shape[1:] != label.shape:
        raise ValueError(f"image {tuple(image.shape)} and label {tuple(label.shape)}: expected "
                         f"[C, H, W] and [H, W] of the same height and width")


def normalize(image: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """``uint8`` (0..255) or float (0..1) ``[C, H, W]`` -> ``float32 (x - mean) / std``."""
    x = image.float() / 255.0 if image.dtype == torch.uint8 else image.float()
    return (x - torch.tensor(mean).view(-1, 1, 1)) / torch.tensor(std).view(-1, 1, 1)


def resize_pair(image: Tensor, label: Tensor, height: int, width: int) -> tuple[Tensor, Tensor]:
    """Float ``image`` bilinearly (antialiased when shrinking, as Pillow), ``label`` by nearest
    pixel centre (no new values), both to ``height x width``."""
    if (height, width) == tuple(label.shape):
        return image, label
    shrinking = height < label.shape[0] or width < label.shape[1]
    image = F.interpolate(image[None], size=(height, width), mode="bilinear",
                          align_corners=False, antialias=shrinking)[0]
    label = F.interpolate(label[None, None].float(), size=(height, width),
                          mode="nearest-exact")[0, 0].long()
    return image, label


def crop_pair(image: Tensor, label: Tensor, top: int, left: int, height: int, width: int,
              ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """The ``height x width`` window at ``(top, left)``, which may reach outside the image:
    outside pixels are 0 in the image (the mean, once normalised) and ``ignore_index`` in the
    label."""
    out_image = image.new_zeros(image.shape[0], height, width)
    out_label = label.new_full((height, width), ignore_index)
    rows = slice(max(top, 0), min(top + height, label.shape[0]))
    cols = slice(max(left, 0), min(left + width, label.shape[1]))
    if rows.start < rows.stop and cols.start < cols.stop:
        target = (slice(rows.start - top, rows.stop - top), slice(cols.start - left,
                                                                   cols.stop - left))
        out_image[:, target[0], target[1]] = image[:, rows, cols]
        out_label[target] = label[rows, cols]
    return out_image, out_label


def _randint(low: int, high: int, generator: torch.Generator | None) -> int:
    """Uniform integer in ``[low, high]``."""
    return int(torch.randint(low, high + 1, (), generator=generator))


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator))


def random_window(size: int, crop: int, generator: torch.Generator | None,
                  centre: int | None = None) -> int:
    """Start of a ``crop``-long window over ``size`` pixels: inside the image when it is
    larger, holding all of it when it is smaller (the rest is padding). Uniform, or as close
    to centred on pixel ``centre`` as those bounds allow (the pixel is always inside)."""
    low, high = min(0, size - crop), max(0, size - crop)
    if centre is None:
        return _randint(low, high, generator)
    return min(max(centre - crop // 2, low), high)


def class_uniform_pixel(label: Tensor, generator: torch.Generator | None,
                        ignore_index: int = IGNORE_INDEX) -> tuple[int, int] | None:
    """A pixel of a class drawn uniformly among the classes present in ``label`` (ignored
    pixels excluded), the pixel drawn uniformly among that class's; None when every pixel is
    ignored. Rare classes are then as likely to be in a crop as common ones."""
    classes = label.unique()
    classes = classes[classes != ignore_index]
    if classes.numel() == 0:
        return None
    chosen = classes[_randint(0, classes.numel() - 1, generator)]
    pixels = (label == chosen).nonzero()
    row, col = pixels[_randint(0, pixels.shape[0] - 1, generator)].tolist()
    return row, col


def _size_pair(size: int | tuple[int, int], name: str) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or min(pair) < 1:
        raise ValueError(f"{name}={size}: give a positive int or (height, width)")
    return pair  # type: ignore[return-value]


def _check_mean_std(mean: Sequence[float], std: Sequence[float]) -> None:
    if len(mean) != len(std) or min(std) <= 0:
        raise ValueError(f"mean={tuple(mean)}, std={tuple(std)}: one value per channel each, "
                         f"std > 0")


class TrainTransform:
    """The training augmentation of paper §4.2: normalise, scale by a random factor in
    ``scale_range`` (0.7-2.0), flip horizontally with ``flip_probability``, then take a
    ``crop_size`` window (padded with 0 / ``ignore_index`` where the scaled image is smaller).

    With probability ``class_uniform`` the window is centred (as far as the image allows) on a
    pixel of a class drawn uniformly among those present (:func:`class_uniform_pixel`);
    otherwise it is uniform. ``transform(image, label, generator)`` is deterministic given the
    generator's state.
    """

    def __init__(self, crop_size: int | tuple[int, int], mean: Sequence[float],
                 std: Sequence[float], scale_range: tuple[float, float] = (0.7, 2.0),
                 flip_probability: float = 0.5, class_uniform: float = 0.0,
                 ignore_index: int = IGNORE_INDEX) -> None:
        self.crop_size = _size_pair(crop_size, "crop_size")
        _check_mean_std(mean, std)
        if not 0 < scale_range[0] <= scale_range[1]:
            raise ValueError(f"scale_range={scale_range}: need 0 < low <= high")
        for name, p in (("flip_probability", flip_probability), ("class_uniform", class_uniform)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name}={p}: a probability in [0, 1]")
        self.mean, self.std = tuple(mean), tuple(std)
        self.scale_range, self.flip_probability = scale_range, flip_probability
        self.class_uniform, self.ignore_index = class_uniform, ignore_index

    def __call__(self, image: Tensor, label: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        _check_pair(image, label)
        image = normalize(image, self.mean, self.std)
        factor = _uniform(*self.scale_range, generator)
        image, label = resize_pair(image, label, max(1, round(label.shape[0] * factor)),
                                   max(1, round(label.shape[1] * factor)))
        if _uniform(0.0, 1.0, generator) < self.flip_probability:
            image, label = image.flip(-1), label.flip(-1)
        centre = None
        if self.class_uniform and _uniform(0.0, 1.0, generator) < self.class_uniform:
            centre = class_uniform_pixel(label, generator, self.ignore_index)
        (crop_h, crop_w), (height, width) = self.crop_size, label.shape
        top = random_window(height, crop_h, generator, None if centre is None else centre[0])
        left = random_window(width, crop_w, generator, None if centre is None else centre[1])
        return crop_pair(image, label, top, left, crop_h, crop_w, self.ignore_index)


class EvalTransform:
    """Validation: normalise only; with ``long_side``, first resize so the longer side has
    that many pixels (image bilinear, label nearest)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float],
                 long_side: int | None = None) -> None:
        _check_mean_std(mean, std)
        if long_side is not None and long_side < 1:
            raise ValueError(f"long_side={long_side}: a positive number of pixels, or None")
        self.mean, self.std, self.long_side = tuple(mean), tuple(std), long_side

    def __call__(self, image: Tensor, label: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        _check_pair(image, label)
        image = normalize(image, self.mean, self.std)
        if self.long_side is not None:
            height, width = label.shape
            factor = self.long_side / max(height, width)
            image, label = resize_pair(image, label, max(1, round(height * factor)),
                                       max(1, round(width * factor)))
        return image, label


__all__ = [
    "CANVAS_CLASSES", "CANVAS_MEAN", "CANVAS_STD", "IGNORE_INDEX", "NUM_CANVAS_CLASSES",
    "DigitsCanvas", "EvalTransform", "SegmentationFolder", "TrainTransform",
    "class_uniform_pixel", "crop_pair", "normalize", "random_window", "resize_pair",
]
