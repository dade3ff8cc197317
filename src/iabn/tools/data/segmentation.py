"""Semantic segmentation data: the embedded :class:`DigitsCanvas` set, :class:`SegmentationFolder`
for images with label PNGs, and joint image/label transforms (paper §4.2).

A sample is ``(image, label)``: ``image`` ``[3, H, W]`` (``uint8`` from the datasets, ``float32``
normalised after a transform), ``label`` ``int64 [H, W]`` of class ids, ``ignore_index`` (255 by
default) where a pixel has no class (padding, void).

The transforms are ``torchvision.transforms.v2`` pipelines on ``tv_tensors.Image`` and
``tv_tensors.Mask`` (one draw moves both), plus what torchvision lacks: a relative random
scale, class-uniform crops, nearest-by-centre mask resizing.

Randomness comes only from the ``torch.Generator`` a transform is given (the v2 pipeline runs
with torch's global generator swapped for it, then restored). Dataset keys are an
index, or an ``(index, seed)`` pair such as :class:`iabn.tools.data.samplers.ShuffledShardSampler`
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
from torchvision import tv_tensors
from torchvision.io import ImageReadMode
from torchvision.transforms import v2

from .digits import IMAGE_SIZE, load_digits_uint8, split_indices
from .imagefolder import DataLayoutError, decode_file, read_rgb

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
    # Pillow only to upscale the 8x8 digits of DigitsCanvas: torchvision's bilinear resize
    # rounds differently (+-1 level), which would change the canvases the README measured.
    try:
        from PIL import Image
    except ImportError as error:  # an optional dependency: say how to get it
        raise ImportError("segmentation data needs Pillow: pip install 'iabn[tools]'") from error
    return Image


# --------------------------------------------------------------------------- DigitsCanvas
# (synthetic data torchvision has no equivalent of: the embedded, download-free default set)


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
    :func:`iabn.tools.data.digits.split_indices` (``val_fraction``, ``split_seed``), so no
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
        ROOT/SPLIT/labels/NAME.png                (single channel: 8/16-bit grey or palette)

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
        image, label = read_image_and_label(image_path, label_path)
        if self.num_classes is not None:
            bad = label[(label >= self.num_classes) | (label < 0)].unique()
            bad = bad[bad != self.ignore_index]
            if bad.numel():
                raise ValueError(f"{label_path} has values {_some(bad.tolist())} outside "
                                 f"[0, {self.num_classes}) that are not the ignore index "
                                 f"{self.ignore_index}")
        return image, label

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, Tensor]:
        index, generator = _split_key(key)
        image, label = self.load(index)
        return (image, label) if self.transform is None else self.transform(image, label,
                                                                            generator)


def read_image_and_label(image_path: str | Path, label_path: str | Path) -> tuple[Tensor, Tensor]:
    """An image as ``uint8 [3, H, W]`` RGB and its label file's values as ``int64 [H, W]``
    (a palette PNG's indices, not its colours). ValueError naming the file for a label with
    several channels or of another size than its image."""
    image = read_rgb(image_path)
    decoded = decode_file(label_path, ImageReadMode.UNCHANGED)  # palette PNG: indices
    if decoded.shape[0] != 1:
        raise ValueError(f"{label_path} has {decoded.shape[0]} channels: labels must be "
                         f"single-channel class ids (8- or 16-bit grey or palette PNG), "
                         f"not colours")
    label = decoded[0].to(torch.int64)
    if image.shape[1:] != label.shape:
        raise ValueError(f"{image_path} is {image.shape[2]}x{image.shape[1]} but "
                         f"{label_path} is {label.shape[1]}x{label.shape[0]}: an image "
                         f"and its label must have the same size")
    return image, label


def _some(names: Sequence[Any], limit: int = 5) -> str:
    shown = ", ".join(str(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# --------------------------------------------------------------------------- transforms


def _check_pair(image: Tensor, label: Tensor) -> None:
    if image.dim() != 3 or label.dim() != 2 or image.shape[1:] != label.shape:
        raise ValueError(f"image {tuple(image.shape)} and label {tuple(label.shape)}: expected "
                         f"[C, H, W] and [H, W] of the same height and width")


def _image_mask(image: Tensor, label: Tensor) -> tuple[tv_tensors.Image, tv_tensors.Mask]:
    return tv_tensors.Image(image), tv_tensors.Mask(label)


def _to_float_normalized(mean: Sequence[float], std: Sequence[float]) -> list[v2.Transform]:
    """``uint8`` (0..255) or float (0..1) image -> ``float32 (x - mean) / std``; masks as
    they are."""
    return [v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True),
            v2.Normalize(list(mean), list(std))]


def _resize(inpt: Tensor, size: tuple[int, int], shrinking: bool) -> Tensor:
    if isinstance(inpt, tv_tensors.Mask):
        # NEAREST_EXACT, not torchvision's default NEAREST for masks: NEAREST samples source
        # pixel floor(i * scale), off the image's pixel centres by up to half a source pixel.
        return v2.functional.resize(inpt, list(size), v2.InterpolationMode.NEAREST_EXACT)
    return v2.functional.resize(inpt, list(size), v2.InterpolationMode.BILINEAR,
                                antialias=shrinking)


def resize_pair(image: Tensor, label: Tensor, height: int, width: int) -> tuple[Tensor, Tensor]:
    """Float ``image`` bilinearly (antialiased when shrinking, as Pillow), ``label`` by nearest
    pixel centre (no new values, aligned with the image), both to ``height x width``."""
    if (height, width) == tuple(label.shape[-2:]):
        return image, label
    shrinking = height < label.shape[-2] or width < label.shape[-1]
    return (_resize(tv_tensors.Image(image), (height, width), shrinking),
            _resize(tv_tensors.Mask(label), (height, width), shrinking))


def crop_pair(image: Tensor, label: Tensor, top: int, left: int, height: int, width: int,
              ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """The ``height x width`` window at ``(top, left)``, which may reach outside the image:
    outside pixels are 0 in the image (the mean, once normalised) and ``ignore_index`` in the
    label."""
    image, label = tv_tensors.Image(image), tv_tensors.Mask(label)
    rows, cols = label.shape[-2:]
    padding = [max(0, -left), max(0, -top), max(0, left + width - cols),
               max(0, top + height - rows)]  # left, top, right, bottom
    if any(padding):
        image = v2.functional.pad(image, padding, fill=0)
        label = v2.functional.pad(label, padding, fill=ignore_index)
    top, left = top + padding[1], left + padding[0]
    return (v2.functional.crop(image, top, left, height, width),
            v2.functional.crop(label, top, left, height, width))


class RandomScale(v2.Transform):
    """Scale images and masks by one factor drawn uniformly from ``scale_range`` (images
    bilinear, masks nearest, as :func:`resize_pair`). torchvision has no relative random
    scale: ``v2.ScaleJitter`` scales towards a fixed target size, ``v2.RandomResize`` to a
    side length."""

    def __init__(self, scale_range: tuple[float, float]) -> None:
        super().__init__()
        self.scale_range = scale_range

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        height, width = next(inpt for inpt in flat_inputs
                             if isinstance(inpt, (tv_tensors.Image, tv_tensors.Mask))).shape[-2:]
        factor = _uniform(*self.scale_range, None)
        size = (max(1, round(height * factor)), max(1, round(width * factor)))
        return {"size": size, "same": size == (height, width),
                "shrinking": size[0] < height or size[1] < width}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        return inpt if params["same"] else _resize(inpt, params["size"], params["shrinking"])


class RandomPaddedCrop:
    """A ``crop_size`` window of image and mask, padded with 0 / ``ignore_index`` where they
    are smaller (as ``v2.RandomCrop(pad_if_needed=True)``, which it uses), or with probability
    ``class_uniform`` centred on a pixel of a class drawn uniformly among those present
    (:func:`class_uniform_pixel`), which torchvision lacks."""

    def __init__(self, crop_size: tuple[int, int], class_uniform: float,
                 ignore_index: int) -> None:
        self.crop_size, self.class_uniform = crop_size, class_uniform
        self.ignore_index = ignore_index
        self.uniform = v2.RandomCrop(crop_size, pad_if_needed=True,
                                     fill={tv_tensors.Image: 0, tv_tensors.Mask: ignore_index})

    def __call__(self, image: tv_tensors.Image, mask: tv_tensors.Mask) -> tuple[Any, Any]:
        centre = None
        if self.class_uniform and _uniform(0.0, 1.0, None) < self.class_uniform:
            centre = class_uniform_pixel(mask.as_subclass(Tensor), None, self.ignore_index)
        if centre is None:
            return self.uniform(image, mask)
        (crop_h, crop_w), (height, width) = self.crop_size, mask.shape[-2:]
        top = random_window(height, crop_h, None, centre[0])
        left = random_window(width, crop_w, None, centre[1])
        return crop_pair(image, mask, top, left, crop_h, crop_w, self.ignore_index)


def _with_generator(pipeline: Callable[..., Any], generator: torch.Generator | None,
                    *inputs: Any) -> Any:
    """``pipeline(*inputs)`` drawing from ``generator`` (advanced as if drawn from directly)
    instead of torch's global generator, which is left as it was; None: the global one."""
    if generator is None:
        return pipeline(*inputs)
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(generator.get_state())
        out = pipeline(*inputs)
        generator.set_state(torch.get_rng_state())
    return out


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
        self.pipeline = v2.Compose([
            *_to_float_normalized(self.mean, self.std),
            RandomScale(scale_range),
            v2.RandomHorizontalFlip(flip_probability),
            RandomPaddedCrop(self.crop_size, class_uniform, ignore_index),
        ])

    def __call__(self, image: Tensor, label: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        _check_pair(image, label)
        out = _with_generator(self.pipeline, generator, *_image_mask(image, label))
        return out[0].as_subclass(Tensor), out[1].as_subclass(Tensor)


class EvalTransform:
    """Validation: normalise only; with ``long_side``, first resize so the longer side has
    that many pixels (image bilinear, label nearest)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float],
                 long_side: int | None = None) -> None:
        _check_mean_std(mean, std)
        if long_side is not None and long_side < 1:
            raise ValueError(f"long_side={long_side}: a positive number of pixels, or None")
        self.mean, self.std, self.long_side = tuple(mean), tuple(std), long_side
        self.normalize = v2.Compose(_to_float_normalized(self.mean, self.std))

    def __call__(self, image: Tensor, label: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        _check_pair(image, label)
        image, label = self.normalize(*_image_mask(image, label))
        if self.long_side is not None:
            height, width = label.shape
            factor = self.long_side / max(height, width)
            image, label = resize_pair(image, label, max(1, round(height * factor)),
                                       max(1, round(width * factor)))
        return image.as_subclass(Tensor), label.as_subclass(Tensor)


__all__ = [
    "CANVAS_CLASSES", "CANVAS_MEAN", "CANVAS_STD", "IGNORE_INDEX", "NUM_CANVAS_CLASSES",
    "DigitsCanvas", "EvalTransform", "RandomPaddedCrop", "RandomScale", "SegmentationFolder",
    "TrainTransform", "class_uniform_pixel", "crop_pair", "random_window",
    "read_image_and_label", "resize_pair",
]
