"""Published segmentation layouts (iabn.tools.data.seg_datasets, iabn.tools.data.label_sets) on tiny
synthetic copies written in the real layouts (tests/support/seg_layouts.py): loading, the label
mapping against the official tables, errors, one ``iabn train-seg`` step on each, and
``iabn segment``'s palettes and label-id export.

The evaluation checks compare what ``iabn train-seg`` reports with
``cityscapesscripts``' own pixel-level evaluation (``evalPixelLevelSemanticLabeling``, run
in-process on the labelIds PNGs of the same predictions)."""

import copy
import glob
import json

import numpy as np
import pytest
import torch
from PIL import Image

from iabn.tools.cli import main
from iabn.tools.data.imagefolder import DataLayoutError
from iabn.tools.data.label_sets import LabelSet, cityscapes_labels, vistas_labels, voc_labels
from iabn.tools.data.seg_datasets import (
    CityscapesSegmentation,
    PascalVOCSegmentation,
    VistasSegmentation,
    detect_layout,
    open_dataset,
)
from iabn.tools.metrics import ConfusionMatrix
from iabn.tools.training.segmentation import SegmentationMeter
from seg_layouts import (
    BLOCK,
    CITYSCAPES_FRAMES,
    HEIGHT,
    VOC_NAMES,
    WIDTH,
    voc_colours,
    write_cityscapes,
    write_vistas,
    write_voc,
)
from train_tiny import one_torch_thread

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu


def _official_labels():
    return pytest.importorskip("cityscapesscripts.helpers.labels")


def _official_train_ids(ids: np.ndarray) -> np.ndarray:
    """labelIds -> trainIds by cityscapesscripts' own table (255 for its 255 and -1)."""
    table = {label.id: label.trainId for label in _official_labels().labels}
    mapped = np.vectorize(lambda i: table[int(i)])(ids)
    return np.where((mapped < 0) | (mapped == 255), 255, mapped)


# ------------------------------------------------------------------ label tables


def test_cityscapes_table_is_the_official_one():
    official = _official_labels()
    trained = sorted((label for label in official.labels if 0 <= label.trainId < 255),
                     key=lambda label: label.trainId)
    ours = cityscapes_labels()
    assert ours.num_classes == 19 == len(trained)
    assert ours.classes == tuple(label.name for label in trained)
    assert ours.colors == tuple(tuple(label.color) for label in trained)
    assert ours.label_ids == tuple(label.id for label in trained)
    assert sorted(ours.void_ids) == sorted(
        label.id for label in official.labels if label.id >= 0 and label.trainId in (255, -1))


def test_voc_table_and_colours():
    voc = voc_labels()
    assert voc.num_classes == 21 and voc.classes[0] == "background"
    assert voc.classes[15] == "person" and voc.classes[20] == "tvmonitor"
    assert voc.colors == tuple(voc_colours()[:21])
    assert voc.colors[15] == (192, 128, 128)  # person, as in the devkit's example images
    assert voc.void_ids == (255,)


def test_label_set_round_trip_and_export():
    labels = cityscapes_labels()
    assert LabelSet.from_dict(json.loads(json.dumps(labels.to_dict()))) == labels
    exported = labels.to_label_ids(torch.tensor([[0, 13], [18, 10]]))
    assert exported.tolist() == [[7, 26], [33, 23]]  # road, car, bicycle, sky
    with pytest.raises(ValueError, match="outside"):
        labels.to_label_ids(torch.tensor([19]))
    palette = labels.palette()
    assert len(palette) == 768 and palette[:3] == [128, 64, 128] and palette[-3:] == [0, 0, 0]


# ------------------------------------------------------------------ Cityscapes


def test_cityscapes_layout_maps_label_ids_to_train_ids(tmp_path):
    written = write_cityscapes(tmp_path)
    data = CityscapesSegmentation(tmp_path, "val")
    stems = [image.name.removesuffix("_leftImg8bit.png") for image, _ in data.samples]
    assert stems == sorted("_".join(frame) for frame in CITYSCAPES_FRAMES["val"])
    assert data.classes == cityscapes_labels().classes
    for index, (_, label_path) in enumerate(data.samples):
        image, label = data[index]
        assert image.dtype == torch.uint8 and image.shape == (3, HEIGHT, WIDTH)
        assert label.dtype == torch.int64 and label.shape == (HEIGHT, WIDTH)
        assert label[0, 0] == 0 and label[0, BLOCK] == 255  # id 7 road, id 0 unlabeled
        assert np.array_equal(label.numpy(), _official_train_ids(written[str(label_path)]))


def test_cityscapes_errors_name_what_is_missing(tmp_path):
    write_cityscapes(tmp_path)
    image = next((tmp_path / "leftImg8bit" / "val").rglob("*_leftImg8bit.png"))
    label = image.parent.parent.parent.parent / "gtFine" / "val" / image.parent.name / (
        image.name.replace("_leftImg8bit.png", "_gtFine_labelIds.png"))
    label.unlink()
    with pytest.raises(DataLayoutError, match=r"1 Cityscapes .* missing: .*_gtFine_labelIds"):
        CityscapesSegmentation(tmp_path, "val")
    for folder in (tmp_path / "gtFine" / "val").iterdir():
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()
    (tmp_path / "gtFine" / "val").rmdir()
    with pytest.raises(DataLayoutError, match=r"gtFine/val: not a folder; expected ROOT/"):
        CityscapesSegmentation(tmp_path, "val")
    with pytest.raises(ValueError, match="split='test'"):
        CityscapesSegmentation(tmp_path, "test")


def test_unknown_label_values_are_an_error_naming_the_file(tmp_path):
    write_cityscapes(tmp_path)
    data = CityscapesSegmentation(tmp_path, "train")
    label_path = data.samples[1][1]
    Image.fromarray(np.full((HEIGHT, WIDTH), 40, dtype=np.uint8)).save(label_path)
    with pytest.raises(ValueError, match=rf"{label_path.name} has label values 40 .*cityscapes"):
        data[1]


# ------------------------------------------------------------------ Mapillary Vistas


@pytest.mark.parametrize("archive", ["v1.2", "v2.0"])
def test_vistas_layout_reads_classes_and_colours_from_its_config(tmp_path, archive):
    written = write_vistas(tmp_path, archive)
    data = VistasSegmentation(tmp_path, "val")
    assert len(data) == 2 and data.labels.num_classes == 65  # 66 labels, "Unlabeled" void
    assert data.classes[0] == "Label 0" and data.classes[-1] == "Label 64"
    assert data.labels.colors[3] == ((37 * 3) % 256, (91 * 3 + 50) % 256, (53 * 3 + 20) % 256)
    for index, (image_path, label_path) in enumerate(data.samples):
        assert image_path.parent.parent.name == "validation"
        image, label = data[index]
        ids = written[str(label_path)]
        assert image.shape == (3, HEIGHT, WIDTH)
        assert np.array_equal(label.numpy(), np.where(ids == 65, 255, ids))


def test_vistas_labels_not_evaluated_are_void_and_the_rest_renumbered(tmp_path):
    from seg_layouts import vistas_labels as config_labels

    labels = config_labels(8, void=(2, 7))
    written = write_vistas(tmp_path, labels=labels)
    data = VistasSegmentation(tmp_path, "train")
    expected, train_id = {}, 0
    for index, label in enumerate(labels):  # the config's order, void labels skipped
        expected[index] = 255 if not label["evaluate"] else train_id
        train_id += label["evaluate"]
    assert data.classes == ("Label 0", "Label 1", "Label 3", "Label 4", "Label 5", "Label 6")
    _, label = data[0]
    assert np.array_equal(label.numpy(),
                          np.vectorize(expected.get)(written[str(data.samples[0][1])]))


def test_vistas_errors(tmp_path):
    write_vistas(tmp_path)
    unpaired = next((tmp_path / "training" / "labels").iterdir())
    unpaired.unlink()
    with pytest.raises(DataLayoutError, match=r"1 image\(s\) in .*training/images have no label"):
        VistasSegmentation(tmp_path, "train")
    (tmp_path / "config.json").write_text("{\"labels\": [{\"name\": 3}]}")
    with pytest.raises(DataLayoutError, match="not a Mapillary Vistas config"):
        VistasSegmentation(tmp_path, "val")
    (tmp_path / "config.json").unlink()
    with pytest.raises(DataLayoutError, match=r"has no config\.json or config_v1\.2\.json"):
        VistasSegmentation(tmp_path, "val")


# ------------------------------------------------------------------ Pascal VOC


@pytest.mark.parametrize("sub", ["", "VOCdevkit", "VOCdevkit/VOC2012"])
def test_voc_layout_keeps_void_borders_and_the_list_order(tmp_path, sub):
    written = write_voc(tmp_path)
    data = PascalVOCSegmentation(tmp_path / sub if sub else tmp_path, "train")
    assert [image.stem for image, _ in data.samples] == VOC_NAMES["train"]  # list file order
    assert data.classes == voc_labels().classes
    for index, (_, label_path) in enumerate(data.samples):
        _, label = data[index]
        ids = written[str(label_path)]
        assert (ids == 255).any() and np.array_equal(label.numpy(), ids)


def test_voc_errors(tmp_path):
    write_voc(tmp_path)
    segmentation = tmp_path / "VOCdevkit" / "VOC2012" / "ImageSets" / "Segmentation"
    segmentation.joinpath("val.txt").write_text("2007_000033\n2008_999999\n")
    with pytest.raises(DataLayoutError, match=r"2 VOC .* missing: .*2008_999999.jpg"):
        PascalVOCSegmentation(tmp_path, "val")
    segmentation.joinpath("val.txt").unlink()
    with pytest.raises(DataLayoutError, match=r"val.txt does not exist"):
        PascalVOCSegmentation(tmp_path, "val")
    with pytest.raises(DataLayoutError, match="holds no VOCdevkit/VOC2012"):
        PascalVOCSegmentation(tmp_path / "VOCdevkit" / "VOC2012" / "JPEGImages", "train")
    data = PascalVOCSegmentation(tmp_path, "train")
    label_path = data.samples[0][1]
    bad = np.full((HEIGHT, WIDTH), 21, dtype=np.uint8)
    bad[0, :3] = (0, 20, 255)
    Image.fromarray(bad).save(label_path)
    with pytest.raises(ValueError, match=rf"{label_path.name} has label values 21 that are "
                                         rf"neither voc class ids \(0-20\) nor void ids "
                                         rf"\(255\)"):
        data[0]


# ------------------------------------------------------------------ detection


def test_layouts_are_told_apart_by_their_folders(tmp_path):
    write_cityscapes(tmp_path / "cs")
    write_vistas(tmp_path / "vistas", "v2.0")
    write_voc(tmp_path / "voc")
    (tmp_path / "folder" / "train" / "images").mkdir(parents=True)
    assert detect_layout(tmp_path / "cs") == "cityscapes"
    assert detect_layout(tmp_path / "vistas") == "vistas"
    for root in ("voc", "voc/VOCdevkit", "voc/VOCdevkit/VOC2012"):
        assert detect_layout(tmp_path / root) == "voc"
    assert detect_layout(tmp_path / "folder") == "folder"
    with pytest.raises(DataLayoutError, match=r"no segmentation layout iabn knows: Cityscapes"):
        detect_layout(tmp_path)
    with pytest.raises(DataLayoutError, match="is not a folder"):
        detect_layout(tmp_path / "nowhere")
    assert len(open_dataset("voc", tmp_path / "voc", "val")) == len(VOC_NAMES["val"])


# ------------------------------------------------------------------ iabn train-seg

TINY = {
    "network": {"body": "wider_resnet16_a2", "width": 0.0625, "head_channels": 8,
                "pooling_size": None},
    "optimizer": {"type": "adam", "lr": 0.002},
    "schedule": {"epochs": 1, "max_steps_per_epoch": 1, "type": "poly", "update": "step"},
    "input": {"crop_train": 32, "flip_train": False},
    "data": {"batch_size": 2, "val_batch_size": 3, "workers": 0},
    "logging": {"log_every": 1, "tensorboard": False, "progress": False},
}


def _train_seg(tmp_path, *args):
    config = tmp_path / "tiny_layout.json"
    config.write_text(json.dumps(TINY))
    log_dir = tmp_path / "run"
    with one_torch_thread():
        code = main(["train-seg", str(config), *args, "--log-dir", str(log_dir)])
    return code, log_dir


@pytest.fixture(scope="module")
def cityscapes_run(tmp_path_factory):
    """One ``iabn train-seg --dataset cityscapes --data-root ROOT`` step and validation."""
    root = tmp_path_factory.mktemp("cityscapes")
    write_cityscapes(root / "data")
    code, log_dir = _train_seg(root, "--dataset", "cityscapes", "--data-root",
                               str(root / "data"))
    return code, log_dir, root / "data"


def _check_run(code, log_dir, name, classes, val_images):
    assert code == 0
    snapshot = torch.load(log_dir / "last.pth", weights_only=True)
    assert snapshot["global_step"] == 1 and snapshot["config"]["data"]["dataset"] in (name,
                                                                                      "auto")
    assert snapshot["model"]["cls.weight"].shape[0] == len(classes)
    assert snapshot["dataset"]["name"] == name and snapshot["dataset"]["classes"] == classes
    metrics = snapshot["val_metrics"]
    assert metrics["count"] == val_images and 0 <= metrics["miou"] <= 100
    assert {f"iou/{c}" for c in classes} <= set(metrics)
    return snapshot


def test_train_seg_one_step_on_cityscapes(cityscapes_run):
    code, log_dir, _ = cityscapes_run
    _check_run(code, log_dir, "cityscapes", list(cityscapes_labels().classes),
               len(CITYSCAPES_FRAMES["val"]))


@pytest.mark.parametrize("layout", ["vistas", "voc"])
def test_train_seg_one_step_on_vistas_and_voc(tmp_path, layout):
    data = tmp_path / "data"
    if layout == "vistas":
        write_vistas(data, "v2.0")
        code, log_dir = _train_seg(tmp_path, "--data-root", str(data))  # auto
        classes = list(vistas_labels(data / "config_v1.2.json").classes)
        val_images = 2
    else:
        write_voc(data)
        code, log_dir = _train_seg(tmp_path, str(data / "VOCdevkit"), "--dataset", "voc")
        classes, val_images = list(voc_labels().classes), len(VOC_NAMES["val"])
    _check_run(code, log_dir, layout, classes, val_images)


@pytest.mark.parametrize(("args", "message"), [
    # DATA_ROOT right after CONFIG: argparse fills an optional positional at the first option
    (["{root}", "--dataset", "digits"], "'digits' is the embedded data and takes no DATA_ROOT"),
    (["--dataset", "cityscapes"], "'cityscapes' needs its folder: pass DATA_ROOT"),
    (["--dataset", "voc", "--data-root", "{root}"], r"holds no VOCdevkit/VOC2012 folder"),
    (["{root}", "--data-root", "{root}/x"], "DATA_ROOT .* and --data-root .* differ"),
    (["{root}", "--set", "data.ignore_index=3"], "data.ignore_index=3 is one of the 19"),
])
def test_train_seg_data_errors_exit_2_before_writing(tmp_path, capsys, args, message):
    write_cityscapes(tmp_path / "data")
    args = [a.format(root=tmp_path / "data") for a in args]
    code, log_dir = _train_seg(tmp_path, *args)
    error = capsys.readouterr().err
    assert code == 2 and not log_dir.exists()
    assert error.startswith("iabn train-seg: error: ") and error.count("\n") == 1
    assert __import__("re").search(message, error), error


# ------------------------------------------------------------------ item 4: official mIoU


def _official_evaluation(prediction_dir, data_root):
    """cityscapesscripts' evaluation of the labelIds PNGs under ``prediction_dir`` against
    ``data_root/gtFine/val``: its own file matching (``getPrediction``) and ``evaluateImgLists``,
    on a copy of its module-level arguments (no JSON file, no printing)."""
    evaluation = pytest.importorskip(
        "cityscapesscripts.evaluation.evalPixelLevelSemanticLabeling")
    args = copy.copy(evaluation.args)
    args.predictionPath, args.predictionWalk = str(prediction_dir), None
    args.evalInstLevelScore = False  # nIoU needs instanceIds PNGs; IoU does not
    args.JSONOutput, args.quiet, args.colorized, args.bold, args.nocol = False, True, False, "", ""
    truth = sorted(glob.glob(str(data_root / "gtFine" / "val" / "*" / "*_gtFine_labelIds.png")))
    predictions = [evaluation.getPrediction(args, path) for path in truth]
    return evaluation.evaluateImgLists(predictions, truth, args)


def _pixels(path):
    with Image.open(path) as image:
        return np.asarray(image)


def _compare(matrix, official, classes):
    """Per-class IoUs must be equal (both divide the same integer counts); returns the
    difference of the means (they sum in different orders)."""
    ours = matrix.iou().tolist()
    for name, iou in zip(classes, ours, strict=True):
        theirs = official["classScores"][name]
        assert (np.isnan(iou) and np.isnan(theirs)) or iou == theirs, name
    return abs(matrix.mean_iou() - official["averageScoreClasses"])


def test_miou_equals_cityscapesscripts_on_perturbed_ground_truth(tmp_path):
    """Predictions: the ground truth's train ids with a quarter of the pixels (and every void
    pixel) replaced by random classes; class 16 (train) is never predicted nor in the ground
    truth (NaN for both), class 17 (motorcycle) predicted but absent (IoU 0)."""
    write_cityscapes(tmp_path / "data")
    data = CityscapesSegmentation(tmp_path / "data", "val")
    labels = data.labels
    meter = SegmentationMeter(19, 255, torch.device("cpu"), labels.classes)
    matrix = ConfusionMatrix(19)
    generator = torch.Generator().manual_seed(0)
    choices = torch.tensor([c for c in range(19) if c != 16])
    for index, (image_path, _) in enumerate(data.samples):
        _, truth = data[index]
        prediction = truth.clone()
        replace = (torch.rand(truth.shape, generator=generator) < 0.25) | (truth == 255)
        prediction[replace] = choices[torch.randint(len(choices), (int(replace.sum()),),
                                                    generator=generator)]
        matrix.update(prediction, truth)
        meter.update(prediction[None], truth[None], torch.tensor(0.0))
        out = tmp_path / "pred" / image_path.parent.name
        out.mkdir(parents=True, exist_ok=True)
        ids = labels.to_label_ids(prediction).to(torch.uint8).numpy()
        Image.fromarray(ids).save(out / image_path.name.replace("leftImg8bit", "pred"))
    official = _official_evaluation(tmp_path / "pred", tmp_path / "data")
    assert np.isnan(official["classScores"]["train"])
    assert official["classScores"]["motorcycle"] == 0.0
    # measured: 0.0 (the 18 IoUs are equal bit for bit; nanmean and the script's loop
    # happened to round the same), allowed one ulp of the sum
    assert _compare(matrix, official, labels.classes) <= 1e-15
    metrics = meter.summarize(meter.sums)  # what iabn train-seg logs, in %
    assert metrics["miou"] == pytest.approx(100 * official["averageScoreClasses"], rel=1e-12)
    for name in labels.classes:
        theirs = 100 * official["classScores"][name]
        assert metrics[f"iou/{name}"] == pytest.approx(theirs, rel=1e-12, nan_ok=True)


def test_segment_exports_labelids_the_official_evaluation_scores_as_iabn(cityscapes_run,
                                                                         tmp_path):
    """The trained snapshot through ``iabn segment``: ``--output labelids`` scored by
    cityscapesscripts, ``--output raw`` (train ids) by iabn, the same predictions."""
    code, log_dir, data_root = cityscapes_run
    assert code == 0
    images = data_root / "leftImg8bit" / "val"
    common = ["segment", str(log_dir / "best.pth"), str(images)]
    options = ["--recursive", "--long-side", "0", "--quiet"]
    with one_torch_thread():
        for output in ("labelids", "raw", "palette"):
            assert main([*common, str(tmp_path / output), *options, "--output", output]) == 0
    data = CityscapesSegmentation(data_root, "val")
    matrix = ConfusionMatrix(19)
    for index, (image_path, _) in enumerate(data.samples):
        relative = image_path.relative_to(images)
        raw, exported = (_pixels(tmp_path / output / relative) for output in ("raw", "labelids"))
        assert np.array_equal(_official_train_ids(exported), raw)  # trainId -> id -> trainId
        matrix.update(torch.from_numpy(raw.astype(np.int64)), data[index][1])
        with Image.open(tmp_path / "palette" / relative) as coloured:
            assert coloured.mode == "P"
            official_colours = {label.trainId: list(label.color)
                                for label in _official_labels().labels}
            palette = coloured.getpalette()
            for train_id in np.unique(raw):
                assert palette[3 * train_id:3 * train_id + 3] == official_colours[train_id]
    official = _official_evaluation(tmp_path / "labelids", data_root)
    assert _compare(matrix, official, data.classes) <= 1e-15
    # and what train-seg reported: its validation predicted the same full-size images in
    # batches with torchvision's normalisation, iabn segment one by one with Pillow's; on the
    # tested platform the predictions and both numbers were equal (difference 0.0), a pixel's
    # argmax flipping at a near-tie would move the mean by about 0.04 points here
    reported = torch.load(log_dir / "best.pth", weights_only=True)["val_metrics"]["miou"]
    assert reported == pytest.approx(100 * official["averageScoreClasses"], abs=0.05)
