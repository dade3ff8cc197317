"""Tiny copies of the published segmentation layouts for the tests: a few 32x64 images per
split, written with the real folder and file names and the real label encodings (Cityscapes
``labelIds`` grey PNGs, Mapillary Vistas and VOC palette PNGs of label indices). Never
downloaded: everything here is drawn from a seeded generator."""

from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np
from PIL import Image

HEIGHT, WIDTH, BLOCK = 32, 64, 4

#: (city, sequence, frame) per split, named as in the real archives.
CITYSCAPES_FRAMES = {
    "train": [("aachen", "000000", "000019"), ("aachen", "000001", "000019"),
              ("bochum", "000000", "000313")],
    "val": [("frankfurt", "000000", "000294"), ("lindau", "000000", "000019"),
            ("munster", "000000", "000019")],
}
#: Cityscapes label ids: 0-33 (``cityscapesscripts.helpers.labels``). The ground truth leaves
#: out 31 (train) and 32 (motorcycle) so that a class can be absent from it.
CITYSCAPES_GT_IDS = [i for i in range(34) if i not in (31, 32)]
VOC_NAMES = {"train": ["2007_000032", "2007_000039", "2007_000063"],
             "val": ["2007_000033", "2007_000042"]}


def blocks(rng: np.random.Generator, values: list[int]) -> np.ndarray:
    """``uint8 [HEIGHT, WIDTH]`` of BLOCK x BLOCK squares, each one of ``values``."""
    coarse = rng.choice(np.array(values, dtype=np.uint8), (HEIGHT // BLOCK, WIDTH // BLOCK))
    return np.kron(coarse, np.ones((BLOCK, BLOCK), dtype=np.uint8))


def _rgb(rng: np.random.Generator) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8))


def _palette_png(values: np.ndarray, colours: list[tuple[int, int, int]]) -> Image.Image:
    image = Image.fromarray(values, mode="P")
    flat = [v for colour in colours for v in colour]
    image.putpalette(flat + [0] * (768 - len(flat)))
    return image


def write_cityscapes(root: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """``leftImg8bit`` + ``gtFine`` (``*_gtFine_labelIds.png``, plus a ``*_gtFine_color.png``
    as the archive has) for CITYSCAPES_FRAMES; returns ``{labelIds path: ids}``. The first
    block of every label is id 7 (road), the second id 0 (unlabeled)."""
    rng = np.random.default_rng(seed)
    written = {}
    for split, frames in CITYSCAPES_FRAMES.items():
        for city, sequence, frame in frames:
            stem = f"{city}_{sequence}_{frame}"
            images = root / "leftImg8bit" / split / city
            labels = root / "gtFine" / split / city
            images.mkdir(parents=True, exist_ok=True)
            labels.mkdir(parents=True, exist_ok=True)
            _rgb(rng).save(images / f"{stem}_leftImg8bit.png")
            ids = blocks(rng, CITYSCAPES_GT_IDS)
            ids[:BLOCK, :BLOCK], ids[:BLOCK, BLOCK:2 * BLOCK] = 7, 0
            path = labels / f"{stem}_gtFine_labelIds.png"
            Image.fromarray(ids).save(path)
            _rgb(rng).save(labels / f"{stem}_gtFine_color.png")
            written[str(path)] = ids
    return written


def vistas_labels(count: int = 66, void: tuple[int, ...] = (65,)) -> list[dict]:
    """A config ``labels`` list in Mapillary's format: v1.2 has 66 labels, the last
    ("Unlabeled") not evaluated."""
    return [{"color": [(37 * i) % 256, (91 * i + 50) % 256, (53 * i + 20) % 256],
             "instances": i % 2 == 0, "readable": f"Label {i}", "name": f"group--label-{i}",
             "evaluate": i not in void} for i in range(count)]


def write_vistas(root: Path, archive: str = "v1.2", labels: list[dict] | None = None,
                 seed: int = 0, per_split: int = 2) -> dict[str, np.ndarray]:
    """``config.json`` + ``training|validation/images/KEY.jpg`` + ``labels/KEY.png`` (the
    v1.2 archive) or ``config_v1.2.json`` + ``.../v1.2/labels/KEY.png`` (v2.0); labels are
    palette PNGs of label indices in the config's colours. Returns ``{label path: ids}``."""
    labels = vistas_labels() if labels is None else labels
    rng = np.random.default_rng(seed)
    config = "config.json" if archive == "v1.2" else "config_v1.2.json"
    label_folder = "labels" if archive == "v1.2" else "v1.2/labels"
    root.mkdir(parents=True, exist_ok=True)
    (root / config).write_text(json.dumps({"labels": labels, "version": 1.2,
                                           "mapping": "public"}, indent=2))
    colours = [tuple(label["color"]) for label in labels]
    written = {}
    for split in ("training", "validation"):
        (root / split / "images").mkdir(parents=True)
        (root / split / label_folder).mkdir(parents=True)
        for _ in range(per_split):
            key = "".join(rng.choice(list(string.ascii_letters + string.digits + "-_"), 22))
            _rgb(rng).save(root / split / "images" / f"{key}.jpg", quality=95)
            ids = blocks(rng, list(range(len(labels))))
            path = root / split / label_folder / f"{key}.png"
            _palette_png(ids, colours).save(path)
            written[str(path)] = ids
    return written


def voc_colours() -> list[tuple[int, int, int]]:
    """VOClabelcolormap.m of the VOC devkit, written out again for the tests."""
    colours = []
    for index in range(256):
        r = g = b = 0
        for bit in range(8):
            r |= ((index >> (3 * bit)) & 1) << (7 - bit)
            g |= ((index >> (3 * bit + 1)) & 1) << (7 - bit)
            b |= ((index >> (3 * bit + 2)) & 1) << (7 - bit)
        colours.append((r, g, b))
    return colours


def write_voc(root: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """``VOCdevkit/VOC2012`` with ``JPEGImages``, ``SegmentationClass`` (palette PNGs: class
    indices 0-20, 255 on the borders between blocks, as VOC marks object outlines) and
    ``ImageSets/Segmentation/{train,val,trainval}.txt``, plus one JPEG that no segmentation
    list names (VOC has many more images than segmentations). Returns ``{label path: ids}``."""
    rng = np.random.default_rng(seed)
    base = root / "VOCdevkit" / "VOC2012"
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (base / folder).mkdir(parents=True, exist_ok=True)
    written = {}
    for split, names in VOC_NAMES.items():
        for name in names:
            _rgb(rng).save(base / "JPEGImages" / f"{name}.jpg", quality=95)
            ids = blocks(rng, list(range(21)))
            border = np.zeros_like(ids, dtype=bool)
            border[:, 1:] |= ids[:, 1:] != ids[:, :-1]
            border[1:, :] |= ids[1:, :] != ids[:-1, :]
            ids[border] = 255
            path = base / "SegmentationClass" / f"{name}.png"
            _palette_png(ids, voc_colours()).save(path)
            written[str(path)] = ids
        (base / "ImageSets" / "Segmentation" / f"{split}.txt").write_text(
            "".join(f"{name}\n" for name in names))
    (base / "ImageSets" / "Segmentation" / "trainval.txt").write_text(
        "".join(f"{name}\n" for names in VOC_NAMES.values() for name in names))
    _rgb(rng).save(base / "JPEGImages" / "2007_000027.jpg")
    return written
