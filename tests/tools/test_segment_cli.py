"""``iabn segment`` on a folder of small images with a snapshot in the original Vistas layout."""

import os

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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- argument errors, --std 0, 16-bit PNGs ---


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


# --- inputs whose outputs would share a name ---


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


# --- outputs that would lose data: checked before anything is read or written ---


def _image(path, size=(12, 10), colour=(200, 30, 60)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)
    return path


@pytest.fixture()
def nothing_read(monkeypatch):
    """The snapshot (read before any image) must not be read: the run stops before."""
    import iabn.tools.segment

    def read(_path):
        raise AssertionError("the snapshot was read")

    monkeypatch.setattr(iabn.tools.segment, "read_snapshot", read)


def _files(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys, message):
    err = capsys.readouterr().err
    assert err.startswith("iabn segment: error: ") and err.count("\n") == 1, err
    assert message in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("spelling", ["same", "absolute", "dotdot", "symlink", "slash"])
@pytest.mark.parametrize("extra", [[], ["--overwrite"], ["--recursive", "--overwrite"]])
def test_out_dir_equal_to_in_dir_is_refused(snapshot, tmp_path, monkeypatch, capsys,
                                            nothing_read, spelling, extra):
    root = tmp_path / "in"
    _image(root / "a.png")
    _image(root / "sub" / "b.png")
    (root / "x.jpg").write_bytes((root / "a.png").read_bytes())  # x.jpg -> x.png: no clash
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link").symlink_to(root)
    out = {"same": "in", "absolute": str(root), "dotdot": "in/sub/..", "symlink": "link",
           "slash": "in/"}[spelling]
    before = _files(root)
    assert _run(snapshot, "in", out, *extra) == 2
    _refused(capsys, "is IN_DIR in: the outputs would replace the images")
    assert _files(root) == before


@pytest.mark.slow
def test_out_dir_inside_a_recursive_in_dir_is_left_out_of_the_walk(snapshot, tmp_path,
                                                                   capsys):
    root = tmp_path / "in"
    _image(root / "a.png")
    _image(root / "sub" / "b.png")
    out = root / "out"
    assert _run(snapshot, root, out, "--recursive") == 0
    captured = capsys.readouterr()
    assert f"OUT_DIR {out} is inside IN_DIR {root}: its files are not read" in captured.err
    assert "2 segmented" in captured.out
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png")) == [
        "a.png", "sub/b.png"]
    # the second run reads the same two images, not its own outputs (no out/out/a.png)
    assert _run(snapshot, root, out, "--recursive") == 0
    assert "0 segmented, 2 already done" in capsys.readouterr().out
    assert not (out / "out").exists()


def test_out_dir_inside_a_flat_in_dir_is_not_read(snapshot, tmp_path, capsys):
    root = tmp_path / "in"
    _image(root / "a.png")
    out = root / "out"
    assert _run(snapshot, root, out) == 0
    assert _run(snapshot, root, out) == 0
    assert "0 segmented, 1 already done" in capsys.readouterr().out.splitlines()[-1]
    assert sorted(p.name for p in out.iterdir()) == ["a.png"]


def test_outputs_that_land_in_the_input_walk_are_refused(snapshot, tmp_path, capsys,
                                                         nothing_read):
    # IN_DIR inside OUT_DIR: in/imgs/y.png would be written to out/imgs/y.png, an input, and
    # in/z.png to out/z.png, beside the input folder (replacing what is there)
    out = tmp_path / "out"
    root = out / "imgs"
    _image(root / "imgs" / "y.png")
    _image(root / "z.png")
    before = _files(out)
    for extra in ([], ["--recursive"], ["--recursive", "--overwrite"]):
        assert _run(snapshot, root, out, *extra) == 2
        _refused(capsys, f"OUT_DIR {out} contains IN_DIR {root}")
    assert _files(out) == before
    # an output subfolder that is a link into IN_DIR
    root2, out2 = tmp_path / "in2", tmp_path / "out2"
    _image(root2 / "sub" / "c.jpg")
    out2.mkdir()
    (out2 / "sub").symlink_to(root2 / "sub")
    assert _run(snapshot, root2, out2, "--recursive") == 2
    _refused(capsys, "would be read as images")
    assert sorted(p.name for p in (root2 / "sub").iterdir()) == ["c.jpg"]


@pytest.mark.parametrize("link", ["hard", "symbolic"])
def test_an_output_that_is_an_input_by_another_name_is_refused(snapshot, tmp_path, capsys,
                                                                nothing_read, link):
    root, out = tmp_path / "in", tmp_path / "out"
    image = _image(root / "a.png")
    out.mkdir()
    if link == "hard":
        os.link(image, out / "a.png")
    else:
        (out / "a.png").symlink_to(image)
    before = image.read_bytes()
    for extra in ([], ["--overwrite"]):
        assert _run(snapshot, root, out, *extra) == 2
        _refused(capsys, f"output {out / 'a.png'} of a.png is the input {image}")
    assert image.read_bytes() == before


def test_outputs_that_cannot_be_written_are_refused_before_work(snapshot, tmp_path, capsys,
                                                                nothing_read):
    root, out = tmp_path / "in", tmp_path / "out"
    _image(root / "a.png")
    _image(root / "sub" / "b.png")
    (out / "a.png").mkdir(parents=True)  # a folder where an output goes
    assert _run(snapshot, root, out, "--recursive") == 2
    _refused(capsys, f"output {out / 'a.png'} exists and is not a file")
    (out / "a.png").rmdir()
    (out / "sub").write_text("a file where an output folder goes")
    assert _run(snapshot, root, out, "--recursive") == 2
    _refused(capsys, f"cannot make the output folder {out / 'sub'}: {out / 'sub'} is a file")
    assert sorted(p.name for p in out.iterdir()) == ["sub"]


def test_a_missing_parent_of_out_dir_is_refused_not_created(snapshot, images, tmp_path,
                                                            capsys, nothing_read):
    out = tmp_path / "missing" / "out"
    assert _run(snapshot, images, out) == 2
    _refused(capsys, f"folder {tmp_path / 'missing'} does not exist; create it first")
    assert not (tmp_path / "missing").exists()


def test_a_folder_without_images_is_a_user_error(snapshot, tmp_path, capsys, nothing_read):
    root = tmp_path / "in"
    root.mkdir()
    (root / "notes.txt").write_text("")
    assert _run(snapshot, root, tmp_path / "out") == 2
    _refused(capsys, "no images in IN_DIR")
    _image(root / "deeper" / "a.PNG")
    _image(root / "deeper" / "b.jpeg")
    assert _run(snapshot, root, tmp_path / "out") == 2
    _refused(capsys, ".png, .jpg, .jpeg files (any case); its subfolders hold 2: add "
             "--recursive")
    assert not (tmp_path / "out").exists()


def test_a_full_disk_stops_with_one_line_and_keeps_finished_outputs(snapshot, tmp_path,
                                                                    monkeypatch, capsys):
    import full_disk

    root, out = tmp_path / "in", tmp_path / "out"
    for name in ("a.png", "b.png", "c.png"):
        _image(root / name)
    real_replace = os.replace

    def replace_then_fill(source, target):
        real_replace(source, target)
        full_disk.install(monkeypatch)  # the disk is full after the first output

    monkeypatch.setattr(os, "replace", replace_then_fill)
    assert _run(snapshot, root, out) == 2
    monkeypatch.undo()
    err = _refused(capsys, "cannot write the outputs of b.png in")
    assert "No space left on device; 1 images segmented before it are kept" in err
    assert sorted(os.listdir(out)) == ["a.png"]  # whole, and no temporary file
    with Image.open(out / "a.png") as result:
        assert result.size == (12, 10)


def test_an_empty_out_dir_or_an_unreadable_subfolder_is_refused(snapshot, tmp_path, capsys,
                                                                monkeypatch, nothing_read):
    root = tmp_path / "in"
    _image(root / "a.png")
    _image(root / "sub" / "b.png")
    assert _run(snapshot, root, "") == 2  # not the current folder
    _refused(capsys, "OUT_DIR: empty path")
    real_scandir = os.scandir

    def scandir(path="."):  # as for a folder without read permission (tests may run as root)
        if os.fspath(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert _run(snapshot, root, tmp_path / "out", "--recursive") == 2
    _refused(capsys, f"cannot read {root / 'sub'}: Permission denied")
