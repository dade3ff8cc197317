"""The log directory a run owns: checked writable before anything is written, and locked so
that two runs never write into the same one.

The lock is ``LOG_DIR/run.lock``, held with ``fcntl.flock`` for the whole run by rank 0 (the
operating system releases it when the process ends, however it ends: no stale locks after a
``kill -9``). While held, the file says which process holds it (host, pid, start time,
command line), and a second run pointed at the folder stops with exit status 2 naming it,
with or without ``--resume``. The file stays after the run (empty of meaning once unlocked).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

LOCK = "run.lock"


class LogDirError(ValueError):
    """A log directory that cannot be written, or that another run is using."""


def default_log_dir(config_path: str | Path) -> Path:
    """``runs/<config file name without .json>``."""
    return Path("runs") / Path(config_path).stem


def check_writable(log_dir: str | Path, what: str = "--log-dir") -> None:
    """Raise :class:`LogDirError` unless ``log_dir`` is, or can be created as, a folder this
    process can write in (checked without creating anything); ``what`` names the option in
    the message (the tools' output folders use it too)."""
    log_dir = Path(log_dir)
    probe = log_dir
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: mkdir would fail
            raise LogDirError(f"{what} {log_dir}: {probe} is a broken symbolic link")
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise LogDirError(f"{what} {log_dir}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise LogDirError(f"{what} {log_dir}: no permission to write in {probe}")


def _holder(text: str) -> tuple[str, int | None]:
    """The holder's description and pid, from the lock file's text."""
    try:
        info = json.loads(text)
        return (f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                f"{info['command']}"), int(info["pid"])
    except (ValueError, KeyError, TypeError):
        return "another process (it has not said which yet)", None


def _in_use(log_dir: Path, text: str) -> LogDirError:
    holder, pid = _holder(text)
    stop = f"stop it with kill -INT {pid}" if pid is not None else "stop it"
    return LogDirError(f"{log_dir} is in use by another run, still running ({holder}): "
                       f"wait for it to finish, {stop} (it then writes its snapshot, which "
                       f"--resume continues), or choose another --log-dir")


def check_outputs(log_dir: str | Path, replaced: Sequence[str] = (),
                  appended: Sequence[str] = (), folders: Sequence[str] = ()) -> None:
    """Raise :class:`LogDirError` for an output of a run that exists as the wrong kind of
    thing, before anything is written: ``replaced`` files (written to a temporary file, then
    renamed over; a folder there would fail only at that point, after the work),
    ``appended`` files (also need write permission) and ``folders`` (need write permission),
    all relative to ``log_dir``. Missing ones are fine: they are created."""
    log_dir = Path(log_dir)
    for name in (*replaced, *appended):
        path = log_dir / name
        if path.is_dir():
            raise LogDirError(f"{path} is a folder, not a file: the run writes a file there; "
                              f"move the folder away or choose another --log-dir")
        if path.exists() and not path.is_file():
            raise LogDirError(f"{path} is not a regular file: the run writes a file there")
        if name in appended and path.exists() and not os.access(path, os.W_OK):
            raise LogDirError(f"--log-dir {log_dir}: no permission to write {path}")
    for name in folders:
        path = log_dir / name
        if path.exists() and not path.is_dir():
            raise LogDirError(f"{path} is a file, not a folder: the run writes a folder "
                              f"there; move the file away or choose another --log-dir")
        if path.exists() and not os.access(path, os.W_OK | os.X_OK):
            raise LogDirError(f"--log-dir {log_dir}: no permission to write in {path}")


class LogDirLock:
    """An exclusive, non-blocking lock on ``LOG_DIR/run.lock`` (see module doc)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.path = Path(log_dir) / LOCK
        self.file: IO[str] | None = None

    def acquire(self) -> None:
        """Create the folder if needed and take the lock, or raise :class:`LogDirError`
        naming the run that holds it."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            file = open(self.path, "a+")  # noqa: SIM115 - held until release()
        except OSError as error:
            raise LogDirError(f"cannot write in --log-dir {self.path.parent}: "
                              f"{error.strerror or error}") from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            file.seek(0)
            text = file.read()
            file.close()
            raise _in_use(self.path.parent, text) from None
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)}
        file.seek(0)
        file.truncate()
        file.write(json.dumps(info) + "\n")
        file.flush()
        self.file = file

    def check_free(self) -> None:
        """Raise :class:`LogDirError` naming the holder when a running run holds the lock;
        writes nothing (the lock file is only opened for reading)."""
        try:
            file = open(self.path)  # noqa: SIM115 - closed below
        except OSError:
            return  # no lock file (or none that can be read): acquire() will say
        try:
            try:
                fcntl.flock(file, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise _in_use(self.path.parent, file.read()) from None
            fcntl.flock(file, fcntl.LOCK_UN)
        finally:
            file.close()

    def release(self) -> None:
        if self.file is not None:
            self.file.truncate(0)
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None


__all__ = ["LOCK", "LogDirError", "LogDirLock", "check_outputs", "check_writable",
           "default_log_dir"]
