"""Segmentation data (iabn.tools.data.segmentation): the DigitsCanvas set, the image/label folder
layout and its errors, and the joint transforms against Pillow / NumPy references."""

import numpy as np
import pytest
import torch
from PIL import Image

from iabn.tools.data.digits import load_digits_uint8, split_indices
from iabn.tools.data.imagefolder import DataLayoutError
from iabn.tools.data.segmentation import (
    CANVAS_CLASSES,
    IGNORE_INDEX,
    DigitsCanvas,
    EvalTransform,
    SegmentationFolder,
    TrainTransform,
    class_uniform_pixel,
    crop_pair,
    random_window,
    resize_pair,
)

# ------------------------------------------------------------------ DigitsCanvas


def test_canvases_are_a_function_of_seed_split_and_index():
    first, again = DigitsCanvas(length=5), DigitsCanvas(length=5)
    image, label = first[3]
    assert image.dtype == torch.uint8 and image.shape == (3, 64, 64)
    assert label.dtype == torch.int64 and label.shape == (64, 64)
    assert torch.equal(image, again[3][0]) and torch.equal(label, again[3][1])
    assert not torch.equal(image, first[4][0])
    assert not torch.equal(image, DigitsCanvas(length=5, seed=1)[3][0])
    assert not torch.equal(image, DigitsCanvas("val", length=5)[3][0])


def test_train_and_val_canvases_draw_from_disjoint_digit_splits():
    images, labels = load_digits_uint8()
    train_idx, val_idx = split_indices(labels, 0.2, 0)
    assert not set(train_idx) & set(val_idx)
    train, val = DigitsCanvas("train", length=1), DigitsCanvas("val", length=1)
    assert np.array_equal(train.digits, images[train_idx])
    assert np.array_equal(val.digits, images[val_idx])
    assert np.array_equal(val.digit_labels, labels[val_idx])


def test_labels_are_background_or_digit_plus_one_on_visible_ink():
    canvases = DigitsCanvas(length=60, max_digits=1)
    seen = set()
    for index in range(len(canvases)):
        image, label = canvases[index]
        classes = set(label.unique().tolist())
        assert 0 in classes and len(classes) == 2  # background and exactly one digit
        seen |= classes
        ink = label > 0
        # the labelled pixels are the drawn digit: their colour differs from the rest by far
        # more than the background's own variation
        pixels = image.float() / 255
        contrast = (pixels[:, ink].mean(1) - pixels[:, ~ink].mean(1)).abs().max()
        assert contrast > 0.2
    assert len(seen) == 11 and max(seen) == 10 and len(CANVAS_CLASSES) == 11


def test_canvas_keys_with_a_seed_make_the_augmentation_reproducible():
    transform = TrainTransform(32, (0.5,) * 3, (0.25,) * 3)
    canvases = DigitsCanvas(length=4, transform=transform)
    image, label = canvases[(2, 1234)]
    assert image.shape == (3, 32, 32) and label.shape == (32, 32)
    again = canvases[(2, 1234)]
    assert torch.equal(image, again[0]) and torch.equal(label, again[1])
    other = canvases[(2, 999)]
    assert not torch.equal(image, other[0])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"split": "test"}, "split="), ({"length": 0}, "length="), ({"max_digits": 0}, "max_digits="),
    ({"size": 32}, "size=32"), ({"digit_scale": (3.0, 2.0)}, "digit_scale="),
    ({"ink_threshold": 1.0}, "ink_threshold="),
])
def test_bad_canvas_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DigitsCanvas(**kwargs)


def test_canvas_index_out_of_range():
    with pytest.raises(IndexError, match="out of range"):
        DigitsCanvas(length=3)[3]


# ------------------------------------------------------------------ SegmentationFolder


def _write_sample(root, stem, size=(7, 5), image_suffix=".png", label_mode="L", seed=0):
    rng = np.random.default_rng(seed)
    width, height = size
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    label = rng.integers(0, 4, (height, width), dtype=np.uint8)
    label[0, 0] = IGNORE_INDEX
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "labels").mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(root / "images" / f"{stem}{image_suffix}")
    label_image = Image.fromarray(label)
    if label_mode == "P":
        label_image = label_image.convert("P")
        label_image.putpalette([v for i in range(256) for v in (i, 255 - i, 7)])
    elif label_mode == "RGB":
        label_image = label_image.convert("RGB")
    label_image.save(root / "labels" / f"{stem}.png")
    return image, label


def test_folder_pairs_images_and_labels_by_stem(tmp_path):
    written = {"a": _write_sample(tmp_path / "train", "a", seed=1),
               "b": _write_sample(tmp_path / "train", "b", seed=2, label_mode="P"),
               "c": _write_sample(tmp_path / "train", "c", seed=3, image_suffix=".jpg")}
    data = SegmentationFolder(tmp_path, "train", num_classes=4)
    assert len(data) == 3
    for index, stem in enumerate("abc"):
        image, label = data[index]
        assert image.dtype == torch.uint8 and image.shape == (3, 5, 7)
        assert np.array_equal(label.numpy(), written[stem][1])  # P: indices, not colours
        if stem != "c":  # PNG is lossless; JPEG is not
            assert np.array_equal(image.permute(1, 2, 0).numpy(), written[stem][0])


def test_folder_transform_gets_the_sample_and_its_generator(tmp_path):
    _write_sample(tmp_path / "val", "a")
    calls = []

    def transform(image, label, generator):
        calls.append(generator)
        return image, label

    data = SegmentationFolder(tmp_path, "val", transform=transform)
    data[0]
    data[(0, 5)]
    assert calls[0] is None
    assert torch.equal(calls[1].get_state(), torch.Generator().manual_seed(5).get_state())


def test_folder_layout_errors_name_the_folder_and_files(tmp_path):
    with pytest.raises(DataLayoutError, match="train/images is not a folder"):
        SegmentationFolder(tmp_path)
    _write_sample(tmp_path / "train", "a")
    _write_sample(tmp_path / "train", "b")
    (tmp_path / "train" / "labels" / "b.png").rename(tmp_path / "train" / "labels" / "z.png")
    with pytest.raises(ValueError, match=r"have no .*labels/NAME.png: b") as error:
        SegmentationFolder(tmp_path)
    assert "label(s) in" in str(error.value) and ": z" in str(error.value)
    (tmp_path / "val" / "images").mkdir(parents=True)
    (tmp_path / "val" / "labels").mkdir()
    with pytest.raises(ValueError, match="val/images has no"):
        SegmentationFolder(tmp_path, "val")


def test_duplicate_stems_are_rejected(tmp_path):
    _write_sample(tmp_path / "train", "a")
    _write_sample(tmp_path / "train", "a", image_suffix=".jpg")
    with pytest.raises(ValueError, match="same stem"):
        SegmentationFolder(tmp_path)


def test_16_bit_labels_and_images_decode_exactly(tmp_path):
    root = tmp_path / "train"
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (5, 7)).astype(np.uint16)
    Image.fromarray(grey * 257).save(root / "images" / "a.png")  # 16-bit grey image
    label = rng.integers(0, 255, (5, 7)).astype(np.uint16)
    label[0, :3] = [255, 256, 65535]  # 16-bit ids: 255 is the ignore index, 256 is not
    Image.fromarray(label).save(root / "labels" / "a.png")
    assert Image.open(root / "labels" / "a.png").mode.startswith("I")
    image, read = SegmentationFolder(tmp_path, "train")[0]
    assert image.dtype == torch.uint8 and read.dtype == torch.int64
    assert torch.equal(image, torch.from_numpy(grey).to(torch.uint8).expand(3, -1, -1))
    assert torch.equal(read, torch.from_numpy(label.astype(np.int64)))
    with pytest.raises(ValueError, match=r"values 256, 65535 outside \[0, 256\)"):
        SegmentationFolder(tmp_path, "train", num_classes=256)[0]


def test_bad_label_files_are_named_when_read(tmp_path):
    _write_sample(tmp_path / "train", "colour", label_mode="RGB")
    with pytest.raises(ValueError, match=r"colour\.png has 3 channels: labels must be single"):
        SegmentationFolder(tmp_path)[0]
    _write_sample(tmp_path / "val", "big")
    with pytest.raises(ValueError, match="outside \\[0, 3\\)"):
        SegmentationFolder(tmp_path, "val", num_classes=3)[0]
    assert SegmentationFolder(tmp_path, "val", num_classes=4)[0][1][0, 0] == IGNORE_INDEX
    _write_sample(tmp_path / "test", "mismatch")
    Image.new("L", (3, 3)).save(tmp_path / "test" / "labels" / "mismatch.png")
    with pytest.raises(ValueError, match=r"mismatch\.png is 3x3"):
        SegmentationFolder(tmp_path, "test")[0]


# ------------------------------------------------------------------ transforms


def _normalized(image, mean, std):
    scaled = image.numpy() / 255.0 if image.dtype == torch.uint8 else image.numpy()
    return (scaled - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_normalisation_matches_numpy(dtype):
    image = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    image = image if dtype == torch.uint8 else image / 255.0
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.3, 0.4)
    out_image, _ = EvalTransform(mean, std)(image, torch.zeros(4, 5, dtype=torch.long))
    assert out_image.dtype == torch.float32 and type(out_image) is torch.Tensor
    np.testing.assert_allclose(out_image.numpy(), _normalized(image, mean, std), atol=1e-6)


@pytest.mark.parametrize("size", [(23, 31), (9, 12)])  # (height, width): up, down from 15x17
def test_resize_pair_matches_pillow(size):
    generator = torch.Generator().manual_seed(0)
    image = torch.rand(3, 15, 17, generator=generator)
    label = torch.randint(0, 6, (15, 17), generator=generator)
    out_image, out_label = resize_pair(image, label, *size)
    for channel in range(3):
        reference = Image.fromarray(image[channel].numpy(), mode="F").resize(
            size[::-1], Image.Resampling.BILINEAR)
        np.testing.assert_allclose(out_image[channel].numpy(), np.asarray(reference),
                                   atol=1e-4)
    reference = Image.fromarray(label.numpy().astype(np.uint8)).resize(
        size[::-1], Image.Resampling.NEAREST)
    assert np.array_equal(out_label.numpy(), np.asarray(reference))


@pytest.mark.parametrize(("top", "left"), [(-2, -3), (1, 2), (3, 4), (-1, 5)])
def test_crop_pair_pads_outside_the_image(top, left):
    image = torch.arange(2 * 4 * 6, dtype=torch.float32).view(2, 4, 6) + 1
    label = torch.arange(4 * 6).view(4, 6)
    out_image, out_label = crop_pair(image, label, top, left, 5, 5, ignore_index=99)
    pad = 10  # reference: pad generously with numpy, then slice
    padded_image = np.pad(image.numpy(), ((0, 0), (pad, pad), (pad, pad)))
    padded_label = np.pad(label.numpy(), pad, constant_values=99)
    rows, cols = slice(top + pad, top + pad + 5), slice(left + pad, left + pad + 5)
    assert np.array_equal(out_image.numpy(), padded_image[:, rows, cols])
    assert np.array_equal(out_label.numpy(), padded_label[rows, cols])


def test_random_window_keeps_the_centre_pixel_inside_and_stays_in_bounds():
    for size in range(1, 12):
        for crop in range(1, 12):
            low, high = min(0, size - crop), max(0, size - crop)
            for centre in range(size):
                start = random_window(size, crop, None, centre)
                assert low <= start <= high and start <= centre < start + crop
    generator = torch.Generator().manual_seed(0)
    starts = {random_window(10, 4, generator) for _ in range(200)}
    assert starts == set(range(7))


def _label_coded_pair(height=24, width=20):
    """An image whose pixels spell their label (value in every channel), blocky labels."""
    label = torch.arange(height // 4 * (width // 4)).view(height // 4, width // 4)
    label = label.repeat_interleave(4, 0).repeat_interleave(4, 1) * 7 % 200
    return label.to(torch.uint8).expand(3, -1, -1).clone(), label.long()


def test_train_transform_moves_image_and_label_together():
    image, label = _label_coded_pair()
    transform = TrainTransform((16, 30), mean=(0.0,) * 3, std=(1.0,) * 3, scale_range=(1, 1),
                               flip_probability=0.5)
    flips = set()
    for seed in range(20):
        out_image, out_label = transform(image, label, torch.Generator().manual_seed(seed))
        assert out_image.shape == (3, 16, 30) and out_label.shape == (16, 30)
        valid = out_label != IGNORE_INDEX
        assert valid.sum() == 16 * 20  # width padded from 20 to 30, height cropped
        # ToDtype scales by multiplying with 1/255: x * 255 is off by <= 1.6e-5 (measured)
        torch.testing.assert_close(out_image[0][valid] * 255, out_label[valid].float(),
                                   rtol=0, atol=2e-5)
        assert (out_image[:, ~valid] == 0).all()
        # which way round the digits run says whether it was flipped
        row = out_label[0][valid[0]]
        flips.add(bool(row[0] > row[-1]))
    assert flips == {True, False}


def _checkerboard(height, width, block, seed, stripes=None):
    """Blocks of random sizes (about 1..2 * block) coloured black or white at random, or with
    ``stripes`` ("rows" / "columns") stripes across that axis only; the label is 1 on white:
    a mask derived from the image."""
    rng = np.random.default_rng(seed)
    row_ids = np.cumsum(rng.integers(0, block, height) == 0)
    col_ids = np.cumsum(rng.integers(0, block, width) == 0)
    row_ids = row_ids * 0 if stripes == "columns" else row_ids
    col_ids = col_ids * 0 if stripes == "rows" else col_ids
    colours = rng.integers(0, 2, (row_ids.max() + 1, col_ids.max() + 1))
    label = torch.from_numpy(colours[row_ids][:, col_ids]).long()
    return (label * 255).to(torch.uint8).expand(3, -1, -1).clone(), label


@pytest.mark.parametrize("class_uniform", [0.0, 1.0])
def test_mask_derived_from_the_image_still_matches_after_scale_crop_and_flip(class_uniform):
    # Bilinear resizing blends black and white only across block edges: wherever the output
    # image is exactly black or white, its label must say so (the nearest source pixel lies in
    # the same block). torchvision's default NEAREST for masks (half a source pixel off) fails.
    transform = TrainTransform((36, 44), (0.5,) * 3, (0.5,) * 3, scale_range=(0.6, 2.5),
                               class_uniform=class_uniform)
    checked = 0
    for seed in range(24):
        image, label = _checkerboard(30, 26, 5, seed)
        out_image, out_label = transform(image, label, torch.Generator().manual_seed(seed))
        valid = out_label != IGNORE_INDEX
        assert (out_image[:, ~valid] == 0).all()  # padding: the mean
        assert torch.equal(out_image[0], out_image[2])
        # pure: within float rounding of white (1) or black (-1), a blend weight below 1e-5
        white, black = (out_image[0] - 1).abs() < 1e-5, (out_image[0] + 1).abs() < 1e-5
        pure = valid & (white | black)
        assert torch.equal(out_label[pure], white[pure].long()), seed
        checked += int(pure.sum())
        assert pure.sum() > 0.5 * valid.sum()
    assert checked > 10000


def test_upscaled_mask_takes_the_larger_bilinear_weight_of_the_image():
    # Upscaling stripes, each output pixel blends two source pixels across them; nearest by
    # pixel centre takes the one with the larger weight, so the label is white where the image
    # is closer to white. The pure-pixel test above cannot see a half-pixel shift; this one can.
    transform = TrainTransform((40, 40), (0.5,) * 3, (0.5,) * 3, scale_range=(1.2, 2.5))
    checked = 0
    for seed in range(24):
        image, label = _checkerboard(20, 18, 4, seed, ("rows", "columns")[seed % 2])
        out_image, out_label = transform(image, label, torch.Generator().manual_seed(seed))
        valid = (out_label != IGNORE_INDEX) & (out_image[0].abs() > 1e-4)  # no exact ties
        assert torch.equal(out_label[valid], (out_image[0][valid] > 0).long()), seed
        checked += int(valid.sum())
    assert checked > 10000


def test_train_transform_flip_alone_mirrors_both():
    image, label = _label_coded_pair()
    transform = TrainTransform((24, 20), (0.0,) * 3, (1.0,) * 3, scale_range=(1, 1),
                               flip_probability=1.0)
    out_image, out_label = transform(image, label, torch.Generator().manual_seed(0))
    assert torch.equal(out_label, label.flip(-1))
    torch.testing.assert_close(out_image * 255, image.flip(-1).float(), rtol=0, atol=2e-5)


def test_train_transform_scales_within_the_range():
    image, label = _label_coded_pair(16, 16)
    transform = TrainTransform(40, (0.0,) * 3, (1.0,) * 3)  # 40 > 2.0 * 16: whole image kept
    factors = []
    for seed in range(40):
        _, out_label = transform(image, label, torch.Generator().manual_seed(seed))
        valid = out_label != IGNORE_INDEX
        side = valid.any(1).sum().item()
        assert valid.sum() == side * side
        factors.append(side / 16)
        # nearest keeps label values: no new classes appear
        assert set(out_label[valid].unique().tolist()) <= set(label.unique().tolist())
    assert 0.7 - 1 / 16 <= min(factors) < 0.9 and 1.8 < max(factors) <= 2.0 + 1 / 16


def test_train_transform_is_deterministic_given_the_generator():
    canvas = DigitsCanvas(length=1).canvas(0)
    transform = TrainTransform(48, (0.5,) * 3, (0.25,) * 3, class_uniform=0.5)
    first = transform(*canvas, torch.Generator().manual_seed(3))
    second = transform(*canvas, torch.Generator().manual_seed(3))
    third = transform(*canvas, torch.Generator().manual_seed(4))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert not torch.equal(first[0], third[0])


def test_class_uniform_crops_find_a_rare_class():
    image = torch.zeros(3, 64, 64, dtype=torch.uint8)
    label = torch.zeros(64, 64, dtype=torch.long)
    label[50, 9] = 7  # one pixel of a rare class
    label[:4] = IGNORE_INDEX  # never chosen
    found = {}
    for share in (0.0, 1.0):
        transform = TrainTransform(8, (0.0,) * 3, (1.0,) * 3, scale_range=(1, 1),
                                   flip_probability=0.0, class_uniform=share)
        hits = sum(bool((transform(image, label, torch.Generator().manual_seed(s))[1] == 7)
                        .any()) for s in range(200))
        found[share] = hits / 200
    # classes {0, 7} are equally likely with class-uniform crops; a uniform crop holds the
    # pixel with probability 64 / 57^2 ~ 2 %
    assert 0.35 < found[1.0] < 0.65
    assert found[0.0] < 0.08


def test_class_uniform_pixel_draws_classes_uniformly_and_skips_ignored():
    label = torch.full((10, 10), IGNORE_INDEX)
    label[:, :9] = 0
    label[0, 9] = 3
    counts = {0: 0, 3: 0}
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        row, col = class_uniform_pixel(label, generator)
        counts[int(label[row, col])] += 1
    assert 150 < counts[3] < 250
    assert class_uniform_pixel(torch.full((3, 3), IGNORE_INDEX), generator) is None


def test_eval_transform_normalises_and_resizes_the_long_side():
    image, label = _label_coded_pair(24, 20)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.5, 0.5)
    out_image, out_label = EvalTransform(mean, std)(image, label)
    assert torch.equal(out_label, label)
    np.testing.assert_allclose(out_image.numpy(), _normalized(image, mean, std), atol=1e-6)
    out_image, out_label = EvalTransform(mean, std, long_side=48)(image, label)
    assert out_image.shape == (3, 48, 40) and out_label.shape == (48, 40)
    assert torch.equal(out_label, label.repeat_interleave(2, 0).repeat_interleave(2, 1))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"crop_size": 0}, "crop_size="), ({"scale_range": (2.0, 1.0)}, "scale_range="),
    ({"flip_probability": 1.5}, "flip_probability="), ({"class_uniform": -0.1}, "class_uniform="),
    ({"std": (1.0, 0.0, 1.0)}, "std="), ({"mean": (0.0, 0.0)}, "mean="),
])
def test_bad_transform_arguments_are_named(kwargs, message):
    arguments = {"crop_size": 8, "mean": (0.0,) * 3, "std": (1.0,) * 3, **kwargs}
    with pytest.raises(ValueError, match=message):
        TrainTransform(**arguments)


def test_mismatched_image_and_label_are_rejected():
    with pytest.raises(ValueError, match=r"image \(3, 4, 5\) and label \(4, 4\)"):
        EvalTransform((0.0,) * 3, (1.0,) * 3)(torch.zeros(3, 4, 5), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="long_side="):
        EvalTransform((0.0,) * 3, (1.0,) * 3, long_side=0)
