"""``iabn train-seg``'s task: the metric meter against an independent IoU computation, the
config checks, and the network it builds."""

import json

import numpy as np
import pytest
import torch

from iabn.tools.training.config import ENGINE_SCHEMA, ConfigError, combine, defaults
from iabn.tools.training.segmentation import SegmentationMeter, SegmentationTask, build_segmenter
from train_tiny import run_iabn

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu

CLASSES = ("background", "a", "b")


def _numpy_iou(pred, target, classes, ignore):
    """Per-class IoU and mean over classes present, written out with NumPy."""
    keep = target != ignore
    pred, target = pred[keep], target[keep]
    ious = []
    for c in range(classes):
        inter = np.sum((pred == c) & (target == c))
        union = np.sum((pred == c) | (target == c))
        ious.append(inter / union if union else np.nan)
    return np.array(ious), np.nanmean(ious), np.mean(pred == target)


def test_meter_sums_batches_and_matches_numpy_iou():
    generator = torch.Generator().manual_seed(0)
    meter = SegmentationMeter(3, 255, torch.device("cpu"), CLASSES)
    preds, targets, losses = [], [], []
    for batch in range(3):
        logits = torch.randn(2, 3, 5, 4, generator=generator)
        target = torch.randint(0, 3, (2, 5, 4), generator=generator)
        target[0, 0] = 255
        loss = torch.tensor(0.5 + batch)
        meter.update(logits, target, loss)
        preds.append(logits.argmax(1).numpy().ravel())
        targets.append(target.numpy().ravel())
        losses.append(loss.item())
    metrics = meter.summarize(meter.sums)
    ious, miou, accuracy = _numpy_iou(np.concatenate(preds), np.concatenate(targets), 3, 255)
    assert metrics["miou"] == pytest.approx(100 * miou)
    assert metrics["pixel_accuracy"] == pytest.approx(100 * accuracy)
    for name, iou in zip(CLASSES, ious, strict=True):
        assert metrics[f"iou/{name}"] == pytest.approx(100 * iou)
    assert metrics["loss"] == pytest.approx(np.mean(losses))  # equal batch sizes
    assert metrics["count"] == 6


def _config(**sections):
    task = SegmentationTask()
    config = defaults(combine(ENGINE_SCHEMA, task.schema))
    for section, values in sections.items():
        config[section].update(values)
    return task, config


@pytest.mark.parametrize("sections,message", [
    ({"data": {"batch_size": 1}}, "data.batch_size must be at least 2"),
    ({"network": {"body": "resnext50", "width": 0.5}}, "network.width applies to WideResNet"),
    ({"loss": {"top_fraction": 0.0}}, "loss.top_fraction"),
    ({"input": {"scale_range_train": [2.0, 0.7]}}, "input.scale_range_train"),
    ({"network": {"norm_act": "iabn", "activation": "relu"}}, "not invertible"),
])
def test_config_errors_name_the_key(sections, message):
    task, config = _config(**sections)
    with pytest.raises(ConfigError, match=message):
        task.check_config(config, "cfg.json")


def test_folder_data_needs_num_classes(tmp_path):
    task, config = _config(data={"root": str(tmp_path), "dataset": "folder"})
    with pytest.raises(ConfigError, match=r"network\.num_classes"):
        task.datasets(config)


def test_auto_layout_of_an_unknown_folder_lists_the_layouts(tmp_path):
    from iabn.tools.data.imagefolder import DataLayoutError

    task, config = _config(data={"root": str(tmp_path)})
    with pytest.raises(DataLayoutError, match="no segmentation layout iabn knows"):
        task.datasets(config)


@pytest.mark.parametrize("body", ["wider_resnet16_a2", "resnext50"])
def test_built_network_has_output_stride_8_and_full_size_logits(body):
    width = 0.0625 if body.startswith("wider") else 1.0
    _, config = _config(network={"body": body, "width": width, "head_channels": 8,
                                 "norm_act": "iabn_sync"})
    with torch.device("meta"):
        model = build_segmenter(config, 5, distributed=False)  # iabn_sync -> iabn alone
        features = model.body(torch.zeros(2, 3, 40, 48))
        logits = model(torch.zeros(2, 3, 40, 48))
    assert features.shape[-2:] == (5, 6)
    assert logits.shape == (2, 5, 40, 48)
    assert not any("Sync" in type(m).__name__ for m in model.modules())


# --- end to end: iabn train-seg on tiny canvases, exact resume, iabn segment on the result ---

TINY_SEG = {
    "network": {"body": "wider_resnet16_a2", "width": 0.0625, "head_channels": 8,
                "pooling_size": None},
    "optimizer": {"type": "adam", "lr": 0.002, "weight_decay": 1e-4},
    "schedule": {"epochs": 2, "type": "poly", "power": 0.9, "update": "step"},
    "input": {"crop_train": 40, "flip_train": False},
    "data": {"batch_size": 4, "val_batch_size": 3, "workers": 0, "canvas_size": 48,
             "canvas_train": 12, "canvas_val": 6, "canvas_digit_scale": [3, 5]},
    "loss": {"top_fraction": 0.25},
    "logging": {"log_every": 1, "tensorboard": False},
}


@pytest.fixture(scope="module")
def seg_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("seg")
    config = root / "tiny_seg.json"
    config.write_text(json.dumps(TINY_SEG))
    process = run_iabn("train-seg", str(config), "--log-dir", str(root / "whole"))
    return process, config, root


def test_train_seg_writes_snapshots_with_miou(seg_run):
    process, _, root = seg_run
    assert process.returncode == 0, process.stderr
    last = torch.load(root / "whole" / "last.pth", weights_only=True)
    assert last["task"] == "segmentation" and last["global_step"] == 6  # 12 / 4 x 2 epochs
    assert last["dataset"]["name"] == "digits" and len(last["dataset"]["classes"]) == 11
    metrics = last["val_metrics"]
    assert metrics["count"] == 6 and 0 <= metrics["miou"] <= 100
    assert "iou/digit 7" in metrics and "pixel_accuracy" in metrics
    assert (root / "whole" / "best.pth").is_file()


@pytest.mark.slow
def test_train_seg_stopped_and_resumed_reaches_the_same_weights(seg_run):
    _, config, root = seg_run
    log_dir = root / "resumed"
    stopped = run_iabn("train-seg", str(config), "--log-dir", str(log_dir),
                       "--stop-after-steps", "4")
    assert stopped.returncode == 3, stopped.stderr
    resumed = run_iabn("train-seg", str(config), "--log-dir", str(log_dir), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    whole = torch.load(root / "whole" / "last.pth", weights_only=True)["model"]
    again = torch.load(log_dir / "last.pth", weights_only=True)["model"]
    assert [k for k in whole if not torch.equal(whole[k], again[k])] == []


@pytest.mark.slow
def test_segment_runs_a_train_seg_snapshot(seg_run, tmp_path):
    from PIL import Image

    from iabn.tools.data.segmentation import DigitsCanvas

    _, _, root = seg_run
    images = tmp_path / "in"
    images.mkdir()
    for index in range(2):
        canvas, _ = DigitsCanvas("val", 2, size=48, digit_scale=(3, 5)).canvas(index)
        Image.fromarray(canvas.permute(1, 2, 0).numpy()).save(images / f"c{index}.png")
    # no --long-side: the default follows the snapshot's training resolution (the
    # fixed 2048 upscaled 96-px canvases 21x and the model predicted only background)
    done = run_iabn("segment", str(root / "whole" / "best.pth"), str(images),
                    str(tmp_path / "out"), "--output", "raw")
    assert done.returncode == 0, done.stderr
    assert "long side 48 (the snapshot's canvas size)" in done.stderr
    for index in range(2):
        with Image.open(tmp_path / "out" / f"c{index}.png") as result:
            assert result.size == (48, 48)
            assert np.asarray(result).max() < 11


@pytest.mark.parametrize("name", ["digits_seg", "segmentation_wrn38_cityscapes",
                                  "segmentation_resnext101_cityscapes"])
def test_shipped_segmentation_configs_load_and_check(name):
    from pathlib import Path

    from iabn.tools.training.commands import SEGMENTATION_TASK, load_run_config

    path = Path(__file__).resolve().parents[2] / "configs" / f"{name}.json"
    cityscapes = name.endswith("_cityscapes")  # these name their layout: they need a folder
    config = load_run_config(path, "/data/cityscapes" if cityscapes else None, [],
                             SEGMENTATION_TASK)
    assert config["data"]["dataset"] == ("cityscapes" if cityscapes else "auto")
    if cityscapes:
        with pytest.raises(ConfigError, match="'cityscapes' needs its folder"):
            load_run_config(path, None, [], SEGMENTATION_TASK)
    if name.startswith("segmentation"):  # the paper's §4.2 settings
        assert config["optimizer"]["lr"] == 0.0025 and config["schedule"]["power"] == 0.9
        assert config["loss"]["top_fraction"] == 0.25
        assert config["input"]["scale_range_train"] == [0.7, 2.0]
