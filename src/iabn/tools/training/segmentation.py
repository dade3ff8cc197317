"""Semantic segmentation as a :class:`~iabn.tools.training.task.Task` (``iabn train-seg``):
DeepLabV3 on a dilated WideResNet-A2 or ResNeXt trunk (output stride 8); data from Cityscapes,
Mapillary Vistas v1.2 or Pascal VOC 2012 as unpacked (:mod:`iabn.tools.data.seg_datasets`), images +
label PNGs, or the embedded digits-on-canvas set; online bootstrapped cross-entropy (the
hardest 25 % of each crop's pixels, the paper's setting), mIoU and per-class IoU.

The generic engine brings everything else (DDP, ``iabn_sync``, poly schedule, snapshots and
exact resume, logs); the paper's segmentation optimiser — SGD, momentum 0.9, weight decay
1e-4, poly decay with power 0.9 — is the defaults of ``configs/segmentation_*.json``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ...kernels.activations import ALL_ACTIVATIONS
from ...models import NORM_ACT_NAMES, DeepLabV3Head, SegmentationNet, deeplabv3_wider_resnet38
from ...models.preact import ResNeXt
from ..data.digits import IMAGE_SIZE as DIGIT_SIDE
from ..data.label_sets import LAYOUTS, PUBLISHED, LabelSet, identity_labels
from ..data.seg_datasets import detect_layout, layout_labels, open_dataset
from ..data.segmentation import (
    CANVAS_CLASSES,
    CANVAS_MEAN,
    CANVAS_STD,
    IGNORE_INDEX,
    DigitsCanvas,
    EvalTransform,
    SegmentationFolder,
    TrainTransform,
)
from ..losses import bootstrapped_cross_entropy
from ..metrics import ConfusionMatrix
from .config import MAX_SEED, MAX_SIDE, Config, ConfigError, Option, Schema
from .networks import check_norm_act, norm_act_kwargs
from .ranks import Ranks
from .task import DataSplits

#: The most canvases of the embedded data per split (each epoch draws a permutation of them).
MAX_CANVASES = 10**7

#: Trunks with an output-stride-8 (dilated) form: name -> (family, depth).
BODIES = {
    "wider_resnet16_a2": ("wider_resnet", 16), "wider_resnet20_a2": ("wider_resnet", 20),
    "wider_resnet38_a2": ("wider_resnet", 38), "resnext50": ("resnext", 50),
    "resnext101": ("resnext", 101), "resnext152": ("resnext", 152),
}

SCHEMA: Schema = {
    "network": {
        "body": Option("wider_resnet38_a2", "trunk, dilated to output stride 8", str,
                       tuple(BODIES)),
        "width": Option(1.0, "WideResNet trunks: channel multiplier (1.0: the paper's)", float,
                        minimum=0.0),
        "head_channels": Option(256, "DeepLabV3 head: channels per branch", int, minimum=1,
                                maximum=8192),
        "pooling_size": Option([84, 84], "eval-time image pooling window on the features "
                               "(the released model's 84x84); null: global", list,
                               nullable=True, length=2, minimum=1, maximum=MAX_SIDE),
        "num_classes": Option(None, "classes; null: the data's (digits canvases 11, "
                              "Cityscapes 19, Vistas v1.2 65, VOC 21; required for folder "
                              "data)", int, nullable=True, minimum=1),
        "norm_act": Option("iabn", "norm + activation layer: bn, abn, iabn, iabn_sync", str,
                           NORM_ACT_NAMES),
        "activation": Option("leaky_relu", "activation after each norm", str, ALL_ACTIVATIONS),
        "activation_param": Option(0.01, "leaky_relu slope / elu alpha", float),
    },
    "input": {
        "crop_train": Option(512, "training crop side (pixels)", int, minimum=8,
                             maximum=MAX_SIDE),
        "scale_range_train": Option([0.7, 2.0], "random scaling range of training images",
                                    list, length=2),
        "flip_train": Option(True, "random horizontal flips", bool),
        "class_uniform_train": Option(0.0, "share of crops centred on a pixel of a class "
                                      "drawn uniformly among those present", float,
                                      minimum=0.0),
        "long_side_val": Option(None, "validation: resize so the long side is this; null: "
                                "as stored", int, nullable=True, minimum=8, maximum=MAX_SIDE),
        "mean": Option(None, "per-channel mean (RGB in [0, 1]); null: the digits canvases' "
                       "for the embedded data, else ImageNet's", list, nullable=True, length=3),
        "std": Option(None, "per-channel std; null as mean", list, nullable=True, length=3),
    },
    "data": {
        "dataset": Option("auto", "data layout: cityscapes, vistas (v1.2), voc (2012), "
                          "folder (train|val/images + labels), digits (embedded, no root); "
                          "auto: told from data.root's folders, digits without a root "
                          "(--dataset overrides it)", str, LAYOUTS),
        "root": Option(None, "the dataset's folder as unpacked (DATA_ROOT / --data-root "
                       "override it); null: the embedded digits canvases", str,
                       nullable=True),
        "ignore_index": Option(IGNORE_INDEX, "label value of void pixels (label PNGs hold 8 "
                               "or 16 bits)", int, minimum=0, maximum=2**16 - 1),
        "canvas_size": Option(64, "embedded data: canvas side", int, minimum=40,
                              maximum=MAX_SIDE),
        "canvas_train": Option(2000, "embedded data: training canvases", int, minimum=1,
                               maximum=MAX_CANVASES),
        "canvas_val": Option(300, "embedded data: validation canvases", int, minimum=1,
                             maximum=MAX_CANVASES),
        "canvas_seed": Option(0, "embedded data: seed of the canvases and digit split", int,
                              minimum=0, maximum=MAX_SEED),
        "canvas_digit_scale": Option([3.0, 5.0], "embedded data: digits are upscaled from "
                                     "8x8 by a random factor in this range", list, length=2,
                                     minimum=1.0),
        "canvas_max_digits": Option(4, "embedded data: at most this many digits per canvas",
                                    int, minimum=1, maximum=100),
    },
    "loss": {
        "top_fraction": Option(0.25, "bootstrapped cross-entropy: share of each crop's valid "
                               "pixels (the hardest) that count; 1: plain cross-entropy",
                               float, minimum=0.0),
    },
}

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class SegmentationMeter:
    """Sums ``[loss * images, images, confusion matrix (row-major)]`` in float64."""

    def __init__(self, num_classes: int, ignore_index: int, device: torch.device,
                 class_names: tuple[str, ...]) -> None:
        self.matrix = ConfusionMatrix(num_classes, ignore_index, device)
        self.class_names = class_names
        self.sums = torch.zeros(2 + num_classes**2, dtype=torch.float64, device=device)

    def update(self, outputs: Tensor, targets: Tensor, loss: Tensor) -> None:
        self.matrix.reset()
        self.matrix.update(outputs, targets)
        images = float(len(targets))
        self.sums[0] += loss.double().to(self.sums.device) * images
        self.sums[1] += images
        self.sums[2:] += self.matrix.matrix.flatten().to(self.sums)

    def summarize(self, sums: Tensor) -> dict[str, float]:
        """loss, mIoU and pixel accuracy in %, the image count, and ``iou/<class>`` in %."""
        classes = self.matrix.num_classes
        total = ConfusionMatrix(classes, self.matrix.ignore_index, sums.device)
        total.matrix.copy_(sums[2:].view(classes, classes).round().long())
        images = float(sums[1])
        metrics = {"loss": float(sums[0]) / images if images else float("nan"),
                   "miou": 100.0 * total.mean_iou(),
                   "pixel_accuracy": 100.0 * total.pixel_accuracy(), "count": images}
        for name, value in zip(self.class_names, total.iou().tolist(), strict=True):
            metrics[f"iou/{name}"] = 100.0 * value
        return metrics


class SegmentationTask:
    """The segmentation half of ``iabn train-seg`` (see module doc)."""

    name = "segmentation"
    schema = SCHEMA
    best_metric = "miou"

    def check_config(self, config: Config, source: str = "config") -> None:
        network, section = config["network"], config["input"]
        check_norm_act(network, source)
        if BODIES[network["body"]][0] != "wider_resnet" and network["width"] != 1.0:
            raise ConfigError(f"{source}: network.width applies to WideResNet trunks only; "
                              f"set it to 1.0 for network.body={network['body']!r}")
        if not 0.0 < network["width"] <= 1.0:
            raise ConfigError(f"{source}: network.width must be in (0, 1], got "
                              f"{network['width']}")
        low, high = section["scale_range_train"]
        if not 0.0 < low <= high:
            raise ConfigError(f"{source}: input.scale_range_train must be [a, b] with "
                              f"0 < a <= b, got {section['scale_range_train']}")
        if not 0.0 <= section["class_uniform_train"] <= 1.0:
            raise ConfigError(f"{source}: input.class_uniform_train must be in [0, 1]")
        if section["std"] is not None and min(section["std"]) <= 0:
            raise ConfigError(f"{source}: input.std must be positive, got {section['std']}")
        if not 0.0 < config["loss"]["top_fraction"] <= 1.0:
            raise ConfigError(f"{source}: loss.top_fraction must be in (0, 1], got "
                              f"{config['loss']['top_fraction']}")
        data = config["data"]
        low, high = data["canvas_digit_scale"]
        if low > high:
            raise ConfigError(f"{source}: data.canvas_digit_scale must be [a, b] with "
                              f"1 <= a <= b, got {data['canvas_digit_scale']}")
        if data["canvas_size"] < math.ceil(DIGIT_SIDE * high):
            raise ConfigError(f"{source}: data.canvas_size={data['canvas_size']} is smaller "
                              f"than the largest digit ({math.ceil(DIGIT_SIDE * high)} px at "
                              f"data.canvas_digit_scale {high}): raise the one or lower the "
                              f"other")
        if data["dataset"] == "digits" and data["root"] is not None:
            raise ConfigError(f"{source}: data.dataset 'digits' is the embedded data and "
                              f"takes no DATA_ROOT (data.root={data['root']!r}): drop one")
        if data["dataset"] not in ("auto", "digits") and data["root"] is None:
            raise ConfigError(f"{source}: data.dataset {data['dataset']!r} needs its folder: "
                              f"pass DATA_ROOT (--data-root) or set data.root")
        # The head's image-pooling branch normalises one value per channel and image: a
        # (per-rank) batch of one gives BN a single value. iabn_sync pools over ranks.
        if config["data"]["batch_size"] < 2:
            raise ConfigError(f"{source}: data.batch_size must be at least 2: the DeepLabV3 "
                              f"image-pooling branch normalises one value per image")

    def normalisation(self, config: Config) -> tuple[Any, Any]:
        """The input mean and std: the config's, else the data's defaults."""
        section = config["input"]
        embedded = config["data"]["root"] is None
        mean = section["mean"] or (CANVAS_MEAN if embedded else IMAGENET_MEAN)
        std = section["std"] or (CANVAS_STD if embedded else IMAGENET_STD)
        return mean, std

    @staticmethod
    def layout(config: Config) -> str:
        """The data layout to read: ``data.dataset``, or for ``auto`` the one
        :func:`~iabn.tools.data.seg_datasets.detect_layout` finds in ``data.root``."""
        data = config["data"]
        if data["dataset"] != "auto":
            return data["dataset"]
        return "digits" if data["root"] is None else detect_layout(data["root"])

    def datasets(self, config: Config) -> DataSplits:
        section, data = config["input"], config["data"]
        layout = self.layout(config)
        wanted = config["network"]["num_classes"]
        mean, std = self.normalisation(config)
        train_transform = TrainTransform(
            section["crop_train"], mean, std, tuple(section["scale_range_train"]),
            0.5 if section["flip_train"] else 0.0, section["class_uniform_train"],
            data["ignore_index"])
        val_transform = EvalTransform(mean, std, section["long_side_val"])
        labels: LabelSet
        if layout == "digits":
            common = {"size": data["canvas_size"], "seed": data["canvas_seed"],
                      "split_seed": data["canvas_seed"],
                      "digit_scale": tuple(data["canvas_digit_scale"]),
                      "max_digits": data["canvas_max_digits"]}
            train = DigitsCanvas("train", data["canvas_train"], transform=train_transform,
                                 **common)
            val = DigitsCanvas("val", data["canvas_val"], transform=val_transform, **common)
            labels = identity_labels("digits", CANVAS_CLASSES)
            description = (f"embedded digits canvases ({data['canvas_train']} train / "
                           f"{data['canvas_val']} val, {data['canvas_size']}px, "
                           f"{labels.num_classes} classes)")
        elif layout == "folder":
            if wanted is None:
                raise ConfigError("network.num_classes must be set for folder data (the "
                                  "number of label values other than data.ignore_index)")
            folder = {"ignore_index": data["ignore_index"], "num_classes": wanted}
            train = SegmentationFolder(data["root"], "train", train_transform, **folder)
            val = SegmentationFolder(data["root"], "val", val_transform, **folder)
            labels = identity_labels("folder", [f"class {i}" for i in range(wanted)],
                                     [data["ignore_index"]])
            description = f"{data['root']} ({len(train)} train / {len(val)} val images)"
        else:
            assert layout in PUBLISHED, layout
            labels = layout_labels(layout, data["root"])
            if data["ignore_index"] < labels.num_classes:
                raise ConfigError(f"data.ignore_index={data['ignore_index']} is one of the "
                                  f"{labels.num_classes} {layout} train ids: use a value >= "
                                  f"{labels.num_classes} (255 as shipped)")
            common = {"ignore_index": data["ignore_index"], "labels": labels}
            train = open_dataset(layout, data["root"], "train", train_transform, **common)
            val = open_dataset(layout, data["root"], "val", val_transform, **common)
            description = (f"{layout} in {data['root']} ({len(train)} train / {len(val)} val "
                           f"images, {labels.num_classes} classes)")
        classes = labels.classes
        if wanted is not None and wanted != len(classes):
            raise ConfigError(f"network.num_classes={wanted} but the data has {len(classes)} "
                              f"classes: set it to {len(classes)} or null")
        self.class_names = classes
        self.ignore_index = data["ignore_index"]
        self.top_fraction = config["loss"]["top_fraction"]
        # the snapshot keeps the classes, colours and label ids: `iabn segment` colours and
        # exports predictions with them without the data at hand
        return DataSplits(train, val, len(classes), description, labels.to_dict())

    def build_model(self, config: Config, splits: DataSplits, ranks: Ranks) -> nn.Module:
        return build_segmenter(config, splits.num_classes, ranks.distributed)

    def forward(self, model: nn.Module, inputs: Tensor) -> Tensor:
        return model(inputs).float()

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return bootstrapped_cross_entropy(outputs, targets, self.top_fraction,
                                          self.ignore_index)

    def new_meter(self, device: torch.device) -> SegmentationMeter:
        return SegmentationMeter(len(self.class_names), self.ignore_index, device,
                                 self.class_names)


def build_segmenter(config: Config, num_classes: int, distributed: bool) -> SegmentationNet:
    """DeepLabV3 on the ``network`` section's trunk (``iabn_sync`` alone: see
    :func:`.norm_act_kwargs`)."""
    network = config["network"]
    kwargs = norm_act_kwargs(network, distributed)
    pooling = tuple(network["pooling_size"]) if network["pooling_size"] else None
    family, depth = BODIES[network["body"]]
    if family == "wider_resnet":
        return deeplabv3_wider_resnet38(num_classes, pooling_size=pooling, depth=depth,
                                        width=network["width"],
                                        head_channels=network["head_channels"], **kwargs)
    trunk = ResNeXt(depth, num_classes=None, dilation=True, **kwargs)
    head = DeepLabV3Head(trunk.out_channels, network["head_channels"],
                         network["head_channels"], pooling_size=pooling, **kwargs)
    return SegmentationNet(trunk, head, network["head_channels"], num_classes)


__all__ = ["BODIES", "SCHEMA", "SegmentationMeter", "SegmentationTask", "build_segmenter"]
