"""``iabn segment`` on a folder of small images with a snapshot in the original Vistas layout."""

import pytest
import torch

from iabn.models import deeplabv3_wider_resnet38
from iabn.tools.cli import main

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu

Image = pytest.importorskip("PIL.Image")
NUM_CLASSES = 3


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    torch.manual_seed(0)
    model = deeplabv3_wider_resnet38(num_classes=NUM_CLASSES, depth=16)
    path = tmp_path_factory.mktemp("snap") / "vistas_like.pth.tar"
    torch.save({"state_dict": {s: getattr(model, s).state_dict()
                               for s in ("body", "head", "cls")}}, path)
    return path


@pytest.fixture()
def images(tmp_path):
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    torch.manual_seed(1)
    for name, size in (("a.png", (40, 30)), ("b.jpg", (24, 36)), ("sub/c.png", (32, 32))):
        pixels = bytes(torch.randint(0, 256, (size[0] * size[1] * 3,)).tolist())
        Image.frombytes("RGB", size, pixels).save(root / name)
    (root / "broken.png").write_bytes(b"not an image")
    return root


def _run(snapshot, images, out, *extra):
    return main(["segment", str(snapshot), str(images), str(out), "--depth", "16",
                 "--long-side", "48", "--quiet", *extra])


def test_palette_outputs_at_input_size_and_corrupt_image_reported(snapshot, images, tmp_path,
                                                                   capsys):
    out = tmp_path / "out"
    assert _run(snapshot, images, out, "--recursive", "--scales", "0.75,1.0", "--flip") == 1
    report = capsys.readouterr().out
    assert "3 segmented" in report and "1 failed" in report and "broken.png" in report
    for name, size in (("a.png", (40, 30)), ("b.png", (24, 36)), ("sub/c.png", (32, 32))):
        with Image.open(out / name) as result:
            assert result.mode == "P" and result.size == size
            assert max(result.tobytes()) < NUM_CLASSES


def test_resume_keeps_existing_outputs_unless_overwrite(snapshot, images, tmp_path, capsys):
    out = tmp_path / "out"
    _run(snapshot, images, out)
    capsys.readouterr()
    _run(snapshot, images, out)
    assert "0 segmented, 2 already done" in capsys.readouterr().out
    _run(snapshot, images, out, "--overwrite")
    assert "2 segmented" in capsys.readouterr().out


@pytest.mark.parametrize("fusion", ["mean", "voting", "max"])
def test_raw_and_prob_outputs(snapshot, images, tmp_path, fusion):
    out = tmp_path / fusion
    _run(snapshot, images, out, "--output", "prob", "--fusion", fusion, "--scales", "0.5,1",
         "--overlay")
    with Image.open(out / "a.png") as labels, Image.open(out / "a_confidence.png") as conf:
        assert labels.mode == "L" and max(labels.tobytes()) < NUM_CLASSES
        # the chosen class's fused probability is at least 1/NUM_CLASSES for mean and max
        # fusion (a vote winner need not be the most probable class on average)
        floor = 255 // NUM_CLASSES - 1 if fusion in ("mean", "max") else 0
        assert conf.size == (40, 30) and min(conf.tobytes()) >= floor
    with Image.open(out / "a_overlay.png") as overlay:
        assert overlay.size == (80, 30)


def test_bad_snapshot_and_folder(tmp_path, images, capsys):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"garbage")
    assert main(["segment", str(bad), str(images), str(tmp_path / "o")]) == 2
    assert "cannot read snapshot" in capsys.readouterr().err
    assert main(["segment", str(bad), str(tmp_path / "nope"), str(tmp_path / "o")]) == 2


# --- palettes and label-id export (--palette, --output labelids) ---


def test_labelids_need_a_label_set_and_palettes_must_fit_the_model(snapshot, images, tmp_path,
                                                                    capsys):
    out = tmp_path / "out"
    assert _run(snapshot, images, out, "--output", "labelids") == 2
    assert "--output labelids needs the dataset's label ids" in capsys.readouterr().err
    assert _run(snapshot, images, out, "--palette", "cityscapes") == 2
    assert "predicts 3 classes but the cityscapes palette has 19" in capsys.readouterr().err
    assert _run(snapshot, images, out, "--palette", str(tmp_path / "nope.json")) == 2
    assert "not one of auto, default, cityscapes, voc" in capsys.readouterr().err
    assert not out.exists()  # refused before writing anything


def test_vistas_config_gives_colours_and_label_ids(snapshot, images, tmp_path):
    import json

    # labels 0 and 2 evaluated, 1 void: train ids 0, 1, 2 are Vistas ids 0, 2, 3
    labels = [{"name": f"l{i}", "readable": f"L{i}", "color": [10 * i, 20 * i, 30 * i],
               "evaluate": i != 1} for i in range(4)]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"labels": labels}))
    for output in ("palette", "labelids", "raw"):
        assert _run(snapshot, images, tmp_path / output, "--palette", str(config),
                    "--output", output) == 1  # broken.png
    with Image.open(tmp_path / "palette" / "a.png") as coloured:
        assert coloured.getpalette()[:9] == [0, 0, 0, 20, 40, 60, 30, 60, 90]
    with Image.open(tmp_path / "labelids" / "a.png") as ids, \
            Image.open(tmp_path / "raw" / "a.png") as raw:
        expected = bytes((0, 2, 3)[value] for value in raw.tobytes())
        assert ids.mode == "L" and ids.tobytes() == expected
    assert not list(tmp_path.rglob("*.partial"))


def test_default_long_side_follows_the_snapshot():
    from iabn.tools.segment import snapshot_long_side

    def train_seg(input_section, data_section):
        return {"task": "segmentation", "config": {"input": input_section, "data": data_section}}

    assert snapshot_long_side({"state_dict": {}})[0] == 2048  # the released Vistas model
    digits = train_seg({"long_side_val": None}, {"dataset": "auto", "root": None,
                                                 "canvas_size": 96})
    assert snapshot_long_side(digits)[0] == 96
    assert snapshot_long_side(train_seg({"long_side_val": 1024},
                                        {"dataset": "cityscapes", "root": "/d"}))[0] == 1024
    # validated at the images' own size: keep it
    assert snapshot_long_side(train_seg({"long_side_val": None},
                                        {"dataset": "auto", "root": "/d"}))[0] == 0


# --- issue 18 item 11: argument errors, --std 0, 16-bit PNGs ---


@pytest.mark.parametrize("args, message", [
    (["--std", "0"], "std must be positive"), (["--std", "0.2,0,0.2"], "std must be positive"),
    (["--mean", "1,2"], "expected 3 numbers"), (["--scales", ","], "at least one number"),
    (["--scales", "0"], "scales must be positive"), (["--mean", "nan"], "finite numbers"),
    (["--device", "foo"], "not a torch device")])
def test_bad_arguments_exit_2_with_a_message(snapshot, images, tmp_path, capsys, args,
                                              message):
    try:
        code = _run(snapshot, images, tmp_path / "out", *args)
    except SystemExit as stop:  # argparse's usage error
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_16_bit_png_is_scaled_not_clipped(snapshot, tmp_path):
    import numpy as np

    root = tmp_path / "in"
    root.mkdir()
    Image.fromarray(np.full((20, 30), 30000, np.uint16)).save(root / "grey16.png")
    assert _run(snapshot, root, tmp_path / "out", "--overlay") == 0
    with Image.open(tmp_path / "out" / "grey16_overlay.png") as overlay:
        assert overlay.getpixel((0, 0)) == (117, 117, 117)  # 30000 / 257, not white


# --- issue 18 item 7: inputs whose outputs would share a name ---


def test_same_name_with_two_extensions_keeps_both_outputs(snapshot, tmp_path, capsys):
    root = tmp_path / "in"
    root.mkdir()
    Image.new("RGB", (20, 10), (255, 0, 0)).save(root / "x.png")
    Image.new("RGB", (12, 16), (0, 0, 255)).save(root / "x.jpg")
    Image.new("RGB", (8, 8)).save(root / "y.png")
    out = tmp_path / "out"
    assert _run(snapshot, root, out) == 0
    sizes = {}
    for name in ("x_png.png", "x_jpg.png", "y.png"):
        with Image.open(out / name) as result:
            sizes[name] = result.size
    assert sizes == {"x_png.png": (20, 10), "x_jpg.png": (12, 16), "y.png": (8, 8)}
    assert not (out / "x.png").exists()
    # another clash (an input named like another's overlay) is refused before writing
    Image.new("RGB", (8, 8)).save(root / "y_overlay.png")
    assert _run(snapshot, root, tmp_path / "out2", "--overlay") == 2
    assert "y.png and y_overlay.png would both be written to" in capsys.readouterr().err
    assert not (tmp_path / "out2").exists()


def test_without_pillow_exits_2_before_any_work(snapshot, images, tmp_path, capsys,
                                                 monkeypatch):
    """The missing optional dependency is an ImportError in the library, exit 2 in the CLI
    (it was a SystemExit raised from library code)."""
    import iabn.tools.segment

    monkeypatch.setitem(__import__("sys").modules, "PIL", None)  # any import of it fails
    with pytest.raises(ImportError, match=r"pip install 'iabn\[tools\]'"):
        iabn.tools.segment._pil()
    out = tmp_path / "out"
    assert main(["segment", str(snapshot), str(images), str(out), "--depth", "16"]) == 2
    assert "reads and writes images with Pillow" in capsys.readouterr().err
    assert not out.exists()
