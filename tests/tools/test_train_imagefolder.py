"""ImageFolder data: class mapping, image discovery, and layout errors that say what to fix."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from iabn.tools.data.imagefolder import DataLayoutError, ImageFolder, read_rgb, train_val_folders


def _save(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((6, 7), value, np.uint8)).save(path)


@pytest.fixture
def root(tmp_path):
    for split, count in (("train", 3), ("val", 1)):
        for value, name in ((10, "cat"), (200, "ant")):
            for i in range(count):
                _save(tmp_path / split / name / f"{i}.png", value)
    _save(tmp_path / "train" / "cat" / "nested" / "deep.JPG", 10)
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    return tmp_path


def test_classes_are_sorted_folders_and_images_are_found_recursively(root):
    train, val = train_val_folders(root)
    assert train.classes == val.classes == ["ant", "cat"]
    assert len(train) == 7 and len(val) == 2
    labels = [label for _, label in train.samples]
    assert labels == [0, 0, 0, 1, 1, 1, 1]
    assert any(Path(path).name == "deep.JPG" for path, _ in train.samples)
    image, label = train[6]
    assert image.dtype == torch.uint8 and image.shape == (3, 6, 7) and label == 1
    assert image[:, 0, 0].tolist() == [10, 10, 10]


def test_validation_may_lack_a_class_but_keeps_training_labels(root):
    for path in (root / "val" / "ant").iterdir():
        path.unlink()
    (root / "val" / "ant").rmdir()
    train, val = train_val_folders(root)
    assert val.classes == train.classes and [label for _, label in val.samples] == [1]


@pytest.mark.parametrize(("change", "match"), [
    (lambda r: (r / "val" / "bee").mkdir(), r"val has class folders the training data does "
                                             r"not: bee"),
    (lambda r: (r / "train" / "empty").mkdir(), r"class folder .*train/empty has no images"),
    (lambda r: [p.unlink() for p in (r / "val" / "ant").iterdir()],
     r"class folder .*val/ant has no images"),
])
def test_layout_errors_name_the_folder(root, change, match):
    change(root)
    with pytest.raises(DataLayoutError, match=match):
        train_val_folders(root)


def test_missing_folders_are_reported(tmp_path):
    with pytest.raises(DataLayoutError, match="is not a folder"):
        train_val_folders(tmp_path / "nowhere")
    with pytest.raises(DataLayoutError, match=r"train is not a folder: expected .*CLASS/IMAGE"):
        train_val_folders(tmp_path)
    (tmp_path / "train").mkdir()
    with pytest.raises(DataLayoutError, match="has no class sub-folders"):
        train_val_folders(tmp_path)


def test_unreadable_image_names_its_path(tmp_path):
    broken = tmp_path / "split" / "a" / "broken.jpg"
    broken.parent.mkdir(parents=True)
    broken.write_bytes(b"not a jpeg")
    with pytest.raises(OSError, match=r"cannot read image .*broken\.jpg"):
        ImageFolder(tmp_path / "split")[0]


def test_images_decode_to_rgb_uint8_from_8_and_16_bit_files(tmp_path):
    rng = np.random.default_rng(0)
    colour = rng.integers(0, 256, (5, 4, 3), dtype=np.uint8)
    Image.fromarray(colour).save(tmp_path / "colour.png")
    Image.fromarray(colour).save(tmp_path / "colour.bmp")  # Pillow's path: no torchvision BMP
    Image.fromarray(np.concatenate([colour, colour[..., :1]], -1)).save(tmp_path / "rgba.png")
    Image.fromarray(colour[..., 0]).save(tmp_path / "grey.png")
    # 16-bit grey: multiples of 257 so the 8-bit value is exact (v / 257 == v >> 8).
    Image.fromarray(colour[..., 0].astype(np.uint16) * 257).save(tmp_path / "grey16.png")
    want = torch.from_numpy(colour.transpose(2, 0, 1).copy())
    grey = want[:1].expand(3, -1, -1)
    for name, expected in (("colour.png", want), ("colour.bmp", want), ("rgba.png", want),
                           ("grey.png", grey), ("grey16.png", grey)):
        got = read_rgb(tmp_path / name)
        assert got.dtype == torch.uint8, name
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


def test_16_bit_png_keeps_its_high_byte_not_a_clipped_value(tmp_path):
    # Pillow's convert("RGB") of a 16-bit image clips at 255; the decoder must scale instead.
    values = np.array([[0, 256, 4096], [32768, 65280, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")
    got = read_rgb(tmp_path / "deep.png")
    assert got[0].tolist() == [[0, 1, 16], [128, 255, 255]]
