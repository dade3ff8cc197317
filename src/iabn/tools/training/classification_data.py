"""Where classification images come from, and the transforms the ``input`` section describes.

With ``data.root`` set (the ``DATA_ROOT`` argument) the images are an ImageFolder layout
(:mod:`iabn.tools.data.imagefolder`); without it, scikit-learn's bundled handwritten digits
(:mod:`iabn.tools.data.digits`), upscaled to ``data.digits_size`` pixels and split
deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as F

from ..data.digits import NUM_CLASSES, load_digits_uint8, split_indices
from ..data.imagefolder import ImageFolder, find_classes, train_val_folders
from ..data.transforms import EvalTransform, TrainTransform


class DigitsImages(Dataset):
    """``(uint8 [3, size, size] RGB image, label)``: 8x8 digit scans upscaled (bilinear) to
    ``size x size``."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, size: int) -> None:
        grey = F.resize(torch.from_numpy(images)[:, None], [size, size],
                        interpolation=F.InterpolationMode.BILINEAR, antialias=True)
        self.images = grey.expand(-1, 3, -1, -1).contiguous()
        self.labels = labels.tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        return self.images[index], self.labels[index]


@dataclass
class ImageSources:
    """Untransformed ``(image, label)`` datasets and what they hold (``train`` is None when
    only the validation images were asked for)."""

    train: Dataset | None
    val: Dataset
    num_classes: int
    description: str


def image_sources(data: dict[str, Any], with_train: bool = True) -> ImageSources:
    """The images of a ``data`` config section (see module doc). Without ``with_train`` an
    ImageFolder's ``train`` files are not listed: its class folder names suffice."""
    if data["root"] is None:
        images, labels = load_digits_uint8()
        train_idx, val_idx = split_indices(labels, data["digits_val_fraction"],
                                           data["digits_split_seed"])
        size = data["digits_size"]
        train = DigitsImages(images[train_idx], labels[train_idx], size) if with_train else None
        return ImageSources(
            train, DigitsImages(images[val_idx], labels[val_idx], size), NUM_CLASSES,
            f"embedded digits at {size}x{size}: {len(train_idx)} train / {len(val_idx)} val "
            f"images, {NUM_CLASSES} classes")
    root = Path(data["root"])
    if not with_train:
        classes = find_classes(root / "train")
        val = ImageFolder(root / "val", classes=classes)
        return ImageSources(None, val, len(classes),
                            f"{root}: {len(val)} val images, {len(classes)} classes")
    train, val = train_val_folders(root)
    return ImageSources(train, val, len(train.classes),
                        f"{root}: {len(train)} train / {len(val)} val images, "
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
    ``scale_val``/``crop_val``). Multi-crop evaluation mirrors the crops only when the model
    trained with flips (``flip_train``): ten crops, else the five of the image itself."""
    return EvalTransform(scale or section["scale_val"], crop or section["crop_val"], ten_crops,
                         section["mean"], section["std"], mirror=section["flip_train"])


__all__ = ["DigitsImages", "ImageSources", "eval_transform", "image_sources",
           "train_transform"]
