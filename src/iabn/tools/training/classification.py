"""Image classification as a :class:`~iabn.tools.training.task.Task`: models from
:mod:`iabn.models`, ImageFolder or embedded-digits data, cross-entropy, top-1/top-5.

The model's outputs are log-probabilities: for ten-crop inputs ``[B, 10, 3, H, W]`` they are
the log of the crops' mean softmax, so the loss stays the negative log-likelihood.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...kernels.activations import ALL_ACTIVATIONS
from ...models import MODELS, NORM_ACT_NAMES, create
from ..data.transforms import TransformedDataset
from .classification_data import eval_transform, image_sources, train_transform
from .config import MAX_SEED, MAX_SIDE, Config, ConfigError, Option, Schema
from .networks import check_norm_act, norm_act_kwargs
from .ranks import Ranks
from .task import DataSplits

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]

SCHEMA: Schema = {
    "network": {
        "arch": Option("resnext101", "model name (iabn.models.MODELS)", str, tuple(MODELS)),
        "num_classes": Option(None, "classifier outputs; null: the number of classes in the "
                              "data (a value must match it)", int, nullable=True, minimum=1),
        "norm_act": Option("iabn", "norm + activation layer: bn (nn.BatchNorm2d + activation), "
                           "abn, iabn (InPlace-ABN), iabn_sync (synchronised over ranks)", str,
                           NORM_ACT_NAMES),
        "activation": Option("leaky_relu", "activation after each norm", str, ALL_ACTIVATIONS),
        "activation_param": Option(0.01, "leaky_relu slope / elu alpha", float),
    },
    "input": {
        "crop_train": Option(224, "training crop side (pixels)", int, minimum=1,
                             maximum=MAX_SIDE),
        "scale_train": Option(None, "null: random-resized crop; N: shorter side resized to N, "
                              "then a random crop_train square", int, nullable=True, minimum=1,
                              maximum=MAX_SIDE),
        "area_range_train": Option([0.08, 1.0], "random-resized crop: fraction of the image "
                                   "area", list, length=2),
        "ratio_range_train": Option([0.75, 4 / 3], "random-resized crop: aspect ratio (w/h)",
                                    list, length=2),
        "flip_train": Option(True, "random horizontal flips", bool),
        "color_jitter_train": Option(0.4, "brightness/contrast/saturation jitter strength; "
                                     "0: off", float, minimum=0.0),
        "lighting_train": Option(0.1, "AlexNet PCA lighting noise std; 0: off", float,
                                 minimum=0.0),
        "scale_val": Option(256, "validation: shorter side resized to this", int, minimum=1,
                            maximum=MAX_SIDE),
        "crop_val": Option(224, "validation: centre crop side", int, minimum=1,
                           maximum=MAX_SIDE),
        "mean": Option(IMAGENET_MEAN, "per-channel mean (RGB in [0, 1])", list, length=3),
        "std": Option(IMAGENET_STD, "per-channel std", list, length=3),
    },
    "data": {
        "root": Option(None, "ImageFolder root with train/ and val/ (the DATA_ROOT argument "
                       "overrides it); null: the embedded digits", str, nullable=True),
        "digits_size": Option(32, "embedded digits: side after upscaling the 8x8 scans", int,
                              minimum=8, maximum=MAX_SIDE),
        "digits_val_fraction": Option(0.2, "embedded digits: validation share per class",
                                      float),
        "digits_split_seed": Option(0, "embedded digits: seed of the train/val split", int,
                                    minimum=0, maximum=MAX_SEED),
    },
}


def _check_range(values: list[float], low: float, high: float, name: str, source: str) -> None:
    if not low < values[0] <= values[1] <= high:
        raise ConfigError(f"{source}: {name} must be [a, b] with {low} < a <= b <= {high}, got "
                          f"{values}")


class TopKMeter:
    """Sums ``[loss * n, top-1 hits, top-5 hits, n]`` of log-probability outputs."""

    def __init__(self, device: torch.device) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)

    def update(self, outputs: Tensor, targets: Tensor, loss: Tensor) -> None:
        k = min(5, outputs.shape[1])
        hits = outputs.topk(k, dim=1).indices == targets[:, None]
        batch = torch.stack([loss.double() * len(targets), hits[:, 0].sum().double(),
                             hits.sum().double(),
                             torch.tensor(float(len(targets)), dtype=torch.float64,
                                          device=targets.device)])
        self.sums += batch.to(self.sums.device)

    def summarize(self, sums: Tensor) -> dict[str, float]:
        loss_sum, top1, top5, count = sums.tolist()
        if count == 0:
            return {"loss": math.nan, "top1": math.nan, "top5": math.nan, "count": 0.0}
        return {"loss": loss_sum / count, "top1": 100.0 * top1 / count,
                "top5": 100.0 * top5 / count, "count": count}


def log_probabilities(model: nn.Module, inputs: Tensor) -> Tensor:
    """``[B, classes]`` log-probabilities; for ``[B, K, 3, H, W]`` inputs (K crops per
    image) the log of the mean of the K softmaxes."""
    if inputs.dim() == 4:
        return F.log_softmax(model(inputs).float(), dim=1)
    batch, crops = inputs.shape[:2]
    per_crop = F.log_softmax(model(inputs.flatten(0, 1)).float(), dim=1)
    return torch.logsumexp(per_crop.view(batch, crops, -1), dim=1) - math.log(crops)


class ClassificationTask:
    """The classification half of ``iabn train`` / ``iabn test`` (see module doc)."""

    name = "classification"
    schema = SCHEMA
    best_metric = "top1"

    def check_config(self, config: Config, source: str = "config") -> None:
        network, section = config["network"], config["input"]
        check_norm_act(network, source)
        if section["scale_train"] is not None and section["scale_train"] < section["crop_train"]:
            raise ConfigError(f"{source}: input.scale_train={section['scale_train']} is smaller "
                              f"than input.crop_train={section['crop_train']}")
        if section["crop_val"] > section["scale_val"]:
            raise ConfigError(f"{source}: input.crop_val={section['crop_val']} is larger than "
                              f"input.scale_val={section['scale_val']}")
        _check_range(section["area_range_train"], 0.0, 1.0, "input.area_range_train", source)
        _check_range(section["ratio_range_train"], 0.0, math.inf, "input.ratio_range_train",
                     source)
        if min(section["std"]) <= 0:
            raise ConfigError(f"{source}: input.std must be positive, got {section['std']}")
        if not 0.0 < config["data"]["digits_val_fraction"] < 1.0:
            raise ConfigError(f"{source}: data.digits_val_fraction must be in (0, 1)")

    def datasets(self, config: Config) -> DataSplits:
        sources = image_sources(config["data"])
        wanted = config["network"]["num_classes"]
        if wanted is not None and wanted != sources.num_classes:
            raise ConfigError(f"network.num_classes={wanted} but the data has "
                              f"{sources.num_classes} classes ({sources.description}): set it "
                              f"to {sources.num_classes} or null")
        return DataSplits(
            TransformedDataset(sources.train, train_transform(config["input"])),
            TransformedDataset(sources.val, eval_transform(config["input"])),
            sources.num_classes, sources.description)

    def build_model(self, config: Config, splits: DataSplits, ranks: Ranks) -> nn.Module:
        return build_classifier(config, splits.num_classes, ranks.distributed)

    def forward(self, model: nn.Module, inputs: Tensor) -> Tensor:
        return log_probabilities(model, inputs)

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return F.nll_loss(outputs, targets)

    def new_meter(self, device: torch.device) -> TopKMeter:
        return TopKMeter(device)


def build_classifier(config: Config, num_classes: int, distributed: bool) -> nn.Module:
    """The ``network`` section's model (``iabn_sync`` alone: see :func:`.norm_act_kwargs`)."""
    network: dict[str, Any] = config["network"]
    return create(network["arch"], num_classes=num_classes,
                  **norm_act_kwargs(network, distributed))


__all__ = ["SCHEMA", "ClassificationTask", "TopKMeter", "build_classifier", "log_probabilities"]
