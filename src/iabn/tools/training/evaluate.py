"""``iabn test``: top-1/top-5 of a checkpoint on the validation images, single or ten crops,
in one process or under ``torchrun`` (every image counted once).

The model is built from the given config, so weights can move between compatible networks:
``bn``/``abn``/``iabn``/``iabn_sync`` share ``nn.BatchNorm2d``'s keys and activations have no
weights, so e.g. a ReLU-trained snapshot can be evaluated with LeakyReLU. Accepted files: an
``iabn train`` snapshot (its ``model``), a plain ``state_dict`` (``module.`` prefixes dropped,
optionally under a ``"state_dict"`` key), or with ``original=True`` a checkpoint of the original
``inplace_abn`` package (:func:`iabn.models.load_original`, ``|gamma| + eps`` semantics).
Missing, unexpected and mis-shaped keys are listed; unless ``strict=False`` any of them stops
the evaluation before it starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ...models import LoadReport, load_original
from ...models.checkpoints import (
    CheckpointError,
    abs_into_signed,
    abs_into_signed_note,
    read_checkpoint,
)
from ..bench import write_text_atomic
from ..data.samplers import ExactShardSampler
from ..data.transforms import TransformedDataset
from .classification import ClassificationTask, build_classifier
from .classification_data import eval_transform, image_sources
from .config import Config, ConfigError, differences
from .loops import evaluate, memory_format
from .progress import ProgressLine
from .ranks import Ranks, finish, start
from .snapshot import FORMAT, WEIGHT_KEYS, SnapshotError, not_a_file, one_line, require_keys


@dataclass
class TestOptions:
    """The ``iabn test`` arguments besides the config."""

    checkpoint: Path
    scale: int | None = None
    """Shorter side before cropping; None: ``input.scale_val``."""
    crop: int | None = None
    """Crop side; None: ``input.crop_val``."""
    ten_crops: bool = False
    original: bool = False
    origin: str = "auto"
    """With ``original``: the original layer type that trained the weights (``"InPlaceABN"``,
    ``"ABN"`` or ``"auto"``); see :func:`iabn.models.load_original`."""
    strict: bool = True
    device: str | None = None
    batch_size: int | None = None
    """Global batch of images (of 10 or 5 crops each with ``ten_crops``); None: the config's
    validation batch, divided by the crops per image."""
    workers: int | None = None
    progress: bool = True


def _read(path: Path) -> Any:
    problem = not_a_file(path, "checkpoint")
    if problem:
        raise SnapshotError(problem)
    try:
        return read_checkpoint(path)
    except CheckpointError as error:
        raise SnapshotError(one_line(str(error))) from error


def _origin_with_name(origin: str, path: Path) -> str:
    """``load_original`` got the loaded dict, not the path: apply its file-name rule here."""
    if origin == "auto" and "stdbn" in path.name.lower():
        return "ABN"
    return origin


def load_weights(model: nn.Module, path: Path, original: bool = False,
                 strict: bool = True, origin: str = "auto") -> tuple[LoadReport, Config | None]:
    """Load a checkpoint (module doc) into ``model``; returns the key report and, for an
    ``iabn train`` snapshot, the config it was trained with. With ``strict`` a report that is
    not clean raises :class:`SnapshotError` before the model is touched."""
    payload = _read(path)
    if original:
        try:
            return load_original(model, payload, strict=strict,
                                 origin=_origin_with_name(origin, path)), None
        except ValueError as error:
            raise SnapshotError(f"{path}: {error}; --non-strict loads the matching keys"
                                ) from None
    trained_config = None
    if isinstance(payload, dict) and payload.get("format") == FORMAT:
        require_keys(payload, path, WEIGHT_KEYS, "evaluating its weights", what="checkpoint",
                     dicts=WEIGHT_KEYS)
        state, trained_config = payload["model"], payload["config"]
    elif isinstance(payload, dict):
        state = payload.get("state_dict", payload)
    else:
        raise SnapshotError(f"{path} holds a {type(payload).__name__}, not a state_dict")
    abs_layers = abs_into_signed(state, model)
    state = {key.removeprefix("module."): value for key, value in state.items()
             if isinstance(value, torch.Tensor)}
    own = model.state_dict()
    report = LoadReport(
        missing=[k for k in own if k not in state and not k.endswith("num_batches_tracked")],
        unexpected=[k for k in state if k not in own],
        shape_mismatches=[f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}"
                          for k, v in own.items() if k in state and state[k].shape != v.shape])
    if abs_layers:
        report.warnings.append(abs_into_signed_note(abs_layers))
    if strict and not report.ok:
        raise SnapshotError(f"{path} does not fit the config's {type(model).__name__}: {report}"
                            f"; check network.arch, or pass --non-strict to load the matching "
                            f"keys only")
    usable = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(usable, strict=False)
    return report, trained_config


def _batch_size(config: Config, options: TestOptions, ranks: Ranks, views: int) -> int:
    data = config["data"]
    total = options.batch_size or data["val_batch_size"] or data["batch_size"]
    if options.batch_size is None:
        total = total // views
    return max(1, total // ranks.world_size)


def run_test(config: Config, options: TestOptions) -> dict[str, Any]:
    """Evaluate ``options.checkpoint`` with ``config``'s model and data; every rank calls it
    under ``torchrun``. Returns the metrics and settings (printed by rank 0)."""
    ranks = start(options.device)
    finished = False
    try:
        result = _run_test(config, options, ranks)
        finished = True
        return result
    finally:
        if finished:
            finish(ranks)
        elif torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run_test(config: Config, options: TestOptions, ranks: Ranks) -> dict[str, Any]:
    sources = image_sources(config["data"], with_train=False)
    wanted = config["network"]["num_classes"]
    if wanted is not None and wanted != sources.num_classes:
        # the labels are the data's: a classifier of another size could not be scored
        raise ConfigError(f"network.num_classes={wanted} but the data has "
                          f"{sources.num_classes} classes ({sources.description}): set it to "
                          f"{sources.num_classes} or null")
    transform = eval_transform(config["input"], options.scale, options.crop, options.ten_crops)
    model = build_classifier(config, sources.num_classes, ranks.distributed)
    report, trained_config = load_weights(model, options.checkpoint, options.original,
                                          options.strict, options.origin)
    network = config["network"]
    model.to(ranks.device, memory_format=memory_format(network["channels_last"]))
    say = print if ranks.is_main else (lambda *args, **kwargs: None)
    say(f"weights {options.checkpoint}: {report}")
    if trained_config is not None:
        # the class count is the data's either way (null means that), and the weights fit
        changed = differences({"network": trained_config["network"]}, {"network": network},
                              ignore=("network.num_classes",))
        if changed:
            say("evaluating with a different network than trained: " + "; ".join(changed))
    dataset = TransformedDataset(sources.val, transform)
    loader = DataLoader(dataset, batch_size=_batch_size(config, options, ranks, transform.views),
                        sampler=ExactShardSampler(len(dataset), ranks.world_size, ranks.rank),
                        num_workers=config["data"]["workers"] if options.workers is None
                        else options.workers,
                        pin_memory=ranks.device.type == "cuda")
    progress = ProgressLine(options.progress and ranks.is_main)
    metrics = evaluate(ClassificationTask(), model, loader, ranks, network["precision"],
                       network["channels_last"], progress, len(loader))
    views = "centre crop"
    if options.ten_crops:  # mirrored only for a model trained with flips (eval_transform)
        views = (f"{transform.views} crops (corners and centre"
                 + (", and their mirrors" if transform.mirror else
                    "; not mirrored: input.flip_train is false") + ")")
    say(f"top-1 {metrics['top1']:.2f}%  top-5 {metrics['top5']:.2f}%  loss "
        f"{metrics['loss']:.4f}  on {int(metrics['count'])} images ({views} {transform.crop} "
        f"of {transform.scale}; {sources.description})")
    return {"checkpoint": str(options.checkpoint), "metrics": metrics,
            "crop": transform.crop, "scale": transform.scale, "ten_crops": options.ten_crops,
            "crops_per_image": transform.views,
            "world_size": ranks.world_size,
            "load_report": {"missing": report.missing, "unexpected": report.unexpected,
                            "shape_mismatches": report.shape_mismatches}}


def write_json(result: dict[str, Any], path: Path) -> None:
    """The result as JSON, written atomically (the old file or the new one, never half)."""
    write_text_atomic(path, json.dumps(result, indent=2) + "\n")


__all__ = ["TestOptions", "load_weights", "run_test", "write_json"]
