"""The tools under bad input and faults (user errors exit 2 with one line, nothing
written; concurrent runs; signals; corrupt files)."""

import json
import os
import re

import pytest

from iabn.tools.cli import main
from iabn.tools.training.engine import EXIT_FINISHED, TrainOptions, train
from iabn.tools.training.logdir import LogDirError, LogDirLock
from test_train_engine import ToyTask, toy_config
from train_tiny import write_config

from helpers import one_line_error

pytestmark = pytest.mark.without_gpu


# --- item 8: an unwritable log directory is a user error (exit 2, one line) ---


@pytest.mark.parametrize("command", ["train", "train-seg"])
def test_log_dir_under_a_file_exits_2_with_one_line(tmp_path, capsys, command):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    config = write_config(tmp_path / "c.json") if command == "train" else (
        tmp_path / "s.json")
    if command == "train-seg":
        config.write_text(json.dumps({"data": {"workers": 0}}))
    assert main([command, str(config), "--log-dir", str(blocker / "run")]) == 2
    assert "is a file, not a folder" in one_line_error(capsys, command)


def test_unwritable_log_dir_is_refused_before_writing(tmp_path, monkeypatch):
    # as if read-only (the tests may run as root, who may write anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(LogDirError, match="no permission to write in"):
        train(ToyTask(), toy_config(), TrainOptions(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# --- item 5: two runs in one log directory ---


@pytest.mark.parametrize("resume", [False, True])
def test_a_log_dir_in_use_is_refused_naming_the_holder(tmp_path, resume):
    config = toy_config()
    run = tmp_path / "run"
    if resume:
        train(ToyTask(), config, TrainOptions(run, stop_after_steps=2))
    lock = LogDirLock(run)
    lock.acquire()  # another run holds the folder (flock conflicts across open files)
    try:
        files = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
        with pytest.raises(LogDirError,
                           match=rf"in use by another run, still running \(pid {os.getpid()} "):
            train(ToyTask(), config,
                  TrainOptions(run, resume=run / "last.pth" if resume else None))
        assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == files
    finally:
        lock.release()
    # released: the folder can be used again (and a finished run releases it too)
    assert train(ToyTask(), config, TrainOptions(
        run, resume=run / "last.pth" if resume else None)) == EXIT_FINISHED
    again = LogDirLock(run)
    again.acquire()
    again.release()


# --- item 9: non-finite or negative learning rates and clip norms in config files ---


@pytest.mark.parametrize("text", [
    '"lr": NaN', '"lr": Infinity', '"lr": -0.1', '"clip_grad_norm": NaN',
    '"clip_grad_norm": -Infinity', '"betas": [NaN, 0.999]'])
def test_non_finite_or_negative_optimizer_values_in_a_file_exit_2(tmp_path, capsys, text):
    config = tmp_path / "c.json"
    write_config(config)
    data = json.loads(config.read_text())
    config.write_text(json.dumps(data)[:-1] + ', "optimizer": {' + text + '}}')
    assert main(["train", str(config), "--log-dir", str(tmp_path / "run")]) == 2
    err = one_line_error(capsys, "train")
    assert "must be a finite number" in err or "must be at least 0.0" in err
    assert not (tmp_path / "run").exists()


# --- item 10: an empty batch (N = 0) when training ---


@pytest.mark.parametrize("layer", ["InPlaceABN", "ABN", "InPlaceABNSync"])
@pytest.mark.filterwarnings("ignore:InPlaceABNSync runs without")
def test_empty_training_batch_is_refused_before_anything_is_counted(layer):
    import torch

    import iabn

    module = getattr(iabn, layer)(3)
    module.train()
    state = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=r"empty input of shape \(0, 3, 4, 4\) when training"):
        module(torch.randn(0, 3, 4, 4))
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in state.items())
    module.eval()  # normalising with running statistics: an empty output, as nn.BatchNorm2d
    assert module(torch.randn(0, 3, 4, 4)).shape == (0, 3, 4, 4)


# --- item 4: SIGTERM to the whole process group (job schedulers, torchrun) ---


@pytest.mark.slow
def test_sigterm_to_the_process_group_still_writes_the_snapshot(tmp_path):
    import signal
    import subprocess
    import time

    from train_tiny import environment, iabn_command

    config = write_config(tmp_path / "c.json", data={"workers": 2},
                          schedule={"epochs": 2, "max_steps_per_epoch": 400})
    run = tmp_path / "run"
    process = subprocess.Popen(iabn_command("train", str(config), "--log-dir", str(run)),
                               env=environment(), start_new_session=True, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    log = run / "logs" / "rank0.log"
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and "epoch 1/2 [" in log.read_text()):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr
            time.sleep(0.1)
        os.killpg(process.pid, signal.SIGTERM)  # the workers get it too
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 3, err
    assert (run / "last.pth").is_file() and "Traceback" not in err


# --- item 3: the progress line fits the terminal ---


class _Terminal:
    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_progress_line_fits_the_terminal_and_is_plain_elsewhere(monkeypatch):
    import io
    import shutil

    from iabn.tools.training.progress import ProgressLine

    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: os.terminal_size((80, 24)))
    terminal = _Terminal()
    line = ProgressLine(True, terminal)
    line.show("x" * 318)
    line.show("short")
    line.end()
    shown = terminal.text.split("\r")[1:]
    assert all(len(part.rstrip("\n")) <= 79 for part in shown), [len(p) for p in shown]
    assert shown[0].endswith("...") and shown[1].startswith("short")
    plain = io.StringIO()  # not a terminal: whole lines, one per update
    line = ProgressLine(True, plain)
    line.show("x" * 318)
    assert plain.getvalue() == "x" * 318 + "\n"


def test_segmentation_progress_leaves_out_per_class_iou():
    from iabn.tools.training.engine import _format_metrics

    metrics = {"loss": 0.5, "miou": 40.0, "count": 3.0, "iou/background": 90.0}
    assert _format_metrics(metrics, per_class=False) == "loss 0.5 miou 40"
    assert "iou/background 90" in _format_metrics(metrics)


# --- item 6: TensorBoard curves of a stopped and resumed run ---


@pytest.mark.parametrize("stop_at", [3, 4])  # 4: the end of epoch 1 (validated there)
def test_resumed_tensorboard_curves_equal_an_uninterrupted_run(tmp_path, stop_at):
    pytest.importorskip("tensorboard")
    from train_tiny import tensorboard_scalars

    config = toy_config(logging={"tensorboard": True, "log_every": 1})
    train(ToyTask(), config, TrainOptions(tmp_path / "whole"))
    run = tmp_path / "run"
    train(ToyTask(), config, TrainOptions(run, stop_after_steps=stop_at))
    train(ToyTask(), config, TrainOptions(run, resume=run / "last.pth"))
    whole, resumed = tensorboard_scalars(tmp_path / "whole"), tensorboard_scalars(run)
    for tag in ("train/loss", "train/lr", "val/loss"):
        assert [step for step, _ in resumed[tag]] == [step for step, _ in whole[tag]], tag
        assert [value for _, value in resumed[tag]] == pytest.approx(
            [value for _, value in whole[tag]]), tag


# --- item 12: a bit-flipped snapshot ---


def test_a_bit_flipped_last_snapshot_falls_back_to_the_previous_one(tmp_path, capsys):
    import torch

    from iabn.tools.training.snapshot import SnapshotError, read_snapshot

    config = toy_config()
    run = tmp_path / "run"
    train(ToyTask(), config, TrainOptions(run, stop_after_steps=6))  # epoch 1 end, then step 6
    last = run / "last.pth"
    assert torch.load(run / "previous.pth", weights_only=True)["global_step"] == 4
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit, somewhere in the tensors
    last.write_bytes(bytes(data))
    snapshot = read_snapshot(last)
    assert snapshot["global_step"] == 4
    err = capsys.readouterr().err
    assert "last.pth (corrupt: its SHA-256 does not match" in err and "previous.pth" in err
    # the resumed run ends where an uninterrupted one does
    assert train(ToyTask(), config, TrainOptions(run, resume=last)) == EXIT_FINISHED
    train(ToyTask(), config, TrainOptions(tmp_path / "whole"))
    whole = torch.load(tmp_path / "whole" / "last.pth", weights_only=True)["model"]
    again = torch.load(last, weights_only=True)["model"]
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    # no good snapshot to fall back to: the error names the file
    (run / "previous.pth").write_bytes(b"")
    last.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"last\.pth \(corrupt: its SHA-256"):
        read_snapshot(last)


# --- item 13: benchmarks leave the committed results alone ---


@pytest.mark.slow
def test_benchmarks_write_to_runs_unless_asked_and_git_ignores_runs(tmp_path, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    from iabn.tools.bench import results_folder

    root = Path(__file__).resolve().parents[2]
    committed = root / "benchmarks" / "results" / "slope_errors_cpu.json"
    before = committed.read_bytes()
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "slope_errors.py"),
                           "--device", "cpu", "--shapes", "2x3x8x8", "--dtypes", "float32",
                           "--layouts", "nchw", "--seeds", "0"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs" / "benchmarks" / "slope_errors_cpu.json").is_file()
    assert committed.read_bytes() == before
    monkeypatch.setenv("IABN_COMMIT_RESULTS", "1")
    assert results_folder(committed.parent) == committed.parent
    assert "runs/" in (root / ".gitignore").read_text().split()


# --- item 8, continued: the other tools' output paths ---


def test_unwritable_outputs_of_bench_test_and_segment_exit_2_with_one_line(tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    config = write_config(tmp_path / "c.json")
    (tmp_path / "in").mkdir()
    cases = {
        "bench": ["bench", "--json", str(blocker / "x.json"), "--quiet"],
        "test": ["test", str(config), str(tmp_path / "none.pth"), "--json",
                 str(blocker / "x.json")],
        "segment": ["segment", str(tmp_path / "none.pth"), str(tmp_path / "in"),
                    str(blocker / "out")],
    }
    for command, argv in cases.items():
        assert main(argv) == 2, command
        assert "afile is a file, not a folder" in one_line_error(capsys, command)


# --- every reader of a checkpoint: its checksum file, non-finite tensors, one line ---


def _one_image(folder):
    """A folder holding one small PNG (segment reads the images before the snapshot)."""
    from PIL import Image

    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    return folder


def _with_checksum(path, payload):
    """``payload`` saved at ``path`` with its ``.sha256`` file, as snapshots are written."""
    import hashlib

    import torch

    torch.save(payload, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
    return path


def test_test_and_segment_check_the_checksum_file_and_refuse_text(tmp_path, capsys):
    import torch

    config = write_config(tmp_path / "c.json")
    _one_image(tmp_path / "in")
    weights = _with_checksum(tmp_path / "w.pth", {"w": torch.arange(1000.0)})
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit flipped, after the checksum was written
    weights.write_bytes(bytes(data))
    text = tmp_path / "notes.pth"
    text.write_text("these are notes, not weights\n")
    for command, argv in {
        "test": ["test", str(config), str(weights)],
        "segment": ["segment", str(weights), str(tmp_path / "in"), str(tmp_path / "out")],
    }.items():
        assert main(argv) == 2, command
        assert "corrupt: its SHA-256 does not match w.pth.sha256" in one_line_error(capsys,
                                                                                      command)
    for command, argv in {
        "test": ["test", str(config), str(text)],
        "segment": ["segment", str(text), str(tmp_path / "in"), str(tmp_path / "out")],
    }.items():
        assert main(argv) == 2, command
        err = one_line_error(capsys, command)  # torch's advice spans 4 lines; one is kept
        assert "notes.pth (corrupt, truncated or not a torch file)" in err


@pytest.mark.parametrize("command", ["test", "segment", "resume"])
def test_a_checkpoint_holding_a_nan_is_refused_naming_the_tensor(tmp_path, capsys, command):
    """A snapshot whose weights hold a NaN, its checksum regenerated: every reader refuses it
    (exit 2, naming the file and the tensor), where resuming used to run and then blame the
    learning rate."""
    import torch

    config = toy_config()
    run = tmp_path / "run"
    train(ToyTask(), config, TrainOptions(run, stop_after_steps=6))
    last = run / "last.pth"
    snapshot = torch.load(last, weights_only=True)
    name = next(k for k, v in snapshot["model"].items() if v.is_floating_point())
    snapshot["model"][name].view(-1)[0] = float("nan")
    _with_checksum(last, snapshot)
    where = f"['model'][{name!r}]"
    if command == "resume":
        (run / "previous.pth").unlink()  # nothing earlier to fall back to
        from iabn.tools.training.snapshot import SnapshotError

        with pytest.raises(SnapshotError, match=re.escape(f"holds a NaN or an infinity in "
                                                           f"{where}")):
            train(ToyTask(), config, TrainOptions(run, resume=last))
        return
    argv = (["test", str(write_config(tmp_path / "c.json")), str(last)] if command == "test"
            else ["segment", str(last), str(_one_image(tmp_path / "in")), str(tmp_path / "out")])
    assert main(argv) == 2
    err = one_line_error(capsys, command)
    assert "last.pth holds a NaN or an infinity in" in err and name in err


# --- a snapshot that loads but lacks a top-level entry ---


def _without(path, key):
    """``path``'s snapshot rewritten without ``key``, its checksum file matching."""
    import torch

    payload = torch.load(path, weights_only=True)
    del payload[key]
    return _with_checksum(path, payload)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights at the end of the toy run, trained without a stop."""
    import torch

    run = tmp_path_factory.mktemp("whole")
    train(ToyTask(), toy_config(), TrainOptions(run))
    return torch.load(run / "last.pth", weights_only=True)["model"]


@pytest.mark.parametrize("key", ["optimizer", "scheduler", "model", "ranks"])
def test_resume_from_a_snapshot_without_an_entry_falls_back_to_the_previous_one(
        tmp_path, capsys, key, uninterrupted):
    """last.pth lacking an entry, its checksum matching: resuming says so and continues from
    previous.pth, as from a corrupt last.pth, and ends where an uninterrupted run does; with
    no previous.pth the error names the entry (the engine's restore raised KeyError)."""
    import torch

    from iabn.tools.training.snapshot import SnapshotError

    config = toy_config()
    run = tmp_path / "run"
    train(ToyTask(), config, TrainOptions(run, stop_after_steps=6))  # epoch 1 end, then step 6
    last = _without(run / "last.pth", key)
    capsys.readouterr()
    assert train(ToyTask(), config, TrainOptions(run, resume=last)) == EXIT_FINISHED
    err = capsys.readouterr().err
    assert f"has no '{key}' entry, which resuming reads" in err and "previous.pth" in err
    again = torch.load(last, weights_only=True)["model"]
    assert all(torch.equal(uninterrupted[k], again[k]) for k in uninterrupted)
    _without(last, key)
    (run / "previous.pth").unlink()
    with pytest.raises(SnapshotError, match=rf"last\.pth is marked as an iabn training "
                                            rf"snapshot but has no '{key}' entry"):
        train(ToyTask(), config, TrainOptions(run, resume=last))


def _training_snapshot(path, **entries):
    """A file marked as an iabn training snapshot, with a matching checksum file."""
    from iabn.tools.training.snapshot import FORMAT, VERSION

    return _with_checksum(path, {"format": FORMAT, "version": VERSION, **entries})


def test_test_and_segment_name_a_missing_entry_in_one_line(tmp_path, capsys):
    """The readers of a training snapshot's weights refuse one without the entry they read,
    in one line naming the file and the entry: 'iabn test' raised KeyError there, 'iabn
    segment' said only "error: 'model'" (exit 2)."""
    from iabn.tools.training.config import defaults
    from iabn.tools.training.evaluate import load_weights
    from iabn.tools.training.segmentation import SegmentationTask
    from iabn.tools.training.snapshot import SnapshotError

    best = _training_snapshot(tmp_path / "best.pth", task="classification", config={})
    # what 'iabn test' calls before it touches the model (its SnapshotError: exit 2)
    with pytest.raises(SnapshotError, match=r"best\.pth is marked as an iabn training snapshot "
                                            r"but has no 'model' entry, which evaluating its "
                                            r"weights reads"):
        load_weights(None, best)

    seg_config = defaults(SegmentationTask().schema)
    seg = _training_snapshot(tmp_path / "seg.pth", task="segmentation", config=seg_config)
    argv = ["segment", str(seg), str(_one_image(tmp_path / "in")), str(tmp_path / "out")]
    assert main(argv) == 2
    assert "seg.pth is marked as an iabn training snapshot but has no 'model' entry, which " \
           "iabn segment reads" in one_line_error(capsys, "segment")
    _training_snapshot(seg, task="classification", config={}, model={})
    assert main(argv) == 2
    assert "seg.pth is from an iabn 'classification' run" in one_line_error(capsys, "segment")


@pytest.mark.slow
def test_train_resume_and_test_commands_name_a_missing_entry_in_one_line(tmp_path, capsys):
    """The commands themselves (exit 2, one line; ~4 s on 2 cores: each builds its data and
    model before reading the file)."""
    import torch

    config = write_config(tmp_path / "c.json")
    run = tmp_path / "run"
    run.mkdir()
    _training_snapshot(run / "last.pth", task="classification", config={}, world_size=1,
                       model={"w": torch.ones(2)})
    assert main(["train", str(config), "--log-dir", str(run), "--resume"]) == 2
    err = one_line_error(capsys, "train")
    assert "last.pth is marked as an iabn training snapshot but has no 'epoch', " in err
    assert "'optimizer'" in err and "'ranks' entries, which resuming reads" in err
    best = _training_snapshot(tmp_path / "best.pth", task="classification", config={})
    assert main(["test", str(config), str(best)]) == 2
    assert "best.pth is marked as an iabn training snapshot but has no 'model' entry, " \
           "which evaluating its weights reads" in one_line_error(capsys, "test")
