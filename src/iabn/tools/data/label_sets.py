"""The classes of a segmentation dataset and how its label files encode them.

A :class:`LabelSet` says which value a label file stores for each training class (the
*label id*; the class's index in :attr:`LabelSet.classes` is its *train id*, what a model
predicts), which stored values are void (mapped to the ignore index) and the colour of each
class. Tables for Cityscapes (torchvision's copy of the official ``cityscapesscripts`` table),
Pascal VOC 2012 and Mapillary Vistas (read from the ``config.json`` the user's copy ships)
are here, as are the names of the layouts ``iabn train-seg --dataset`` accepts.

Only torch at import time: the ``iabn`` parser and ``iabn segment`` import this module, and
they must not pull in torchvision (imported inside :func:`cityscapes_labels`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..arguments import LAYOUTS
from .errors import DataLayoutError

#: Layouts of published datasets: their classes come from the data, not the config.
PUBLISHED = ("cityscapes", "vistas", "voc")

Colour = tuple[int, int, int]


def voc_colormap(count: int = 256) -> list[Colour]:
    """The Pascal VOC devkit's colour map (``VOClabelcolormap.m``): the bits of the index
    spread over R, G and B from the most significant bit down, so nearby ids differ."""
    colours = []
    for index in range(count):
        r = g = b = 0
        c = index
        for shift in range(7, -1, -1):
            r |= (c & 1) << shift
            g |= ((c >> 1) & 1) << shift
            b |= ((c >> 2) & 1) << shift
            c >>= 3
        colours.append((r, g, b))
    return colours


@dataclass(frozen=True)
class LabelSet:
    """Classes of a dataset: ``classes[t]`` is the name of train id ``t``, ``colors[t]`` its
    RGB colour, ``label_ids[t]`` the value its label files store for it; ``void_ids`` are
    stored values that mark pixels without a class. Any other stored value is an error (a
    label file of another dataset, or colours instead of ids)."""

    name: str
    classes: tuple[str, ...]
    colors: tuple[Colour, ...]
    label_ids: tuple[int, ...]
    void_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError(f"label set {self.name!r} has no classes")
        if not len(self.classes) == len(self.colors) == len(self.label_ids):
            raise ValueError(f"label set {self.name!r}: {len(self.classes)} classes, "
                             f"{len(self.colors)} colours and {len(self.label_ids)} label ids; "
                             f"give one of each per class")
        stored = [*self.label_ids, *self.void_ids]
        if len(set(stored)) != len(stored) or min(stored) < 0:
            raise ValueError(f"label set {self.name!r}: label and void ids must be distinct "
                             f"and non-negative")
        if any(len(c) != 3 or not all(0 <= v <= 255 for v in c) for c in self.colors):
            raise ValueError(f"label set {self.name!r}: colours must be (r, g, b) in 0..255")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def lookup(self, ignore_index: int) -> Tensor:
        """``int64`` table: stored value -> train id, ``ignore_index`` for void values, -1
        for values the dataset does not use."""
        table = torch.full((max(*self.label_ids, *self.void_ids, 0) + 1,), -1, dtype=torch.int64)
        table[list(self.void_ids)] = ignore_index
        table[list(self.label_ids)] = torch.arange(self.num_classes)
        return table

    def to_train_ids(self, stored: Tensor, table: Tensor, source: str | Path) -> Tensor:
        """The train ids of a label file's values (``table`` from :meth:`lookup`); values the
        dataset does not use are a ValueError naming ``source``."""
        known = (stored >= 0) & (stored < len(table))
        mapped = table[stored.clamp(0, len(table) - 1)]
        bad = ~known | (mapped < 0)
        if bad.any():
            values = stored[bad].unique().tolist()
            raise ValueError(
                f"{source} has label values {_some(values)} that are neither {self.name} class "
                f"ids ({_runs(self.label_ids)}) nor void ids ({_runs(self.void_ids) or 'none'})"
                f": is it a {self.name} label file?")
        return mapped

    def to_label_ids(self, train_ids: Tensor) -> Tensor:
        """Predicted train ids -> the values this dataset's label files use for them (e.g.
        Cityscapes ``labelIds``, as its official evaluation reads them)."""
        if train_ids.numel() and (train_ids.min() < 0 or train_ids.max() >= self.num_classes):
            raise ValueError(f"train ids outside [0, {self.num_classes}) have no {self.name} "
                             f"label id")
        return torch.tensor(self.label_ids, dtype=torch.int64)[train_ids.long()]

    def palette(self) -> list[int]:
        """768 values for PIL's ``putpalette``: class ``t``'s colour at index ``t``, black for
        the indices after the classes."""
        colours = list(self.colors)[:256] + [(0, 0, 0)] * max(0, 256 - self.num_classes)
        return [value for colour in colours for value in colour]

    def to_dict(self) -> dict[str, Any]:
        """Plain lists and strings (a snapshot stores it and loads with ``weights_only``)."""
        return {"name": self.name, "classes": list(self.classes),
                "colors": [list(c) for c in self.colors], "label_ids": list(self.label_ids),
                "void_ids": list(self.void_ids)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LabelSet:
        """The inverse of :meth:`to_dict`; ValueError naming what is missing or wrong."""
        try:
            return cls(str(data["name"]), tuple(str(n) for n in data["classes"]),
                       tuple(tuple(int(v) for v in c) for c in data["colors"]),  # type: ignore[misc]
                       tuple(int(i) for i in data["label_ids"]),
                       tuple(int(i) for i in data.get("void_ids", ())))
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a label set (name, classes, colors, label_ids): {error}"
                             ) from None


def _some(values: Sequence[Any], limit: int = 8) -> str:
    if len(values) > limit:
        return ", ".join(str(v) for v in values[:limit]) + f" ... ({len(values)} values)"
    return ", ".join(str(v) for v in values)


def _runs(values: Sequence[int]) -> str:
    """``0-6, 9, 14-16``: sorted values with consecutive runs joined."""
    runs: list[list[int]] = []
    for value in sorted(values):
        if runs and value == runs[-1][1] + 1:
            runs[-1][1] = value
        else:
            runs.append([value, value])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def identity_labels(name: str, classes: Sequence[str],
                    void_ids: Sequence[int] = ()) -> LabelSet:
    """Classes stored as their own train ids (the embedded digits, ``folder`` data), coloured
    with the VOC colour map."""
    return LabelSet(name, tuple(classes), tuple(voc_colormap(len(classes))),
                    tuple(range(len(classes))),
                    tuple(v for v in void_ids if v >= len(classes)))


def cityscapes_labels() -> LabelSet:
    """The 19 Cityscapes training classes: ``labelIds`` PNGs store the label ``id``; the 15
    ids without a train id (unlabeled, ego vehicle, ..., parking, guard rail, caravan) are
    void. From ``torchvision.datasets.Cityscapes.classes``, torchvision's copy of
    ``cityscapesscripts/helpers/labels.py`` (tests compare the two)."""
    from torchvision.datasets import Cityscapes

    rows = [c for c in Cityscapes.classes if c.id >= 0]  # license plate (-1): polygons only
    trained = sorted((c for c in rows if 0 <= c.train_id < 255), key=lambda c: c.train_id)
    return LabelSet("cityscapes", tuple(c.name for c in trained),
                    tuple(tuple(c.color) for c in trained),  # type: ignore[misc]
                    tuple(c.id for c in trained),
                    tuple(c.id for c in rows if not 0 <= c.train_id < 255))


#: The 20 Pascal VOC 2012 object classes after the background (``VOCdevkit/devkit_doc``,
#: "classes"); label PNGs store the index, 255 on object borders and difficult regions.
VOC_CLASSES = (
    "background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat",
    "chair", "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
    "sheep", "sofa", "train", "tvmonitor",
)
VOC_VOID = 255


def voc_labels() -> LabelSet:
    """Pascal VOC 2012: 21 classes (background first), 255 void, the devkit's colours
    (torchvision has the files' layout but no class table)."""
    return LabelSet("voc", VOC_CLASSES, tuple(voc_colormap(len(VOC_CLASSES))),
                    tuple(range(len(VOC_CLASSES))), (VOC_VOID,))


def vistas_labels(config: str | Path) -> LabelSet:
    """Mapillary Vistas classes from the dataset's own config file (v1.2: ``config.json``,
    66 labels; ``config_v1.2.json`` in the v2.0 archive). Label PNGs store a label's index in
    the file's ``labels`` list; labels with ``"evaluate": false`` (v1.2: "Unlabeled") are
    void, the others are the classes in file order (v1.2: 65, as the original package's
    Vistas model). Class names are the ``readable`` ones where they are unique."""
    path = Path(config)
    try:
        entries = json.loads(path.read_text())["labels"]
        names = [str(e["name"]) for e in entries]
        readable = [str(e.get("readable", e["name"])) for e in entries]
        colours = [tuple(int(v) for v in e["color"]) for e in entries]
        evaluated = [bool(e.get("evaluate", True)) for e in entries]
    except FileNotFoundError:
        raise DataLayoutError(f"Mapillary Vistas config {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError,
            ValueError) as error:
        raise DataLayoutError(f"{path} is not a Mapillary Vistas config (a JSON object whose "
                              f"'labels' list has name, color and evaluate per label): "
                              f"{type(error).__name__}: {error}") from None
    shown = readable if len(set(readable)) == len(readable) else names
    keep = [i for i, flag in enumerate(evaluated) if flag]
    if not keep:
        raise DataLayoutError(f"{path}: no label has \"evaluate\": true, so there is nothing "
                              f"to train")
    try:
        return LabelSet("vistas", tuple(shown[i] for i in keep),
                        tuple(colours[i] for i in keep),  # type: ignore[misc]
                        tuple(keep), tuple(i for i, flag in enumerate(evaluated) if not flag))
    except ValueError as error:
        raise DataLayoutError(f"{path}: {error}") from None


__all__ = ["LAYOUTS", "PUBLISHED", "VOC_CLASSES", "LabelSet", "cityscapes_labels",
           "identity_labels", "vistas_labels", "voc_colormap", "voc_labels"]
