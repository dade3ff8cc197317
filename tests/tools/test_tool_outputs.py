"""Output paths of ``iabn bench``, ``iabn memory`` and ``iabn plan``, and the atomic write they
share (``iabn test --json`` uses it too): every path is checked before any work, the write leaves
the old file or the whole new one and never a temporary file, and a failed write is one line
on stderr with exit status 2."""

import json
import os

import pytest

import full_disk
from iabn.tools.bench import blocks, write_text_atomic
from iabn.tools.bench import model_memory as mm
from iabn.tools.cli import main

from helpers import one_line_error

pytestmark = pytest.mark.without_gpu

TINY_BENCH = ["bench", "--blocks", "1", "--channels", "2", "--size", "4", "--batch", "2",
              "--repeats", "1", "--iters", "1", "--warmup", "0", "--threads", "1", "--quiet"]
FACTORY = ["memory", "memory_cli_models:small_net", "--input", "2,3,8,8", "--quiet"]
PLAN = ["plan", "memory_cli_models:small_net", "--input", "2,3,8,8", "--quiet"]
ARGV = {"bench": TINY_BENCH, "memory": FACTORY, "plan": PLAN}


class Worked(Exception):
    """Raised where a command would start its work: the path checks came too late."""


@pytest.fixture()
def no_work(monkeypatch):
    """``bench``, ``memory`` and ``plan`` raise :class:`Worked` where their measuring would
    start."""

    def worked(*_args, **_kwargs):
        raise Worked

    # the command imports run_bench when it starts (after its checks): patched where it lives
    monkeypatch.setattr(blocks, "run_bench", worked)
    monkeypatch.setattr(mm, "build_model", worked)


def _bad_paths(tmp_path):
    """(--json argument, expected message part) for paths that must be refused."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "afile").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    return [
        (str(tmp_path / "folder"), "is a folder; give a file name"),
        (str(tmp_path / "newdir") + "/", "is a folder; give a file name"),
        ("", "empty path"),
        (str(tmp_path / "missing" / "dir" / "out.json"), "does not exist; create it first"),
        (str(tmp_path / "afile" / "out.json"), "afile is a file, not a folder"),
        (str(tmp_path / "dangling" / "out.json"), "is a broken symbolic link"),
        ("/dev/null", "is not a regular file"),
    ]


@pytest.mark.parametrize("command", ["bench", "memory", "plan"])
def test_bad_json_paths_exit_2_before_any_work(tmp_path, capsys, no_work, command):
    cases = _bad_paths(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for path, message in cases:
        argv = [*ARGV[command], "--json", path]
        assert main(argv) == 2, path  # Worked would escape if the work started
        assert message in one_line_error(capsys, command), path
    assert sorted(os.listdir(tmp_path)) == before  # nothing created (no missing/ folder)


@pytest.mark.parametrize("command", ["bench", "memory", "plan"])
def test_an_existing_json_file_is_kept_unless_overwrite(tmp_path, capsys, no_work, command):
    mine = tmp_path / "mine.json"
    mine.write_text("my notes")
    argv = [*ARGV[command], "--json", str(mine)]
    assert main(argv) == 2
    assert "exists; add --overwrite to replace it" in one_line_error(capsys, command)
    assert mine.read_text() == "my notes"
    with pytest.raises(Worked):  # asked for: the work starts
        main([*argv, "--overwrite"])


@pytest.mark.slow
def test_bench_overwrite_replaces_the_file(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text("old")
    assert main([*TINY_BENCH, "--json", str(path), "--overwrite"]) == 0
    assert json.loads(path.read_text())["config"]["blocks"] == 1
    assert os.listdir(tmp_path) == ["bench.json"]


@pytest.mark.parametrize("command", [pytest.param("bench", marks=pytest.mark.slow), "memory",
                                     "plan"])
def test_full_disk_while_writing_json_is_one_line_and_leaves_nothing(tmp_path, capsys,
                                                                      monkeypatch, command):
    old = tmp_path / "old.json"
    old.write_text("the previous results")
    new = tmp_path / "new.json"
    argv = ARGV[command]
    # a quiet machine: bench notes a busy one on stderr (the suite may share the cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    full_disk.install(monkeypatch)
    assert main([*argv, "--json", str(new)]) == 2
    assert main([*argv, "--json", str(old), "--overwrite"]) == 2
    monkeypatch.undo()
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "error" in line] == err and len(err) == 2, err
    assert "No space left on device" in err[0] and "Traceback" not in err[0]
    # the old file whole, no new file, no temporary file
    assert os.listdir(tmp_path) == ["old.json"]
    assert old.read_text() == "the previous results"


def test_write_text_atomic_cleans_up_on_any_failure(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("old")
    full_disk.install(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        write_text_atomic(target, "x" * 10_000)
    monkeypatch.undo()

    def interrupted(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(target, "new")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["out.json"] and target.read_text() == "old"
    with pytest.raises(FileNotFoundError):  # no folder is made unless asked
        write_text_atomic(tmp_path / "sub" / "x.json", "new")
    write_text_atomic(tmp_path / "sub" / "x.json", "new", parents=True)
    assert (tmp_path / "sub" / "x.json").read_text() == "new"


def test_write_text_atomic_flushes_to_disk_before_the_rename(tmp_path, monkeypatch):
    """After a crash the name must hold the whole file: fsync, then rename."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace",
                        lambda a, b: events.append("replace") or real_replace(a, b))
    write_text_atomic(tmp_path / "x.json", "{}")
    assert events == ["fsync", "replace"]


def test_check_output_file_accepts_a_new_file_and_an_existing_one_when_asked(tmp_path):
    from iabn.tools.bench import OutputPathError, check_output_file

    assert check_output_file(str(tmp_path / "new.json"), "--json") == tmp_path / "new.json"
    (tmp_path / "old.json").write_text("")
    assert check_output_file(tmp_path / "old.json", "--json", overwrite=True).name == "old.json"
    with pytest.raises(OutputPathError, match="add --force to replace"):
        check_output_file(tmp_path / "old.json", "--json", overwrite_flag="--force")


def test_unwritable_json_folder_exits_2(tmp_path, capsys, no_work, monkeypatch):
    # as if read-only (the tests may run as root, who may write anywhere)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert main([*FACTORY, "--json", str(tmp_path / "x.json")]) == 2
    assert "no permission to write in" in one_line_error(capsys, "memory")


def test_a_bench_input_too_large_for_the_machine_is_one_line(capsys):
    # 8 x 64 x 10^6 x 10^6 float32: 2 PB, beyond any address space (refused at once even
    # where the kernel overcommits memory)
    assert main(["bench", "--size", "1000000", "--quiet", "--warmup", "0"]) == 2
    assert one_line_error(capsys, "bench") == (
        "iabn bench: error: out of memory for input 8x64x1000000x1000000: use a smaller "
        "--batch, --channels or --size\n")
