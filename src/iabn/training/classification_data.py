"""Where classification images come from, and the transforms the ``input`` section describes.

With ``data.root`` set (the ``DATA_ROOT`` argument) the images are an ImageFolder layout
(:mod:`iabn.data.imagefolder`); without it, scikit-learn's bundled handwritten digits
(:mod:`iabn.data.digits`), upscaled to ``data.digits_size`` pixels and split deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from ..data.digits import NUM_CLASSES, load_digits_uint8, split_indices
from ..data.imagefolder import pil_image, train_val_folders
from ..data.transforms import EvalTransform, TrainTransform


class DigitsImages(Dataset):
    """``(RGB PIL image, label)``: 8x8 digit scans upscaled (bilinear) to ``size x size``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, size: int) -> None:
        image_class = pil_image()
        bilinear = image_class.Resampling.BILINEAR
        self.images = np.stack([
            np.asarray(image_class.fromarray(image).resize((size, size), bilinear))
            for image in images
        ])
        self.labels = labels.tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return pil_image().fromarray(self.images[index]).convert("RGB"), self.labels[index]


@dataclass
class ImageSources:
    """Untransformed ``(image, label)`` datasets and what they hold."""

    train: Dataset
    val: Dataset
    num_classes: int
    description: str


def image_sources(data: dict[str, Any]) -> ImageSources:
    """The images of a ``data`` config section (see module doc)."""
    if data["root"] is None:
        images, labels = load_digits_uint8()
        train_idx, val_idx = split_indices(labels, data["digits_val_fraction"],
                                           data["digits_split_seed"])
        size = data["digits_size"]
        return ImageSources(
            DigitsImages(images[train_idx], labels[train_idx], size),
            DigitsImages(images[val_idx], labels[val_idx], size), NUM_CLASSES,
            f"embedded digits at {size}x{size}: {len(train_idx)} train / {len(val_idx)} val "
            f"images, {NUM_CLASSES} classes")
    train, val = train_val_folders(data["root"])
    return ImageSources(train, val, len(train.classes),
                        f"{data['root']}: {len(train)} train / {len(val)} val images, "
                        f"{len(train.classes)} classes")


def train_transform(section: dict[str, Any]) -> TrainTransform:
    """The training augmentation of an ``input`` config section."""
    return TrainTransform(
        crop=section["crop_train"], scale=section["scale_train"],
        area_range=section["area_range_train"], ratio_range=section["ratio_range_train"],
        flip=section["flip_train"], jitter=section["color_jitter_train"],
        lighting=section["lighting_train"], mean=section["mean"], std=section["std"])


def eval_transform(section: dict[str, Any], scale: int | None = None, crop: int | None = None,
                   ten_crops: bool = False) -> EvalTransform:
    """The evaluation transform of an ``input`` config section (``scale``/``crop`` override
    ``scale_val``/``crop_val``)."""
    return EvalTransform(scale or section["scale_val"], crop or section["crop_val"], ten_crops,
                         section["mean"], section["std"])


__all__ = ["DigitsImages", "ImageSources", "eval_transform", "image_sources",
           "train_transform"]
