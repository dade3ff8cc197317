"""Published segmentation datasets, read from the folders their archives unpack to:
Cityscapes (fine annotations), Mapillary Vistas v1.2 and Pascal VOC 2012.

Each is a :class:`LabelledImages`: samples are ``(image uint8 [3, H, W], label int64 [H, W])``
with the label file's values mapped to train ids (``ignore_index``, 255 by default, on void
pixels) by the dataset's :class:`~iabn.tools.data.label_sets.LabelSet`, and go through the same
joint transforms and ``(index, seed)`` keys as :class:`~iabn.tools.data.segmentation.
SegmentationFolder`. :func:`detect_layout` tells the layouts apart by their folders.

torchvision's ``Cityscapes`` and ``VOCSegmentation`` list the files; around them this module
adds what they lack: a fixed sample order (``Cityscapes`` lists in ``os.listdir`` order, which
differs between file systems, while exact resume and the ranks' shards need one order), checks
that name the missing folder or file before training starts (torchvision fails at the first
read, or unpacks archives it finds in ROOT), decoding by ``torchvision.io``, and the label
mapping (torchvision returns the stored ids). torchvision has no Mapillary Vistas dataset.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor
from torch.utils.data import Dataset

from .errors import DataLayoutError
from .label_sets import LabelSet, cityscapes_labels, vistas_labels, voc_labels
from .segmentation import (
    IGNORE_INDEX,
    JointTransform,
    SampleKey,
    _some,
    _split_key,
    read_image_and_label,
)

SPLITS = ("train", "val")
#: Mapillary Vistas folder of each split.
VISTAS_SPLITS = {"train": "training", "val": "validation"}
#: Where the Vistas label PNGs are, relative to the split folder, for each config file name:
#: the v1.2 archive, then the v2.0 archive (which also holds v1.2's labels).
VISTAS_CONFIGS = {"config.json": "labels", "config_v1.2.json": "v1.2/labels"}

CITYSCAPES_EXPECTED = ("ROOT/leftImg8bit/SPLIT/CITY/*_leftImg8bit.png and "
                       "ROOT/gtFine/SPLIT/CITY/*_gtFine_labelIds.png (leftImg8bit_trainvaltest"
                       ".zip and gtFine_trainvaltest.zip unpacked in ROOT)")
VISTAS_EXPECTED = ("ROOT/config.json, ROOT/training|validation/images/*.jpg and .../labels/*.png "
                   "(the v1.2 archive), or ROOT/config_v1.2.json and .../v1.2/labels/*.png "
                   "(the v2.0 archive)")
VOC_EXPECTED = ("ROOT/VOCdevkit/VOC2012/JPEGImages/*.jpg, SegmentationClass/*.png and "
                "ImageSets/Segmentation/{train,val}.txt (VOCtrainval_11-May-2012.tar unpacked "
                "in ROOT; ROOT may also be the VOCdevkit or VOC2012 folder)")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use one of {', '.join(SPLITS)}")


class LabelledImages(Dataset):
    """``(image path, label path)`` pairs whose label values ``labels`` maps to train ids.
    ``ignore_index`` (void pixels) must not be a train id."""

    def __init__(self, samples: list[tuple[Path, Path]], labels: LabelSet,
                 transform: JointTransform | None = None,
                 ignore_index: int = IGNORE_INDEX) -> None:
        if 0 <= ignore_index < labels.num_classes:
            raise ValueError(f"ignore_index={ignore_index} is one of the {labels.num_classes} "
                             f"{labels.name} train ids: use a value >= {labels.num_classes}, "
                             f"e.g. 255")
        self.samples, self.labels, self.classes = samples, labels, labels.classes
        self.transform, self.ignore_index = transform, ignore_index
        self._table = labels.lookup(ignore_index)

    def __len__(self) -> int:
        return len(self.samples)

    def load(self, index: int) -> tuple[Tensor, Tensor]:
        """Sample ``index`` before any transform: ``uint8 [3, H, W]``, train ids ``[H, W]``."""
        image_path, label_path = self.samples[index]
        image, stored = read_image_and_label(image_path, label_path)
        return image, self.labels.to_train_ids(stored, self._table, label_path)

    def __getitem__(self, key: SampleKey) -> tuple[Tensor, Tensor]:
        index, generator = _split_key(key)
        image, label = self.load(index)
        return (image, label) if self.transform is None else self.transform(image, label,
                                                                            generator)


def _require_folders(folders: list[Path], expected: str) -> None:
    missing = [str(folder) for folder in folders if not folder.is_dir()]
    if missing:
        raise DataLayoutError(f"{', '.join(missing)}: not a folder; expected {expected}")


def _require_files(pairs: list[tuple[Path, Path]], what: str) -> None:
    """Every image and label of ``pairs`` exists (a list file or a name rule can point to
    files that are not there)."""
    missing = [str(path) for pair in pairs for path in pair if not path.is_file()]
    if missing:
        raise DataLayoutError(f"{len(missing)} {what} file(s) missing: {_some(missing)}")


# --------------------------------------------------------------------------- Cityscapes


class CityscapesSegmentation(LabelledImages):
    """Cityscapes with fine annotations (``gtFine``), 19 classes (:func:`~iabn.tools.data.
    label_sets.cityscapes_labels`); ``root`` is the folder holding ``leftImg8bit/`` and
    ``gtFine/``::

        ROOT/leftImg8bit/SPLIT/CITY/CITY_SEQ_FRAME_leftImg8bit.png
        ROOT/gtFine/SPLIT/CITY/CITY_SEQ_FRAME_gtFine_labelIds.png

    Samples are sorted by image path."""

    def __init__(self, root: str | Path, split: str = "train",
                 transform: JointTransform | None = None, ignore_index: int = IGNORE_INDEX,
                 labels: LabelSet | None = None) -> None:
        _check_split(split)
        root = Path(root)
        # checked before torchvision looks: it would unpack archives it found in ROOT
        _require_folders([root / "leftImg8bit" / split, root / "gtFine" / split],
                         CITYSCAPES_EXPECTED)
        from torchvision.datasets import Cityscapes

        try:
            listing = Cityscapes(str(root), split=split, mode="fine", target_type="semantic")
        except OSError as error:  # e.g. a file where a city folder should be
            raise DataLayoutError(f"cannot list the Cityscapes {split} images in {root}: "
                                  f"{error}; expected {CITYSCAPES_EXPECTED}") from None
        pairs = sorted((Path(image), Path(targets[0]))
                       for image, targets in zip(listing.images, listing.targets, strict=True)
                       if image.endswith("_leftImg8bit.png"))
        if not pairs:
            raise DataLayoutError(f"{root / 'leftImg8bit' / split} has no "
                                  f"CITY/*_leftImg8bit.png images; expected {CITYSCAPES_EXPECTED}")
        _require_files(pairs, "Cityscapes image or gtFine_labelIds")
        super().__init__(pairs, labels or cityscapes_labels(), transform, ignore_index)


# --------------------------------------------------------------------------- Mapillary Vistas


def vistas_config(root: str | Path) -> tuple[Path, str]:
    """The Vistas v1.2 config file under ``root`` and the label folder it goes with (relative
    to a split folder)."""
    root = Path(root)
    for name, labels in VISTAS_CONFIGS.items():
        if (root / name).is_file():
            return root / name, labels
    raise DataLayoutError(f"{root} has no {' or '.join(VISTAS_CONFIGS)}: expected "
                          f"{VISTAS_EXPECTED}")


def _pair_by_stem(image_dir: Path, label_dir: Path, image_suffix: str,
                  expected: str) -> list[tuple[Path, Path]]:
    _require_folders([image_dir, label_dir], expected)
    images = {p.stem: p for p in image_dir.iterdir() if p.suffix.lower() == image_suffix}
    labels = {p.stem: p for p in label_dir.iterdir() if p.suffix.lower() == ".png"}
    problems = []
    if not images:
        problems.append(f"{image_dir} has no *{image_suffix} images")
    if set(images) - set(labels):
        problems.append(f"{len(set(images) - set(labels))} image(s) in {image_dir} have no "
                        f"label in {label_dir}: {_some(sorted(set(images) - set(labels)))}")
    if set(labels) - set(images):
        problems.append(f"{len(set(labels) - set(images))} label(s) in {label_dir} have no "
                        f"image in {image_dir}: {_some(sorted(set(labels) - set(images)))}")
    if problems:
        raise DataLayoutError("; ".join(problems) + " (images and labels pair by file name)")
    return [(images[stem], labels[stem]) for stem in sorted(images)]


class VistasSegmentation(LabelledImages):
    """Mapillary Vistas v1.2; ``root`` is the folder the archive unpacked to. Classes and
    colours come from its config file (:func:`~iabn.tools.data.label_sets.vistas_labels`: 65
    classes, "Unlabeled" void)::

        ROOT/config.json                                  (v1.2 archive)
        ROOT/training|validation/images/KEY.jpg
        ROOT/training|validation/labels/KEY.png          (palette PNG of label indices)

    or ``ROOT/config_v1.2.json`` and ``.../v1.2/labels/KEY.png`` (v2.0 archive). ``split``
    ``"train"`` reads ``training``, ``"val"`` ``validation``. Samples are sorted by key."""

    def __init__(self, root: str | Path, split: str = "train",
                 transform: JointTransform | None = None, ignore_index: int = IGNORE_INDEX,
                 labels: LabelSet | None = None) -> None:
        _check_split(split)
        root = Path(root)
        config, label_folder = vistas_config(root)
        folder = root / VISTAS_SPLITS[split]
        pairs = _pair_by_stem(folder / "images", folder / label_folder, ".jpg", VISTAS_EXPECTED)
        super().__init__(pairs, labels or vistas_labels(config), transform, ignore_index)


# --------------------------------------------------------------------------- Pascal VOC


def voc_root(root: str | Path) -> Path | None:
    """The folder holding ``VOCdevkit/VOC2012`` (torchvision's ``root``) for ``root`` being
    that folder, ``VOCdevkit`` or ``VOCdevkit/VOC2012``; None if it is none of them."""
    root = Path(root)
    if (root / "VOCdevkit" / "VOC2012").is_dir():
        return root
    if root.name == "VOCdevkit" and (root / "VOC2012").is_dir():
        return root.parent
    if root.name == "VOC2012" and root.parent.name == "VOCdevkit" and root.is_dir():
        return root.parent.parent
    return None


class PascalVOCSegmentation(LabelledImages):
    """Pascal VOC 2012 segmentation, 21 classes (:func:`~iabn.tools.data.label_sets.voc_labels`),
    255 void; ``split`` picks ``ImageSets/Segmentation/SPLIT.txt``, whose order the samples
    keep::

        ROOT/VOCdevkit/VOC2012/JPEGImages/NAME.jpg
        ROOT/VOCdevkit/VOC2012/SegmentationClass/NAME.png   (palette PNG of class indices)
        ROOT/VOCdevkit/VOC2012/ImageSets/Segmentation/train.txt, val.txt
    """

    def __init__(self, root: str | Path, split: str = "train",
                 transform: JointTransform | None = None, ignore_index: int = IGNORE_INDEX,
                 labels: LabelSet | None = None) -> None:
        _check_split(split)
        base = voc_root(root)
        if base is None:
            raise DataLayoutError(f"{root} holds no VOCdevkit/VOC2012 folder: expected "
                                  f"{VOC_EXPECTED}")
        devkit = base / "VOCdevkit" / "VOC2012"
        _require_folders([devkit / "JPEGImages", devkit / "SegmentationClass"], VOC_EXPECTED)
        split_file = devkit / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not split_file.is_file():
            raise DataLayoutError(f"{split_file} does not exist: expected {VOC_EXPECTED}")
        from torchvision.datasets import VOCSegmentation

        listing = VOCSegmentation(str(base), year="2012", image_set=split, download=False)
        pairs = [(Path(image), Path(mask))
                 for image, mask in zip(listing.images, listing.masks, strict=True)
                 if Path(image).name != ".jpg"]  # a blank line in the list file
        if not pairs:
            raise DataLayoutError(f"{split_file} names no images")
        _require_files(pairs, f"VOC image or SegmentationClass (listed in {split_file.name})")
        super().__init__(pairs, labels or voc_labels(), transform, ignore_index)


# --------------------------------------------------------------------------- choosing one

DATASETS: dict[str, type[LabelledImages]] = {
    "cityscapes": CityscapesSegmentation, "vistas": VistasSegmentation,
    "voc": PascalVOCSegmentation,
}


def detect_layout(root: str | Path) -> str:
    """``"cityscapes"``, ``"vistas"``, ``"voc"`` or ``"folder"`` (``train/images``), told
    apart by their top folders and files; DataLayoutError listing what each expects."""
    root = Path(root)
    if not root.is_dir():
        raise DataLayoutError(f"DATA_ROOT {root} is not a folder")
    if (root / "leftImg8bit").is_dir() and (root / "gtFine").is_dir():
        return "cityscapes"
    if any((root / name).is_file() for name in VISTAS_CONFIGS) and any(
            (root / split).is_dir() for split in VISTAS_SPLITS.values()):
        return "vistas"
    if voc_root(root) is not None:
        return "voc"
    if (root / "train" / "images").is_dir():
        return "folder"
    raise DataLayoutError(
        f"{root} has no segmentation layout iabn knows: Cityscapes ({CITYSCAPES_EXPECTED}), "
        f"Mapillary Vistas ({VISTAS_EXPECTED}), Pascal VOC 2012 ({VOC_EXPECTED}) or "
        f"ROOT/train|val/images + labels; name the layout with --dataset (data.dataset) to "
        f"be told what is missing")


def layout_labels(layout: str, root: str | Path) -> LabelSet:
    """The classes of a published layout (Vistas: from the config file in ``root``)."""
    if layout == "cityscapes":
        return cityscapes_labels()
    if layout == "voc":
        return voc_labels()
    if layout == "vistas":
        return vistas_labels(vistas_config(root)[0])
    raise ValueError(f"layout {layout!r}: use one of {', '.join(DATASETS)}")


def open_dataset(layout: str, root: str | Path, split: str,
                 transform: JointTransform | None = None, ignore_index: int = IGNORE_INDEX,
                 labels: LabelSet | None = None) -> LabelledImages:
    """The ``split`` of the published dataset ``layout`` (``cityscapes``, ``vistas`` or
    ``voc``) in ``root``."""
    if layout not in DATASETS:
        raise ValueError(f"layout {layout!r}: use one of {', '.join(DATASETS)}")
    return DATASETS[layout](root, split, transform, ignore_index, labels)


__all__ = ["DATASETS", "SPLITS", "CityscapesSegmentation", "LabelledImages",
           "PascalVOCSegmentation", "VistasSegmentation", "detect_layout", "layout_labels",
           "open_dataset", "vistas_config", "voc_root"]
