"""Image classification data laid out as one folder per class: ``torchvision.datasets``'
``DatasetFolder`` with this project's layout checks, images decoded by ``torchvision.io``.

    DATA_ROOT/train/CLASS/IMAGE      DATA_ROOT/val/CLASS/IMAGE

Class names are the sorted sub-folder names of ``train``; the validation classes must be among
them (they get the training labels). Images are files with a common image extension, in any
sub-folder depth below their class folder, sorted by path so the order is the same everywhere.
Layout problems raise :class:`DataLayoutError` naming the folder and what to fix (torchvision's
own errors do neither).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torchvision.datasets import DatasetFolder
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as F

from .errors import DataLayoutError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
#: What ``torchvision.io.decode_image`` reads (it has no BMP, TIFF or PNM decoder).
DECODED_BY_TORCHVISION = (".jpg", ".jpeg", ".png", ".webp", ".gif")


def decode_file(path: str | Path, mode: ImageReadMode = ImageReadMode.RGB) -> Tensor:
    """The image file at ``path`` as a ``[C, H, W]`` tensor, ``uint8``, or ``uint16`` for a
    16-bit PNG (``mode``: ``RGB``, or ``UNCHANGED`` for e.g. label maps). Unreadable files
    raise OSError naming the path."""
    try:
        with warnings.catch_warnings():
            # torchvision 0.29 deprecates its decoders in favour of TorchCodec, which the
            # tested platform does not ship; they still decode correctly.
            warnings.filterwarnings("ignore", category=DeprecationWarning,
                                    message=".*decoding and encoding capabilities")
            return decode_image(str(path), mode=mode)
    except RuntimeError as error:
        raise OSError(f"cannot read image {path}: {error}") from error


def read_rgb(path: str | Path) -> Tensor:
    """An image file as ``uint8 [3, H, W]`` RGB (16-bit PNGs scaled down to 8 bits)."""
    if Path(path).suffix.lower() in DECODED_BY_TORCHVISION:
        image = decode_file(path)
    else:
        image = _read_rgb_with_pillow(path)
    return F.to_dtype(image, torch.uint8, scale=True)


def _read_rgb_with_pillow(path: str | Path) -> Tensor:
    # Pillow only for the formats torchvision.io cannot decode (BMP, TIFF, PPM/PGM).
    try:
        from PIL import Image
    except ImportError as error:  # an optional dependency: say how to get it
        raise ImportError(f"reading {path} needs Pillow: pip install 'iabn[tools]'") from error
    try:
        with Image.open(path) as file:
            pixels = np.asarray(file.convert("RGB"))
    except OSError as error:
        raise OSError(f"cannot read image {path}: {error}") from error
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())


def find_classes(split_dir: Path) -> list[str]:
    """Sorted names of the class sub-folders of ``split_dir``."""
    if not split_dir.is_dir():
        raise DataLayoutError(f"{split_dir} is not a folder: expected "
                              f"{split_dir}/CLASS/IMAGE files (one sub-folder per class)")
    classes = sorted(entry.name for entry in split_dir.iterdir() if entry.is_dir())
    if not classes:
        raise DataLayoutError(f"{split_dir} has no class sub-folders: put each class's images "
                              f"in {split_dir}/CLASS/")
    return classes


class ImageFolder(DatasetFolder):
    """``(uint8 [3, H, W] RGB image, label)`` for every image below ``split_dir/CLASS/``;
    labels index ``classes`` (by default the sorted sub-folder names of ``split_dir``).
    ``samples`` holds ``(path, label)`` pairs, as in torchvision."""

    def __init__(self, split_dir: str | Path, classes: list[str] | None = None) -> None:
        self.root_path = Path(split_dir)
        self._wanted = None if classes is None else list(classes)
        super().__init__(str(split_dir), loader=read_rgb, extensions=IMAGE_EXTENSIONS,
                         allow_empty=True)
        counts = {label: 0 for label in range(len(self.classes))}
        for _, label in self.samples:
            counts[label] += 1
        for label, name in enumerate(self.classes):
            folder = self.root_path / name
            if counts[label] == 0 and folder.is_dir():
                raise DataLayoutError(
                    f"class folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)}): "
                    f"add images or remove the folder")

    def find_classes(self, directory: str | Path) -> tuple[list[str], dict[str, int]]:
        present = find_classes(Path(directory))
        classes = present if self._wanted is None else self._wanted
        foreign = sorted(set(present) - set(classes))
        if foreign:
            raise DataLayoutError(
                f"{directory} has class folders the training data does not: "
                f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}; class folders "
                f"must match between train and val")
        return classes, {name: label for label, name in enumerate(classes)}


def train_val_folders(data_root: str | Path) -> tuple[ImageFolder, ImageFolder]:
    """The ``train`` and ``val`` splits of ``data_root``, labelled by the training classes."""
    root = Path(data_root)
    if not root.is_dir():
        raise DataLayoutError(f"DATA_ROOT {root} is not a folder")
    train = ImageFolder(root / "train")
    return train, ImageFolder(root / "val", classes=train.classes)


__all__ = ["IMAGE_EXTENSIONS", "DataLayoutError", "ImageFolder", "decode_file", "find_classes",
           "read_rgb", "train_val_folders"]
