"""Image classification data laid out as one folder per class, read with Pillow.

    DATA_ROOT/train/CLASS/IMAGE      DATA_ROOT/val/CLASS/IMAGE

Class names are the sorted sub-folder names of ``train``; the validation classes must be among
them (they get the training labels). Images are files with a common image extension, in any
sub-folder depth below their class folder, sorted by path so the order is the same everywhere.
Layout problems raise :class:`DataLayoutError` naming the folder and what to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


class DataLayoutError(ValueError):
    """A data folder does not have the ``split/CLASS/IMAGE`` layout."""


def pil_image() -> Any:
    """Pillow's ``Image`` module, or an ImportError saying how to install it."""
    try:
        from PIL import Image
    except ImportError as error:  # an optional dependency: say how to get it
        raise ImportError("reading image folders needs Pillow: pip install 'iabn[tools]'"
                          ) from error
    return Image


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


class ImageFolder(Dataset):
    """``(RGB PIL image, label)`` for every image below ``split_dir/CLASS/``; labels index
    ``classes`` (by default the sorted sub-folder names of ``split_dir``)."""

    def __init__(self, split_dir: str | Path, classes: list[str] | None = None) -> None:
        self.root = Path(split_dir)
        present = find_classes(self.root)
        self.classes = present if classes is None else list(classes)
        foreign = sorted(set(present) - set(self.classes))
        if foreign:
            raise DataLayoutError(
                f"{self.root} has class folders the training data does not: "
                f"{', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}; class folders "
                f"must match between train and val")
        self.samples: list[tuple[Path, int]] = []
        for label, name in enumerate(self.classes):
            folder = self.root / name
            if not folder.is_dir():
                continue  # a class without validation images
            files = sorted(path for path in folder.rglob("*")
                           if path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file())
            if not files:
                raise DataLayoutError(
                    f"class folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)}): "
                    f"add images or remove the folder")
            self.samples.extend((path, label) for path in files)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.samples[index]
        try:
            with pil_image().open(path) as image:
                return image.convert("RGB"), label
        except OSError as error:
            raise OSError(f"cannot read image {path}: {error}") from error


def train_val_folders(data_root: str | Path) -> tuple[ImageFolder, ImageFolder]:
    """The ``train`` and ``val`` splits of ``data_root``, labelled by the training classes."""
    root = Path(data_root)
    if not root.is_dir():
        raise DataLayoutError(f"DATA_ROOT {root} is not a folder")
    train = ImageFolder(root / "train")
    return train, ImageFolder(root / "val", classes=train.classes)


__all__ = ["IMAGE_EXTENSIONS", "DataLayoutError", "ImageFolder", "find_classes", "pil_image",
           "train_val_folders"]
