"""Snapshot files: atomic writes, and errors that name the file and the mismatch."""

import pytest
import torch

from iabn.tools.training.commands import SCHEMA
from iabn.tools.training.config import defaults
from iabn.tools.training.rng import capture_rng_state, restore_rng_state
from iabn.tools.training.snapshot import (
    FORMAT,
    RESUME_KEYS,
    VERSION,
    SnapshotError,
    check_resumable,
    copy_atomic,
    read_snapshot,
    save_atomic,
)


def _payload(**changes):
    """A snapshot holding every entry resuming reads (small stand-ins for the states)."""
    payload = {"format": FORMAT, "version": VERSION, "task": "classification",
               "config": defaults(SCHEMA), "world_size": 1, "model": {"w": torch.ones(3)},
               "optimizer": {"state": {}, "param_groups": []}, "scheduler": {}, "scaler": {},
               "epoch": 1, "batches_done": 0, "global_step": 4, "best": None,
               "ranks": [{"rng": capture_rng_state(), "train_sums": torch.zeros(2)}]}
    payload.update(changes)
    return payload


def test_save_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "last.pth"
    save_atomic(_payload(epoch=1), path)
    save_atomic(_payload(epoch=2), path)
    assert read_snapshot(path)["epoch"] == 2
    # each with its checksum; the replaced last.pth kept as previous.pth
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "last.pth", "last.pth.sha256", "previous.pth", "previous.pth.sha256"]
    copy_atomic(path, tmp_path / "best.pth")
    assert read_snapshot(tmp_path / "best.pth")["epoch"] == 2


def test_a_write_that_fails_midway_keeps_the_old_snapshot(tmp_path, monkeypatch):
    path = tmp_path / "last.pth"
    save_atomic(_payload(epoch=1), path)

    def broken_save(obj, file):
        file.write(b"half a snapshot")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_atomic(_payload(epoch=2), path)
    monkeypatch.undo()
    assert read_snapshot(path)["epoch"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pth", "last.pth.sha256"]


def test_truncated_and_foreign_files_are_reported_by_name(tmp_path):
    path = tmp_path / "last.pth"
    save_atomic(_payload(), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SnapshotError, match=f"cannot read snapshot {path} .*corrupt"):
        read_snapshot(path)
    torch.save({"state_dict": {}}, path)
    (tmp_path / "last.pth.sha256").unlink()  # a file without a checksum is read unverified
    with pytest.raises(SnapshotError, match=f"{path} is not an iabn training snapshot"):
        read_snapshot(path)
    torch.save(_payload(version=VERSION + 1), path)
    with pytest.raises(SnapshotError, match="format version"):
        read_snapshot(path)
    with pytest.raises(SnapshotError, match="does not exist"):
        read_snapshot(tmp_path / "missing.pth")


@pytest.mark.parametrize("key", RESUME_KEYS)
def test_a_snapshot_without_an_entry_resuming_reads_is_refused_naming_it(tmp_path, key):
    """A hand-built or foreign file with a matching checksum that lacks a top-level entry:
    one SnapshotError naming the file and the entry (the engine's restore raised KeyError)."""
    path = tmp_path / "best.pth"
    payload = _payload()
    del payload[key]
    save_atomic(payload, path)
    with pytest.raises(SnapshotError, match=rf"best\.pth is marked as an iabn training "
                                            rf"snapshot but has no '{key}' entry, which "
                                            rf"resuming reads"):
        read_snapshot(path)


@pytest.mark.parametrize("change, text", [
    ({"optimizer": [1, 2]}, r"its 'optimizer' entry is a list, not a dict"),
    ({"config": None}, r"its 'config' entry is a NoneType, not a dict"),
    ({"world_size": 2}, r"'ranks' entry holds 1 entry, not one per rank of its "
                        r"world_size 2"),
    ({"ranks": {"rng": 1}}, r"'ranks' entry holds a dict, not one per rank"),
    ({"ranks": [7]}, r"ranks\[0\] is a int, not a dict"),
    ({"ranks": [{"rng": {}}]}, r"ranks\[0\] has no 'train_sums'"),
    ({"ranks": [{"rng": {"torch": 1}, "train_sums": 0}]},
     r"ranks\[0\] has no 'rng.cuda', 'rng.numpy', 'rng.python'"),
])
def test_a_snapshot_whose_entries_restore_cannot_read_is_refused(tmp_path, change, text):
    path = tmp_path / "s.pth"
    save_atomic(_payload(**change), path)
    with pytest.raises(SnapshotError, match=text):
        read_snapshot(path)
    save_atomic(_payload(), path)  # the same file with every entry is read
    assert read_snapshot(path)["global_step"] == 4


def test_resume_refuses_other_configs_tasks_and_world_sizes():
    snapshot = _payload()
    config = defaults(SCHEMA)
    check_resumable(snapshot, "s.pth", "classification", config, 1)
    changed = defaults(SCHEMA)
    changed["optimizer"]["lr"] = 0.5
    changed["logging"]["log_every"] = 1  # may change
    with pytest.raises(SnapshotError, match=r"s.pth was written with a different "
                                            r"configuration \(optimizer.lr: 0.1 -> 0.5\)"):
        check_resumable(snapshot, "s.pth", "classification", changed, 1)
    with pytest.raises(SnapshotError, match=r"written by 1 rank.*this run has 2"):
        check_resumable(snapshot, "s.pth", "classification", config, 2)
    with pytest.raises(SnapshotError, match="from a 'classification' run, not 'segmentation'"):
        check_resumable(snapshot, "s.pth", "segmentation", config, 1)


def test_rng_states_survive_a_weights_only_round_trip(tmp_path):
    import random

    import numpy as np

    state = capture_rng_state()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    save_atomic({"rng": state}, tmp_path / "rng.pth")
    loaded = torch.load(tmp_path / "rng.pth", weights_only=True)["rng"]
    torch.rand(5), np.random.rand(5), random.random()  # move every generator on
    restore_rng_state(loaded)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(again[0], expected[0])
    assert np.array_equal(again[1], expected[1]) and again[2] == expected[2]
