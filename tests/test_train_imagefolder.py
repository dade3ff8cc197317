"""ImageFolder data: class mapping, image discovery, and layout errors that say what to fix."""

import numpy as np
import pytest
from PIL import Image

from iabn.data.imagefolder import DataLayoutError, ImageFolder, train_val_folders


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
    assert any(path.name == "deep.JPG" for path, _ in train.samples)
    image, label = train[6]
    assert image.mode == "RGB" and image.size == (7, 6) and label == 1
    assert np.asarray(image)[0, 0].tolist() == [10, 10, 10]


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
