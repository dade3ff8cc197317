"""``iabn train`` / ``train-seg`` / ``test`` under faults: divergence, full disks, unwritable or
odd outputs, interrupts, bad values and devices. Every user error is one line on stderr with
exit status 2, found before anything is written; failures while training exit 1 and leave the
snapshots on disk as they were."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from iabn.tools.cli import main
from iabn.tools.training import engine, snapshot
from iabn.tools.training.engine import (
    EXIT_FAILED,
    EXIT_FINISHED,
    EXIT_INTERRUPTED,
    TrainingFailed,
    TrainOptions,
    train,
)
from iabn.tools.training.snapshot import read_snapshot
from test_train_engine import ToyTask, toy_config
from test_train_seg import TINY_SEG
from train_tiny import environment, one_torch_thread, tensorboard_scalars, write_config

from helpers import one_line_error

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu


def _files(folder):
    """Every file under ``folder`` with its bytes (what a failed run must leave alone)."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


def _assert_same_weights(a, b):
    first, second = _weights(a), _weights(b)
    assert [k for k in first if not torch.equal(first[k], second[k])] == []


# --- a diverged run ends as a failure, and never writes its non-finite model ---


def test_diverging_classifier_stops_at_the_first_non_finite_loss(tmp_path, capsys):
    config = write_config(tmp_path / "c.json", optimizer={"lr": 1e30})
    run = tmp_path / "run"
    with one_torch_thread():
        code = main(["train", str(config), "--log-dir", str(run)])
    assert code == EXIT_FAILED
    err = one_line_error(capsys, "train")
    assert "training diverged: the training loss is nan at step 2" in err, err
    assert "learning rate 3.732e+29" in err  # 1e30 at the warm-up's first steps
    assert "the last good snapshot is none" in err
    assert not list(run.glob("*.pth"))


def test_diverging_segmenter_stops_too(tmp_path, capsys):
    config = tmp_path / "s.json"
    config.write_text(json.dumps({**TINY_SEG, "optimizer": {"type": "sgd", "lr": 1e30},
                                  "data": {**TINY_SEG["data"], "canvas_train": 8},
                                  "logging": {"progress": False}}))
    with one_torch_thread():
        code = main(["train-seg", str(config), "--log-dir", str(tmp_path / "run")])
    assert code == EXIT_FAILED
    assert "training diverged: the training loss is" in one_line_error(capsys, "train-seg")
    assert not list((tmp_path / "run").glob("*.pth"))


class _Diverging(ToyTask):
    """The toy task whose loss turns NaN at training forward ``nan_at``, or whose output bias
    turns infinite at ``inf_at`` (after the forward used it: the loss stays finite)."""

    def __init__(self, nan_at=None, inf_at=None):
        super().__init__()
        self.nan_at, self.inf_at = nan_at, inf_at

    def forward(self, model, inputs):
        outputs = super().forward(model, inputs)
        if model.training and self.training_forwards == self.inf_at:
            with torch.no_grad():
                model[2].bias.fill_(float("inf"))
        if model.training and self.training_forwards == self.nan_at:
            outputs = outputs * float("nan")
        return outputs


@pytest.mark.parametrize(("task", "what"), [
    # forwards counted from the resumed run's first step, step 6
    (_Diverging(nan_at=1), "the training loss is nan at step 6"),
    # the last step of epoch 2: finite loss, infinite weights, caught at the snapshot
    (_Diverging(inf_at=3), "after step 8 weight 2.bias is not finite"),
])
def test_a_diverged_run_leaves_the_last_good_snapshots_alone(tmp_path, task, what):
    run = tmp_path / "run"
    train(ToyTask(), toy_config(), TrainOptions(run, device="cpu", stop_after_steps=5))
    before = _files(run)
    with pytest.raises(TrainingFailed) as failure:
        train(task, toy_config(), TrainOptions(run, resume=run / "last.pth", device="cpu"))
    message = str(failure.value)
    assert what in message, message
    assert f"the last good snapshot is {run / 'last.pth'} (step 5)" in message
    after = _files(run)
    assert {k: v for k, v in after.items() if k.suffix in (".pth", ".sha256")} == {
        k: v for k, v in before.items() if k.suffix in (".pth", ".sha256")}


def test_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    from iabn.tools.training.classification import ClassificationTask

    def exhausted(self, model, inputs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(ClassificationTask, "forward", exhausted)
    config = write_config(tmp_path / "c.json")
    assert main(["train", str(config), "--log-dir", str(tmp_path / "run")]) == EXIT_FAILED
    err = one_line_error(capsys, "train")
    assert "out of memory on cpu (CUDA out of memory. Tried to allocate 20.00 GiB)" in err
    assert "lower data.batch_size" in err and not list((tmp_path / "run").glob("*.pth"))


# --- checksums that pass their own check ---


def test_every_checksum_file_passes_sha256sum_c(tmp_path):
    run = tmp_path / "run"
    train(ToyTask(), toy_config(), TrainOptions(run, device="cpu"))  # 3 epochs: rotations
    checksums = sorted(p.name for p in run.glob("*.sha256"))
    assert checksums == ["best.pth.sha256", "last.pth.sha256", "previous.pth.sha256"]
    if shutil.which("sha256sum"):
        done = subprocess.run(["sha256sum", "-c", *checksums], cwd=run, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    import hashlib

    for name in checksums:  # the same check, as sha256sum -c reads the file: DIGEST  NAME
        digest, listed = (run / name).read_text().split()
        assert listed == name.removesuffix(".sha256")
        assert hashlib.sha256((run / listed).read_bytes()).hexdigest() == digest
    # previous.pth is still checked: a flipped bit in it is found
    data = bytearray((run / "previous.pth").read_bytes())
    data[len(data) // 2] ^= 1
    (run / "previous.pth").write_bytes(bytes(data))
    with pytest.raises(Exception, match="corrupt"):
        read_snapshot(run / "previous.pth")


# --- TensorBoard: no points of a dead run, none lost or repeated on resume ---


def test_a_fresh_start_sets_the_dead_runs_tensorboard_events_aside(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    config = toy_config(logging={"tensorboard": True, "log_every": 1})
    train(ToyTask(), config, TrainOptions(tmp_path / "whole", device="cpu"))
    run = tmp_path / "run"
    # a run that died before its first snapshot: its events, no snapshot
    train(ToyTask(), config, TrainOptions(run, device="cpu", stop_after_steps=3))
    for path in run.glob("*.pth*"):
        path.unlink()
    capsys.readouterr()
    assert train(ToyTask(), config, TrainOptions(run, device="cpu")) == EXIT_FINISHED
    out = capsys.readouterr().out
    assert "moved the TensorBoard events of an earlier run here" in out
    whole, again = tensorboard_scalars(tmp_path / "whole"), tensorboard_scalars(run)
    for tag in ("train/loss", "val/loss"):
        assert [step for step, _ in again[tag]] == [step for step, _ in whole[tag]], tag
    [aside] = run.glob("tensorboard.abandoned-*")
    assert [s for s, _ in tensorboard_scalars_in(aside)["train/loss"]] == [1, 2, 3]


def tensorboard_scalars_in(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_points_are_on_disk_before_each_snapshot(tmp_path, monkeypatch):
    """A run killed right after a snapshot resumes after its step: the points up to that
    step must already be in the event file (the writer's thread may lag behind)."""
    pytest.importorskip("tensorboard")
    import time

    from tensorboard.summary.writer import record_writer

    write = record_writer.RecordWriter.write
    monkeypatch.setattr(record_writer.RecordWriter, "write",
                        lambda self, data: (time.sleep(0.02), write(self, data))[1])
    save = engine.save_atomic
    on_disk = []

    def save_and_look(payload, path):
        folder = path.parent / "tensorboard"
        steps = {s for s, _ in tensorboard_scalars_in(folder).get("train/loss", [])}
        on_disk.append((payload["global_step"], steps))
        save(payload, path)

    monkeypatch.setattr(engine, "save_atomic", save_and_look)
    config = toy_config(logging={"tensorboard": True, "log_every": 1})
    train(ToyTask(), config, TrainOptions(tmp_path / "run", device="cpu"))
    assert on_disk and all(steps == set(range(1, step + 1)) for step, steps in on_disk)


def test_a_resume_after_a_kill_repeats_no_point(tmp_path):
    """Readers take a folder's event files in name order, which starts with the creation
    second: here the killed run's file is named a second ahead (a resume within the same
    second, or a clock just behind), and the resumed run's must still come after it."""
    pytest.importorskip("tensorboard")
    import time

    config = toy_config(logging={"tensorboard": True, "log_every": 1})
    train(ToyTask(), config, TrainOptions(tmp_path / "whole", device="cpu"))
    run = tmp_path / "run"
    train(ToyTask(), config, TrainOptions(run, device="cpu", stop_after_steps=6))
    [events] = (run / "tensorboard").glob("events.out.tfevents.*")
    rest = events.name.removeprefix("events.out.tfevents.").split(".", 1)[1]
    events.rename(events.with_name(f"events.out.tfevents.{int(time.time()) + 1}.{rest}"))
    # as if killed at step 6 before writing its snapshot: the one of step 4 is the last
    shutil.copy(run / "previous.pth", run / "last.pth")
    (run / "last.pth.sha256").write_text(
        (run / "previous.pth.sha256").read_text().replace("previous.pth", "last.pth"))
    train(ToyTask(), config, TrainOptions(run, device="cpu", resume=run / "last.pth"))
    whole, again = tensorboard_scalars(tmp_path / "whole"), tensorboard_scalars(run)
    for tag in ("train/loss", "val/loss"):
        assert [s for s, _ in again[tag]] == [s for s, _ in whole[tag]], tag


# --- bad values and devices: exit 2, one line, nothing written ---


@pytest.mark.parametrize(("command", "setting", "message"), [
    ("train", "data.seed=1180591620717411303424", "data.seed: must be at most"),
    ("train", "data.digits_split_seed=-1", "data.digits_split_seed: must be at least 0"),
    ("train-seg", "data.canvas_seed=1180591620717411303424", "data.canvas_seed: must be at"),
    ("train", "optimizer.betas=[1.5,0.999]", "optimizer.betas must both be in [0, 1)"),
    ("train", "optimizer.betas=[0.9,1.0]", "optimizer.betas must both be in [0, 1)"),
    ("train", "optimizer.betas=[-0.1,0.9]", "optimizer.betas must both be in [0, 1)"),
    ("train", "optimizer.lr=1e308", "optimizer.lr: must be within +-3.4e38"),
    ("train", "input.mean=[0.5,1e39,0.5]", "input.mean: must be within +-3.4e38"),
    ("train", "input.crop_train=1180591620717411303424", "input.crop_train: must be at most"),
    ("train", "data.digits_size=100000", "data.digits_size: must be at most 16384"),
    ("train", "data.workers=100000", "data.workers: must be at most 256"),
    ("train", "data.val_batch_size=1180591620717411303424", "val_batch_size: must be at most"),
    ("train-seg", "network.pooling_size=[0,4]", "each number must be at least 1"),
    ("train-seg", "network.head_channels=100000", "network.head_channels: must be at most"),
    ("train-seg", "data.ignore_index=1180591620717411303424", "data.ignore_index: must be at"),
    ("train-seg", "data.canvas_train=1180591620717411303424", "data.canvas_train: must be at"),
    ("train-seg", "data.canvas_max_digits=1180591620717411303424", "canvas_max_digits: must"),
    ("train-seg", "data.canvas_digit_scale=[2,1]", "data.canvas_digit_scale must be [a, b]"),
    ("train-seg", "data.canvas_digit_scale=[0,1]", "each number must be at least 1.0"),
    ("train-seg", "data.canvas_digit_scale=[9,9]", "smaller than the largest digit (72 px"),
])
def test_out_of_range_values_name_the_key(tmp_path, capsys, command, setting, message):
    if command == "train":
        config = write_config(tmp_path / "c.json", optimizer={"type": "adam"})
    else:
        config = tmp_path / "s.json"
        config.write_text(json.dumps(TINY_SEG))
    run = tmp_path / "run"
    assert main([command, str(config), "--log-dir", str(run), "--set", setting]) == 2
    assert message in one_line_error(capsys, command)
    assert not run.exists()


@pytest.mark.parametrize(("device", "message"), [
    ("tpu", "--device 'tpu': expected cpu, cuda or cuda:N"),
    ("mps", "--device 'mps': expected cpu, cuda or cuda:N"),
    ("cpu:1", "--device 'cpu:1': expected cpu, cuda or cuda:N"),
    ("cuda", "--device cuda: CUDA is not available on this machine"),
    ("cuda:1", "--device cuda:1: CUDA is not available on this machine"),
])
@pytest.mark.parametrize("command", ["train", "test"])
def test_devices_this_machine_cannot_run(tmp_path, capsys, monkeypatch, device, message,
                                         command):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on CUDA machines
    config = write_config(tmp_path / "c.json")
    run = tmp_path / "run"
    argv = (["train", str(config), "--log-dir", str(run)] if command == "train" else
            ["test", str(config), str(tmp_path / "none.pth")])
    assert main([*argv, "--device", device]) == 2
    assert message in one_line_error(capsys, command)
    assert not run.exists()


def test_a_cuda_index_the_machine_lacks(monkeypatch):
    from iabn.tools.training.ranks import DeviceError, start

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceError, match="cuda:2: this machine has 2 CUDA device"):
        start("cuda:2")


@pytest.mark.parametrize(("batch", "crop", "fails"), [
    (1, 16, True), pytest.param(1, 64, False, marks=pytest.mark.slow),
    pytest.param(2, 16, False, marks=pytest.mark.slow)])
def test_batches_batch_norm_cannot_train_on_are_refused_before_writing(tmp_path, capsys,
                                                                       batch, crop, fails):
    """The verdict equals what a real training forward of the model does (the reference):
    ResNet-18 reaches 1x1 pixels at 16x16 inputs, 2x2 at 64x64."""
    from iabn.models import create

    model = create("resnet18", num_classes=10).train()
    try:
        model(torch.randn(batch, 3, crop, crop))
        reference_fails = False
    except ValueError:
        reference_fails = True
    assert reference_fails == fails
    config = write_config(tmp_path / "c.json",
                          data={"batch_size": batch, "digits_val_fraction": 0.01},
                          input={"crop_train": crop, "scale_val": crop, "crop_val": crop,
                                 "area_range_train": [1.0, 1.0]},
                          schedule={"epochs": 1, "max_steps_per_epoch": 1,
                                    "warmup_epochs": 0})
    run = tmp_path / "run"
    with one_torch_thread():
        code = main(["train", str(config), "--log-dir", str(run), "--set",
                     "logging.tensorboard=false"])
    if fails:
        assert code == 2
        err = one_line_error(capsys, "train")
        assert "data.batch_size=1 gives layer" in err and "use data.batch_size >= 2" in err
        assert not run.exists()
    else:
        assert code == 0, capsys.readouterr().err


def test_a_crop_the_network_cannot_run_on_is_refused_before_writing(tmp_path, capsys):
    """DenseNet-121's last transition pools 2x2 windows: at 16x16 inputs its input is 1x1
    (the reference: the real forward fails the same way)."""
    from iabn.models import create

    with pytest.raises(RuntimeError, match="Output size is too small"):
        create("densenet121", num_classes=10).train()(torch.randn(2, 3, 16, 16))
    config = write_config(tmp_path / "c.json", network={"arch": "densenet121"},
                          data={"batch_size": 2})
    run = tmp_path / "run"
    assert main(["train", str(config), "--log-dir", str(run)]) == 2
    err = one_line_error(capsys, "train")
    assert "the network cannot train on 3x16x16 inputs: layer tra4.pool (AvgPool2d)" in err
    assert not run.exists()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["the write fails", "the disk fills part way"])
def test_a_full_disk_while_writing_a_snapshot_keeps_the_older_ones(tmp_path, capsys,
                                                                   monkeypatch, how):
    """"the disk fills part way": torch.save's own reaction to a real full disk, a
    RuntimeError ("unexpected pos ...") from closing its archive (seen on a CI machine)."""
    import full_disk

    config = write_config(tmp_path / "c.json")
    run = tmp_path / "run"
    with one_torch_thread():
        assert main(["train", str(config), "--log-dir", str(run), "--stop-after-steps",
                     "4"]) == 3
    before = _files(run)
    if how == "the write fails":
        save = torch.save

        def full(obj, file, *args, **kwargs):
            if isinstance(obj, dict) and "global_step" in obj:  # a snapshot, not a checksum
                file.write(b"part of a snapshot")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return save(obj, file, *args, **kwargs)

        monkeypatch.setattr(torch, "save", full)
    else:
        def snapshot_open(path, mode="r", *args, **kwargs):
            if mode == "wb" and str(path).endswith(".tmp"):  # a snapshot's temporary file
                return full_disk.filling_file(path, capacity=100_000)
            return open(path, mode, *args, **kwargs)

        monkeypatch.setattr(snapshot, "open", snapshot_open, raising=False)
    capsys.readouterr()
    with one_torch_thread():
        code = main(["train", str(config), "--log-dir", str(run), "--resume"])
    assert code == EXIT_FAILED
    err = one_line_error(capsys, "train")
    assert "cannot write snapshot" in err and "No space left on device" in err
    assert f"the last: {run / 'last.pth'} (step 4)" in err
    after = _files(run)
    for name, data in before.items():
        if name.suffix in (".pth", ".sha256"):
            assert after[name] == data, name
    assert not list(run.glob(".*.tmp"))


def test_an_unwritable_tensorboard_folder_is_refused_before_writing(tmp_path, capsys,
                                                                    monkeypatch):
    # as if read-only: the tests may run as root, whom permissions do not stop
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: (
        not str(path).endswith("tensorboard") and real_access(path, mode)))
    config = write_config(tmp_path / "c.json")
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    assert main(["train", str(config), "--log-dir", str(run)]) == 2
    assert "no permission to write in" in one_line_error(capsys, "train")
    assert [p.name for p in run.iterdir()] == ["tensorboard"]


@pytest.mark.slow
def test_a_tensorboard_folder_that_fails_to_write_is_one_line(tmp_path):
    """Where permissions are not checked ahead (root, network file systems), TensorBoard's
    writer thread meets the error: still one line, and no thread traceback (a subprocess:
    pytest catches thread exceptions itself)."""
    pytest.importorskip("tensorboard")
    config = write_config(tmp_path / "c.json")
    script = (
        "import errno, os, sys\n"
        "from tensorboard.summary.writer import record_writer\n"
        "def denied(self, data):\n"
        "    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))\n"
        "record_writer.RecordWriter.write = denied\n"
        "from iabn.tools.cli import main\n"
        f"sys.exit(main(['train', {str(config)!r}, '--log-dir', {str(tmp_path / 'run')!r}]))\n")
    done = subprocess.run([sys.executable, "-c", script], env=environment(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("iabn train: error: ") and done.stderr.count("\n") == 1, (
        done.stderr)
    assert "Permission denied" in done.stderr
    assert not (tmp_path / "run" / "config.json").exists()


def test_an_empty_resume_path_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" is the current folder
    config = write_config(tmp_path / "c.json")
    assert main(["train", str(config), "--log-dir", "run", "--resume", ""]) == 2
    assert "snapshot . is a folder, not a file" in one_line_error(capsys, "train")


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_where_a_snapshot_goes_is_refused_before_training(tmp_path, capsys, resume):
    config = write_config(tmp_path / "c.json")
    run = tmp_path / "run"
    with one_torch_thread():
        assert main(["train", str(config), "--log-dir", str(run), "--stop-after-steps",
                     "4"]) == 3
    (run / "last.pth").unlink()
    (run / "last.pth").mkdir()  # e.g. a copy gone wrong
    before = _files(run)
    capsys.readouterr()
    argv = ["train", str(config), "--log-dir", str(run)] + (["--resume"] if resume else [])
    assert main(argv) == 2
    assert "last.pth is a folder, not a file" in one_line_error(capsys, "train")
    assert _files(run) == before


# --- interrupts: one line, exit 130, the last finished step saved ---


def test_ctrl_c_during_start_up_is_one_line_and_130(tmp_path, capsys, monkeypatch):
    from iabn.tools.training.classification import ClassificationTask

    def interrupted(self, config):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the data is being read

    monkeypatch.setattr(ClassificationTask, "datasets", interrupted)
    config = write_config(tmp_path / "c.json")
    # Python's own SIGINT handler, as in a terminal: a process started in the background of a
    # non-interactive shell (`bash .ci/run &`) inherits SIGINT ignored, and Python then leaves
    # it so
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        status = main(["train", str(config), "--log-dir", str(tmp_path / "run")])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == 130
    err = capsys.readouterr().err
    assert err == "iabn train: interrupted\n", err
    assert not (tmp_path / "run").exists()


class _Interrupted(ToyTask):
    """The toy task that gets two SIGINTs in training forward ``at`` (within a step), or in
    the validation forward of epoch ``val_epoch``."""

    def __init__(self, at=None, val_epoch=None):
        super().__init__()
        self.at, self.val_epoch, self.val_forwards = at, val_epoch, 0

    def forward(self, model, inputs):
        if not model.training:
            self.val_forwards += 1
        if (model.training and self.training_forwards + 1 == self.at) or (
                not model.training and self.val_forwards == self.val_epoch):
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return super().forward(model, inputs)


@pytest.mark.parametrize(("task", "step"), [
    (_Interrupted(at=6), 6),  # the step under way is finished, then saved
    # validation is cut short: its epoch's last step saved
    pytest.param(_Interrupted(val_epoch=2), 8, marks=pytest.mark.slow),
])
def test_a_second_sigint_saves_the_last_finished_step_and_resumes_exactly(tmp_path, task,
                                                                           step):
    pytest.importorskip("tensorboard")
    config = toy_config(logging={"tensorboard": True, "log_every": 1})
    run = tmp_path / "run"
    assert train(task, config, TrainOptions(run, device="cpu")) == EXIT_INTERRUPTED
    snapshot = read_snapshot(run / "last.pth")
    assert snapshot["global_step"] == step and snapshot["val_metrics"] is None
    assert train(ToyTask(), config, TrainOptions(run, device="cpu", resume=run / "last.pth")
                 ) == EXIT_FINISHED
    train(ToyTask(), config, TrainOptions(tmp_path / "whole", device="cpu"))
    _assert_same_weights(tmp_path / "whole" / "last.pth", run / "last.pth")
    whole, again = tensorboard_scalars(tmp_path / "whole"), tensorboard_scalars(run)
    for tag in ("train/loss", "val/loss"):  # one curve, no point twice
        assert [s for s, _ in again[tag]] == [s for s, _ in whole[tag]], tag


def test_a_second_sigint_through_the_command_is_130_without_a_traceback(tmp_path, capsys,
                                                                         monkeypatch):
    from iabn.tools.training.classification import ClassificationTask

    forward, calls = ClassificationTask.forward, []

    def interrupted(self, model, inputs):
        calls.append(model.training)
        if calls.count(True) == 2 and model.training:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return forward(self, model, inputs)

    monkeypatch.setattr(ClassificationTask, "forward", interrupted)
    config = write_config(tmp_path / "c.json")
    run = tmp_path / "run"
    with one_torch_thread():
        assert main(["train", str(config), "--log-dir", str(run)]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") <= 1
    assert "interrupted at epoch 1, step 2" in captured.out
    assert read_snapshot(run / "last.pth")["global_step"] == 2


# --- iabn test: messages and its --json file ---


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    config = write_config(root / "c.json")
    with one_torch_thread():
        assert main(["train", str(config), "--log-dir", str(root / "run"),
                     "--stop-after-steps", "1"]) == 3
    return config, root / "run" / "last.pth"


def test_test_json_on_a_full_disk_leaves_no_file(tmp_path, capsys, monkeypatch, trained):
    import full_disk

    config, checkpoint = trained
    target = tmp_path / "result.json"
    full_disk.install(monkeypatch)  # every file opened for writing from here on
    with one_torch_thread():
        assert main(["test", str(config), str(checkpoint), "--json", str(target),
                     "--quiet"]) == 2
    assert "cannot write --json" in one_line_error(capsys, "test")
    assert not target.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["folder", "no parent", "parent is a file"])
def test_test_json_paths_are_checked_before_the_evaluation(tmp_path, capsys, trained, case):
    config, checkpoint = trained
    if case == "folder":
        target, message = tmp_path / "out.json", "is a folder; give a file name"
        target.mkdir()
    elif case == "no parent":
        target, message = tmp_path / "missing" / "out.json", "missing does not exist"
    else:
        (tmp_path / "file").write_text("")
        target, message = tmp_path / "file" / "out.json", "file is a file, not a folder"
    assert main(["test", str(config), str(checkpoint), "--json", str(target)]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""  # no evaluation ran


def test_test_json_replaces_an_existing_file_only_when_asked(tmp_path, capsys, trained):
    """As iabn bench and iabn memory: an existing --json file is the user's until
    --overwrite says otherwise (it was replaced silently)."""
    config, checkpoint = trained
    target = tmp_path / "out.json"
    target.write_text("mine")
    assert main(["test", str(config), str(checkpoint), "--json", str(target), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert "add --overwrite" in captured.err and captured.out == ""
    assert target.read_text() == "mine"
    with one_torch_thread():
        assert main(["test", str(config), str(checkpoint), "--json", str(target), "--quiet",
                     "--overwrite"]) == 0
    assert "top1" in json.loads(target.read_text())["metrics"]


@pytest.mark.parametrize(("args", "message"), [
    (["--crop", "100000", "--scale", "100000"], "--crop must be at most 16384"),
    (["--batch-size", "1180591620717411303424"], "--batch-size must be at most 16777216"),
    (["--workers", "100000"], "--workers must be at most 256"),
])
def test_test_arguments_out_of_range(capsys, trained, args, message):
    config, checkpoint = trained
    assert main(["test", str(config), str(checkpoint), *args]) == 2
    assert message in one_line_error(capsys, "test")


def test_test_json_to_a_device_or_pipe_is_refused(tmp_path, capsys, trained):
    config, checkpoint = trained
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)  # the atomic write would rename a regular file over it
    assert main(["test", str(config), str(checkpoint), "--json", str(pipe)]) == 2
    assert "exists and is not a regular file" in one_line_error(capsys, "test")
    assert pipe.is_fifo()


def test_test_messages_name_the_real_problem(tmp_path, capsys, trained):
    from pathlib import Path

    config, checkpoint = trained
    folder = tmp_path / "model.pth"
    folder.mkdir()
    assert main(["test", str(config), str(folder)]) == 2
    assert f"checkpoint {folder} is a folder, not a file" in one_line_error(capsys, "test")
    assert main(["test", str(config), str(config)]) == 2  # torch's message spans lines
    assert f"cannot read checkpoint {config}" in one_line_error(capsys, "test")
    assert main(["test", str(config), str(checkpoint), "--set", "network.num_classes=5"]) == 2
    err = one_line_error(capsys, "test")
    assert "network.num_classes=5 but the data has 10 classes" in err
    seg = Path(__file__).resolve().parents[2] / "configs" / "digits_seg.json"
    assert main(["test", str(seg), str(checkpoint)]) == 2
    err = one_line_error(capsys, "test")
    assert "is a segmentation config: it is trained with iabn train-seg" in err
    assert "iabn segment" in err and "unknown key" not in err
    assert main(["train-seg", str(config), "--log-dir", str(tmp_path / "r")]) == 2
    assert "is a classification config: it is trained with iabn train" in one_line_error(
        capsys, "train-seg")


def test_a_running_log_dir_is_named_as_running_not_resumable(tmp_path, capsys, trained):
    from iabn.tools.training.logdir import LogDirLock

    config, checkpoint = trained
    run = checkpoint.parent
    lock = LogDirLock(run)
    lock.acquire()  # the run is still going (flock conflicts across open files)
    try:
        for extra in ([], ["--resume"]):
            assert main(["train", str(config), "--log-dir", str(run), *extra]) == 2
            err = one_line_error(capsys, "train")
            assert f"is in use by another run, still running (pid {os.getpid()} " in err
            assert f"kill -INT {os.getpid()}" in err
            assert "continue it with --resume" not in err
    finally:
        lock.release()


# --- resume across thread counts ---


def test_resume_with_another_thread_count_warns_once(tmp_path, capsys):
    run = tmp_path / "run"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        train(ToyTask(), toy_config(), TrainOptions(run, device="cpu", stop_after_steps=2))
        assert read_snapshot(run / "last.pth")["threads"] == 1
        capsys.readouterr()
        torch.set_num_threads(2)
        train(ToyTask(), toy_config(), TrainOptions(run, device="cpu", stop_after_steps=3,
                                                    resume=run / "last.pth"))
        warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert warnings == [
            f"iabn: warning: snapshot {run / 'last.pth'} was written with 1 torch thread(s), "
            f"this run has 2 (set OMP_NUM_THREADS=1 to match): the resumed run will not "
            f"reach bitwise the weights of an uninterrupted one"]
        torch.set_num_threads(2)  # the same count as the snapshot: no warning
        train(ToyTask(), toy_config(), TrainOptions(run, device="cpu", stop_after_steps=4,
                                                    resume=run / "last.pth"))
        assert "warning" not in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
