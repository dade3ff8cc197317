"""``iabn segment``: semantic segmentation of a folder of images with a DeepLabV3 model.

Reads every .png/.jpg/.jpeg of ``IN_DIR`` (``--recursive`` for subfolders), resizes it so its
longer side is ``--long-side`` pixels (default: the resolution the model was trained and
validated at, :func:`snapshot_long_side`), normalises it, runs the model at the ``--scales``
(and mirrored with ``--flip``), fuses the per-scale predictions (``mean`` of probabilities,
their elementwise ``max``, or ``voting`` of per-scale argmaxes) and writes, at the input's own
size (nearest neighbour), a palette PNG, a raw class-index PNG, class indices plus a
confidence PNG, or the dataset's own label ids (``labelids``: e.g. Cityscapes ``labelIds``, what
its official evaluation reads) (``--output``). Colours and label ids come from the dataset's
:class:`~iabn.tools.data.label_sets.LabelSet` (``--palette``; by default the one an ``iabn
train-seg`` snapshot stores, else the VOC colour map). Each file is written to a temporary
name, flushed and renamed, and existing outputs are kept unless ``--overwrite``, so an
interrupted run resumes. Output paths that would lose data (OUT_DIR is IN_DIR or contains it,
an output is an input, an output lands where IN_DIR is read) are refused before the snapshot
or any image is read (:func:`prepare`); with ``--recursive`` an OUT_DIR inside IN_DIR is left
out of the walk. Unreadable images are reported and skipped; the exit status is 1 when any
image failed.

Snapshots: the original package's Vistas file (``{"state_dict": {"body", "head", "cls"}}``,
loaded with :func:`iabn.models.load_original`), an iabn file holding a
:class:`~iabn.models.SegmentationNet` ``state_dict`` (keys ``body.*``, ``head.*``, ``cls.*``),
or an ``iabn train-seg`` snapshot (its network and input normalisation are rebuilt from the
config stored in it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models import deeplabv3_wider_resnet38, load_original
from ..models.checkpoints import read_checkpoint
from .arguments import PALETTES
from .data.label_sets import LabelSet, voc_colormap
from .outputs import check_output_folder, write_atomic
from .training.snapshot import FORMAT, WEIGHT_KEYS, SnapshotError, require_keys

EXTENSIONS = (".png", ".jpg", ".jpeg")
#: Input normalisation of the released Vistas model (RGB in [0, 1]).
VISTAS_MEAN = (0.41738699, 0.45732192, 0.46886091)
VISTAS_STD = (0.25685097, 0.26509955, 0.29067996)
#: ``--long-side`` for snapshots that do not say their resolution (the released Vistas model's).
VISTAS_LONG_SIDE = 2048


def _pil():
    try:
        from PIL import Image
    except ImportError as error:  # an optional dependency: say how to get it
        raise ImportError(
            "iabn segment reads and writes images with Pillow: pip install 'iabn[tools]'"
        ) from error
    return Image


@dataclass
class SegmentOptions:
    long_side: int = 2048
    scales: tuple[float, ...] = (1.0,)
    flip: bool = False
    fusion: str = "mean"
    output: str = "palette"
    overlay: bool = False
    overwrite: bool = False
    recursive: bool = False
    mean: tuple[float, float, float] = VISTAS_MEAN
    std: tuple[float, float, float] = VISTAS_STD
    labels: LabelSet | None = None
    """Colours and label ids of the classes; None: the VOC colour map, no label ids."""


@dataclass
class Summary:
    processed: int = 0
    skipped: int = 0
    failed: list[tuple[Path, str]] = field(default_factory=list)


def read_snapshot(snapshot: str | Path) -> Any:
    """The snapshot file's contents (tensors on CPU); ValueError naming an unreadable file."""
    return read_checkpoint(snapshot, "snapshot")  # CheckpointError is a ValueError


def _is_train_seg(data: Any) -> bool:
    return isinstance(data, dict) and data.get("task") == "segmentation" and "config" in data


def check_training_snapshot(data: Any, path: str | Path) -> None:
    """A file marked as an iabn training snapshot (its ``format`` entry, or a ``task`` of
    ``segmentation``) must hold what segmenting reads, ``task``, ``model`` and ``config``, and
    be a segmentation one: :class:`SnapshotError` (a ValueError) in one line otherwise."""
    if not isinstance(data, dict) or not (data.get("format") == FORMAT
                                          or data.get("task") == "segmentation"):
        return
    require_keys(data, path, ("task", *WEIGHT_KEYS), "iabn segment", dicts=WEIGHT_KEYS)
    if data["task"] != "segmentation":
        raise SnapshotError(f"snapshot {path} is from an iabn {data['task']!r} run: iabn "
                            f"segment reads the snapshots of iabn train-seg")


def load_segmentation_model(snapshot: str | Path, depth: int = 38,
                            device: str | torch.device = "cpu",
                            data: Any = None) -> torch.nn.Module:
    """Build the DeepLabV3 + WideResNet-A2 network a snapshot was saved from and load it.
    ``data``: the file's contents when already read (:func:`read_snapshot`); ``snapshot``
    then only names it in messages."""
    path = Path(snapshot)
    if data is None:
        data = read_snapshot(path)
    check_training_snapshot(data, path)
    if _is_train_seg(data):
        return _train_seg_model(data, path).to(device).eval()
    state = data.get("state_dict", data) if isinstance(data, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"snapshot {path} holds no state_dict")
    if {"body", "head", "cls"} <= set(state):
        num_classes = state["cls"]["weight"].shape[0]
        model = deeplabv3_wider_resnet38(num_classes=num_classes, depth=depth)
        for section in ("body", "head", "cls"):
            load_original(getattr(model, section), data, section=section)
    else:
        state = {k.removeprefix("module."): v for k, v in state.items()}
        if "cls.weight" not in state:
            raise ValueError(f"snapshot {path}: neither the original Vistas layout nor an iabn "
                             f"segmentation state_dict (no 'cls.weight')")
        model = deeplabv3_wider_resnet38(num_classes=state["cls.weight"].shape[0], depth=depth)
        result = model.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(f"snapshot {path} does not fit the model: missing "
                             f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return model.to(device).eval()


def _train_seg_model(data: dict[str, Any], path: Path) -> torch.nn.Module:
    """The network of an ``iabn train-seg`` snapshot, rebuilt from the config stored in it."""
    from .training.segmentation import build_segmenter

    state = data["model"]
    if "cls.weight" not in state:
        raise ValueError(f"snapshot {path}: an iabn train-seg file without 'cls.weight'")
    model = build_segmenter(data["config"], state["cls.weight"].shape[0], distributed=False)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(f"snapshot {path} does not fit its own config: missing "
                         f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}")
    return model


def snapshot_normalisation(data: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The input mean and std a snapshot (its contents, :func:`read_snapshot`) expects: an
    ``iabn train-seg`` snapshot's training normalisation, else the released Vistas model's."""
    if _is_train_seg(data):
        from .training.segmentation import SegmentationTask

        mean, std = SegmentationTask().normalisation(data["config"])
        return tuple(mean), tuple(std)
    return VISTAS_MEAN, VISTAS_STD


def snapshot_long_side(data: Any) -> tuple[int, str]:
    """The default ``--long-side`` for a snapshot (its contents, :func:`read_snapshot`) and
    where it comes from: an ``iabn train-seg`` snapshot's validation resolution
    (``input.long_side_val``; the canvas side for the embedded digits; else 0, the images as
    they are, as its validation ran), else the released Vistas model's 2048."""
    if _is_train_seg(data):
        config = data["config"]
        long_side = config.get("input", {}).get("long_side_val")
        if long_side:
            return int(long_side), "the snapshot's input.long_side_val"
        section = config.get("data", {})
        if section.get("dataset") == "digits" or (section.get("dataset", "auto") == "auto"
                                                  and section.get("root") is None):
            return int(section.get("canvas_size", 64)), "the snapshot's canvas size"
        return 0, "the snapshot validated at the images' own size"
    return VISTAS_LONG_SIDE, "the Vistas model's"


def find_images(root: Path, recursive: bool, exclude: Path | None = None) -> list[Path]:
    """The images under ``root`` (its subfolders too when ``recursive``; symbolic links to
    folders are not followed), sorted, leaving out the folder ``exclude`` (the output folder
    where it lies inside ``root``)."""
    if not recursive:
        candidates = list(root.iterdir())
    else:
        excluded = _stat(exclude) if exclude is not None else None
        candidates = []

        def unreadable(error: OSError) -> None:  # os.walk would skip the folder silently
            raise error

        for folder, subfolders, files in os.walk(root, onerror=unreadable):
            if excluded is not None:  # pruned in place: os.walk does not descend into them
                subfolders[:] = [name for name in subfolders
                                 if not _same(_stat(Path(folder, name)), excluded)]
            candidates.extend(Path(folder, name) for name in files)
    return sorted(p for p in candidates if p.suffix.lower() in EXTENSIONS and p.is_file())


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def _same(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    return a is not None and b is not None and os.path.samestat(a, b)


def _inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or lies under it, however either is spelled: relative or
    absolute, with ``..``, through symbolic links, or another mount of the same folder
    (compared by device and inode where the folders exist)."""
    target, base = path.resolve(), folder.resolve()
    if target == base or base in target.parents:
        return True
    base_stat = _stat(folder)
    return base_stat is not None and any(_same(_stat(candidate), base_stat)
                                         for candidate in (target, *target.parents))


def palette() -> list[int]:
    """A fixed, well-spread RGB colour for each of 256 classes (bit-interleaving, the PASCAL
    VOC scheme), flattened as PIL's ``putpalette`` wants it."""
    return [value for colour in voc_colormap(256) for value in colour]


PALETTE = palette()


@torch.no_grad()
def predict(
    model: torch.nn.Module, image: Tensor, options: SegmentOptions
) -> tuple[Tensor, Tensor]:
    """Class indices ``(H, W)`` and confidence ``(H, W)`` for a normalised ``(3, H, W)`` image."""
    height, width = image.shape[-2:]
    x = image.unsqueeze(0)
    probabilities, votes = [], []
    for scale in options.scales:
        scaled = x if scale == 1.0 else F.interpolate(
            x, scale_factor=scale, mode="bilinear", align_corners=False)
        views = [scaled, scaled.flip(-1)] if options.flip else [scaled]
        for index, view in enumerate(views):
            logits = model(view)
            if index == 1:
                logits = logits.flip(-1)
            logits = F.interpolate(logits, size=(height, width), mode="bilinear",
                                   align_corners=False)
            probs = logits.softmax(1)[0]
            probabilities.append(probs)
            votes.append(probs.argmax(0))
    stacked = torch.stack(probabilities)
    fused = stacked.max(0).values if options.fusion == "max" else stacked.mean(0)
    if options.fusion == "voting":
        counts = F.one_hot(torch.stack(votes), fused.shape[0]).sum(0).permute(2, 0, 1)
        # ties go to the class with the higher mean probability
        labels = (counts.to(fused.dtype) + fused / (fused.max() + 1)).argmax(0)
    else:
        labels = fused.argmax(0)
    return labels, fused.gather(0, labels.unsqueeze(0))[0]


def _outputs_for(relative: Path, out_dir: Path, options: SegmentOptions,
                 keep_suffix: bool = False) -> list[Path]:
    base = out_dir / relative.with_suffix("")
    if keep_suffix:  # x.jpg -> x_jpg.png when x.png is there too
        base = base.with_name(f"{base.name}_{relative.suffix[1:]}")
    paths = [base.with_suffix(".png")]
    if options.output == "prob":
        paths.append(base.parent / f"{base.name}_confidence.png")
    if options.overlay:
        paths.append(base.parent / f"{base.name}_overlay.png")
    return paths


class SegmentError(ValueError):
    """A user error found before any image is read or written (the command exits 2)."""


class OutputClash(SegmentError):
    """Two inputs whose outputs would have the same name."""


class SegmentWriteError(OSError):
    """An output could not be written (a full disk, a lost permission); the outputs written
    before it are complete and kept."""


@dataclass
class Plan:
    """What :func:`prepare` found: the images, the output files of each, and the output
    folder left out of the walk (None unless it lies inside a recursively read IN_DIR)."""

    images: list[Path]
    outputs: dict[Path, list[Path]]
    excluded: Path | None = None


def plan_outputs(images: list[Path], in_dir: Path, out_dir: Path,
                 options: SegmentOptions) -> dict[Path, list[Path]]:
    """The output files of each image. Inputs that differ only in their extension (``x.jpg``
    and ``x.png``) keep it in their outputs' names (``x_jpg.png``, ``x_png.png``); any other
    clash between outputs raises :class:`OutputClash` naming the inputs, before anything is
    written."""
    stems: dict[Path, int] = {}
    for path in images:
        stem = path.relative_to(in_dir).with_suffix("")
        stems[stem] = stems.get(stem, 0) + 1
    plan, owners = {}, {}
    for path in images:
        relative = path.relative_to(in_dir)
        targets = _outputs_for(relative, out_dir, options,
                               keep_suffix=stems[relative.with_suffix("")] > 1)
        for target in targets:
            if target in owners:
                raise OutputClash(f"{owners[target]} and {relative} would both be written to "
                                 f"{target}: rename one of them")
            owners[target] = relative
        plan[path] = targets
    return plan


def prepare(in_dir: Path, out_dir: Path, options: SegmentOptions,
            other_inputs: Sequence[Path] = ()) -> Plan:
    """Find the images and plan their outputs, refusing (:class:`SegmentError`) anything
    that would lose data, before any image is read or written: ``out_dir`` is ``in_dir``;
    an output is an input (the same file, by any path or a hard link) or any of
    ``other_inputs`` (the snapshot, the palette file); an output lands where this or a later
    run reads images (inside ``in_dir``: with ``--recursive`` an ``out_dir`` inside it is left
    out of the walk instead, :attr:`Plan.excluded`); an output is an existing folder or
    other non-file, or its folder cannot be made; no images at all."""
    if _inside(in_dir, out_dir):
        if _inside(out_dir, in_dir):
            raise SegmentError(f"OUT_DIR {out_dir} is IN_DIR {in_dir}: the outputs would "
                               f"replace the images or be read as images; choose another "
                               f"OUT_DIR")
        # outputs would mix with the folders around the inputs (and replace what is there)
        raise SegmentError(f"OUT_DIR {out_dir} contains IN_DIR {in_dir}; choose an OUT_DIR "
                           f"outside IN_DIR")
    excluded = out_dir if options.recursive and _inside(out_dir, in_dir) else None
    images = find_images(in_dir, options.recursive, excluded)
    if not images:
        text = (f"no images in IN_DIR {in_dir}"
                + (f" outside OUT_DIR {out_dir}" if excluded is not None else "")
                + f": iabn segment reads {', '.join(EXTENSIONS)} files (any case)")
        below = [] if options.recursive else find_images(in_dir, True, out_dir)
        if below:
            text += f"; its subfolders hold {len(below)}: add --recursive"
        raise SegmentError(text)
    plan = Plan(images, plan_outputs(images, in_dir, out_dir, options), excluded)
    _check_outputs(plan, in_dir, options.recursive, [*images, *other_inputs])
    return plan


def _check_outputs(plan: Plan, in_dir: Path, recursive: bool, inputs: Sequence[Path]) -> None:
    """The output checks of :func:`prepare`."""
    owners = {}
    for path in inputs:
        info = _stat(path)
        if info is not None:
            owners[(info.st_dev, info.st_ino)] = path
    folders: dict[Path, None] = {}
    for image, targets in plan.outputs.items():
        for target in targets:
            folders[target.parent] = None
            if not (target.exists() or target.is_symlink()):
                continue
            if not target.is_file():
                raise SegmentError(f"output {target} exists and is not a file; move it away "
                                   f"or choose another OUT_DIR")
            info = target.stat()
            owner = owners.get((info.st_dev, info.st_ino))
            if owner is not None:
                raise SegmentError(f"output {target} of {image.name} is the input {owner} "
                                   f"(the same file); choose another OUT_DIR")
    for folder in folders:
        read = (_inside(folder, in_dir) and not (plan.excluded is not None
                                                 and _inside(folder, plan.excluded))
                if recursive else _same(_stat(folder), _stat(in_dir)))
        if read:
            raise SegmentError(f"outputs in {folder} would be read as images (it is in IN_DIR "
                               f"{in_dir}); choose an OUT_DIR outside IN_DIR")
        probe = folder
        while not (probe.exists() or probe.is_symlink()) and probe.parent != probe:
            probe = probe.parent
        if not probe.is_dir():
            raise SegmentError(f"cannot make the output folder {folder}: {probe} is a file, "
                               f"not a folder")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise SegmentError(f"cannot write in the output folder {folder}: no permission "
                               f"to write in {probe}")


def _save_atomic(image: Any, path: Path) -> None:
    """Save a PIL image as PNG through a temporary file and a rename: an interrupted run
    leaves no truncated PNG that the next run would take for done."""
    write_atomic(path, lambda stream: image.save(stream, format="PNG"))


def segment_folder(model: torch.nn.Module, in_dir: Path, out_dir: Path,
                   options: SegmentOptions, device: str | torch.device = "cpu",
                   progress: bool = True, plan: Plan | None = None) -> Summary:
    """Segment the images of ``in_dir`` into ``out_dir`` (``plan``: :func:`prepare`'s, made
    here when not given). Raises :class:`SegmentError` before any work, and
    :class:`SegmentWriteError` when an output cannot be written."""
    Image = _pil()
    colours = options.labels.palette() if options.labels is not None else PALETTE
    if options.output == "labelids" and options.labels is None:
        raise ValueError("--output labelids needs the dataset's label ids: a train-seg "
                         "snapshot of Cityscapes, Vistas or VOC data, or --palette")
    if plan is None:
        plan = prepare(in_dir, out_dir, options)
    images = plan.images
    mean = torch.tensor(options.mean).view(3, 1, 1)
    std = torch.tensor(options.std).view(3, 1, 1)
    summary = Summary()
    for number, path in enumerate(images, 1):
        relative = path.relative_to(in_dir)
        targets = plan.outputs[path]
        if not options.overwrite and all(t.exists() for t in targets):
            summary.skipped += 1
            continue
        if progress:
            print(f"[{number}/{len(images)}] {relative}", file=sys.stderr, flush=True)
        try:
            original = _read_rgb(Image, path)
        except Exception as error:  # unreadable or corrupt: report, go on with the others
            summary.failed.append((path, f"{type(error).__name__}: {error}"))
            print(f"  skipped: cannot read {path}: {error}", file=sys.stderr, flush=True)
            continue
        resized = original
        if options.long_side:
            factor = options.long_side / max(original.size)
            size = (max(1, int(original.width * factor)), max(1, int(original.height * factor)))
            resized = original.resize(size, Image.BILINEAR)
        pixels = torch.frombuffer(bytearray(resized.tobytes()), dtype=torch.uint8)
        tensor = pixels.view(resized.height, resized.width, 3).permute(2, 0, 1).float() / 255
        labels, confidence = predict(model, ((tensor - mean) / std).to(device), options)
        try:
            _write_outputs(Image, original, labels, confidence, targets, options, colours)
        except OSError as error:
            raise SegmentWriteError(
                f"cannot write the outputs of {relative} in {targets[0].parent}: "
                f"{error.strerror or error}; {summary.processed} images segmented before "
                f"it are kept (run again to resume)") from error
        summary.processed += 1
    return summary


def _write_outputs(Image: Any, original: Any, labels: Tensor, confidence: Tensor,
                   targets: list[Path], options: SegmentOptions, colours: list[int]) -> None:
    """One image's output files (see :func:`_outputs_for`), each written atomically."""
    label_image = _grey_image(Image, labels.to(torch.uint8)).resize(original.size,
                                                                   Image.NEAREST)
    targets[0].parent.mkdir(parents=True, exist_ok=True)
    if options.output == "palette":
        coloured = label_image.convert("P")
        coloured.putpalette(colours)
        _save_atomic(coloured, targets[0])
    elif options.output == "labelids":
        assert options.labels is not None  # checked by segment_folder
        ids = options.labels.to_label_ids(labels).to(torch.uint8)
        _save_atomic(_grey_image(Image, ids).resize(original.size, Image.NEAREST), targets[0])
    else:
        _save_atomic(label_image, targets[0])
    if options.output == "prob":
        scaled = (confidence.clamp(0, 1) * 255).round().to(torch.uint8)
        _save_atomic(_grey_image(Image, scaled).resize(original.size, Image.BILINEAR),
                     targets[1])
    if options.overlay:
        mask = label_image.convert("P")
        mask.putpalette(colours)
        blend = Image.blend(original, mask.convert("RGB"), 0.5)
        side = Image.new("RGB", (original.width * 2, original.height))
        side.paste(original, (0, 0))
        side.paste(blend, (original.width, 0))
        _save_atomic(side, targets[-1])


def _read_rgb(Image: Any, path: Path) -> Any:
    """An image file as a PIL RGB image, decoded as the training data is
    (:func:`iabn.tools.data.imagefolder.read_rgb`): 16-bit PNGs scaled to 8 bits, where Pillow's
    ``convert("RGB")`` clips them (white)."""
    from .data.imagefolder import read_rgb

    pixels = read_rgb(path)
    height, width = pixels.shape[-2:]
    return Image.frombytes("RGB", (width, height),
                           pixels.permute(1, 2, 0).contiguous().numpy().tobytes())


def _grey_image(Image: Any, values: Tensor) -> Any:
    """A mode-L PIL image from a ``(H, W)`` uint8 tensor (without requiring NumPy)."""
    height, width = values.shape
    return Image.frombytes("L", (width, height), bytes(values.cpu().flatten().tolist()))


def run(args: Any) -> int:
    """The ``iabn segment`` command (arguments from :mod:`iabn.tools.cli`)."""
    start = time.perf_counter()

    def fail(text: object) -> int:
        print(f"iabn segment: error: {text}", file=sys.stderr)
        return 2

    in_dir = Path(args.in_dir)
    if not in_dir.is_dir():
        return fail(f"IN_DIR {in_dir} is not a folder")
    options = SegmentOptions(output=args.output, overlay=args.overlay,
                             overwrite=args.overwrite, recursive=args.recursive)
    palette_file = Path(getattr(args, "palette", "auto"))
    try:
        _pil()  # a missing Pillow is said before any work
        _check_device(args.device)
        out_dir = check_output_folder(args.out_dir, "OUT_DIR")
        # every output path is checked before the snapshot (~0.5 GB) or an image is read
        plan = prepare(in_dir, out_dir, options,
                       [Path(args.snapshot), *([palette_file] if palette_file.is_file() else [])])
        data = read_snapshot(args.snapshot)  # read once: a Vistas file is ~0.5 GB
        model = load_segmentation_model(args.snapshot, args.depth, args.device, data)
        labels = label_set(getattr(args, "palette", "auto"), data)
        _check_labels(labels, model, args.output)
    except (ValueError, KeyError, ImportError) as error:  # DataLayoutError is a ValueError
        return fail(error)
    except OSError as error:  # an unreadable input folder
        return fail(f"cannot read {error.filename or in_dir}: {error.strerror or error}")
    if plan.excluded is not None:  # said even with --quiet: it changes what is read
        print(f"iabn segment: OUT_DIR {out_dir} is inside IN_DIR {in_dir}: its files are "
              f"not read as inputs", file=sys.stderr, flush=True)
    long_side, source = snapshot_long_side(data)
    if args.long_side is not None:
        long_side, source = args.long_side, "--long-side"
    if not args.quiet:
        print(f"iabn segment: long side {long_side or 'as stored'} ({source})",
              file=sys.stderr, flush=True)
    options = replace(options, long_side=long_side, scales=tuple(args.scales), flip=args.flip,
                      fusion=args.fusion, labels=labels, **_normalisation(args, data))
    try:
        summary = segment_folder(model, in_dir, out_dir, options, args.device,
                                 progress=not args.quiet, plan=plan)
    except SegmentWriteError as error:
        return fail(error)
    print(f"iabn segment: {summary.processed} segmented, {summary.skipped} already done "
          f"(kept; --overwrite to redo), {len(summary.failed)} failed, "
          f"{time.perf_counter() - start:.1f} s")
    for path, reason in summary.failed:
        print(f"  failed: {path}: {reason}")
    return 1 if summary.failed else 0


def label_set(choice: str, data: Any = None) -> LabelSet | None:
    """The classes ``--palette`` names: ``auto``: those an ``iabn train-seg`` snapshot
    (``data``, its contents) stores, else None; ``default``: None (the VOC colour map, no
    label ids); ``cityscapes``, ``voc``; any other value is a Mapillary Vistas config file, or
    the dataset folder holding it. Errors (ValueError) name the file."""
    if choice == "auto":
        stored = data.get("dataset") if _is_train_seg(data) else None
        return LabelSet.from_dict(stored) if stored else None
    if choice == "default":
        return None
    from .data import label_sets

    if choice == "cityscapes":
        return label_sets.cityscapes_labels()
    if choice == "voc":
        return label_sets.voc_labels()
    path = Path(choice)
    if path.is_dir():
        from .data.seg_datasets import vistas_config

        path = vistas_config(path)[0]
    elif not path.is_file():
        raise ValueError(f"--palette {choice!r}: not one of {', '.join(PALETTES)}, nor a "
                         f"Mapillary Vistas config file or folder")
    return label_sets.vistas_labels(path)


def _check_labels(labels: LabelSet | None, model: torch.nn.Module, output: str) -> None:
    """The label set fits the model's classes, and exists where ``output`` needs it."""
    if labels is None:
        if output == "labelids":
            raise ValueError("--output labelids needs the dataset's label ids: give --palette "
                             "cityscapes|voc|VISTAS_CONFIG (a train-seg snapshot of such data "
                             "carries them)")
        return
    classes = model.cls.weight.shape[0] if hasattr(model, "cls") else None
    if classes is not None and classes != labels.num_classes:
        raise ValueError(f"the snapshot predicts {classes} classes but the {labels.name} "
                         f"palette has {labels.num_classes}: choose the --palette of the "
                         f"data the model was trained on")


def _normalisation(args: Any, data: Any) -> dict[str, tuple[float, ...]]:
    """``--mean``/``--std`` where given, else what the snapshot was trained with."""
    mean, std = snapshot_normalisation(data)
    return {"mean": tuple(args.mean) if args.mean is not None else mean,
            "std": tuple(args.std) if args.std is not None else std}


def _check_device(text: str) -> None:
    """ValueError unless ``--device`` names a device this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r}: not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: no CUDA device is available here; use --device cpu")
    try:  # cuda:7 on a machine with one GPU, a backend this build lacks
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"--device {text}: not usable here ({first}); use --device cpu"
                         ) from None


__all__ = ["OutputClash", "Plan", "SegmentError", "SegmentOptions", "SegmentWriteError",
           "check_training_snapshot", "label_set", "load_segmentation_model", "predict",
           "prepare", "read_snapshot", "run", "segment_folder", "snapshot_long_side",
           "snapshot_normalisation"]
