"""Output paths of the tools: checked before any work, written atomically.

The checks (:func:`check_output_file`, :func:`check_output_folder`) run before a command
measures or reads anything, so that a bad path costs a second, not the run: an output file
must not be a folder or another non-regular file, must not exist unless the command was asked
to overwrite it, and its folder must exist and be writable. The tools do not create a missing
parent folder (a typo in a path would otherwise scatter folders silently); the message says to
create it.

The writes (:func:`write_atomic`, :func:`write_text_atomic`) go to a temporary file in the
target's folder, which is flushed to disk (``fsync``) and renamed over the target: a crash or
a full disk leaves the old file or none, never a truncated one that a resumed run would take
for finished. The temporary file is removed on any failure.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


class OutputPathError(ValueError):
    """An output path that cannot or must not be written; the text names it and the fix."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object], *,
                 parents: bool = False) -> None:
    """Write a file by calling ``write(stream)`` on a temporary file in ``path``'s folder,
    then renaming it to ``path`` (see the module doc). ``parents``: create missing folders
    first (the benchmark scripts' default result folders); the tools check instead. Errors
    (``OSError`` for a full disk or a lost permission) propagate after the temporary file is
    removed."""
    path = Path(path)
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    # a unique name: two runs writing the same file never share a temporary file
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".partial")
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would
        os.chmod(temporary, 0o666 & ~_umask())
        with os.fdopen(handle, "wb") as stream:
            write(stream)
            stream.flush()
            # on disk before the rename: after a crash the name holds the whole file or the
            # old one, not an empty file (delayed allocation)
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def write_text_atomic(path: str | Path, text: str, *, parents: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` with :func:`write_atomic`: an interrupted run or a
    full disk leaves the old file or none, never half of one, and no temporary file."""
    data = text.encode("utf-8")
    write_atomic(path, lambda stream: stream.write(data), parents=parents)


def _check_folder(folder: Path, what: str) -> None:
    """``folder`` exists, is a folder and this process may create files in it."""
    probe = folder
    while not (probe.exists() or probe.is_symlink()) and probe.parent != probe:
        probe = probe.parent
    if probe.is_symlink() and not probe.exists():
        raise OutputPathError(f"{what}: {probe} is a broken symbolic link")
    if not probe.is_dir():
        raise OutputPathError(f"{what}: {probe} is a file, not a folder")
    if probe != folder:
        raise OutputPathError(f"{what}: folder {folder} does not exist; create it first "
                              f"(mkdir -p {folder})")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what}: no permission to write in {folder}")


def check_output_file(text: str | Path, what: str, overwrite: bool = False,
                      overwrite_flag: str = "--overwrite") -> Path:
    """The output file ``text`` names, checked before any work: not empty, not a folder
    (nor written as one, ``dir/``), not another non-regular file (a device, a pipe), not an
    existing file unless ``overwrite``, in an existing folder this process can write in.
    ``what`` names the argument in messages (``--json out.json``); ``overwrite_flag`` is the
    option that allows replacing a file. Raises :class:`OutputPathError`."""
    text = str(text)
    if not text:
        raise OutputPathError(f"{what}: empty path; give a file name")
    path, label = Path(text), f"{what} {text}"
    if text.endswith(os.sep) or (os.altsep and text.endswith(os.altsep)) or path.is_dir():
        raise OutputPathError(f"{label}: is a folder; give a file name (e.g. "
                              f"{path / 'results.json'})")
    if path.exists() or path.is_symlink():
        if path.exists() and not path.is_file():
            raise OutputPathError(f"{label}: exists and is not a regular file; choose "
                                  f"another file name")
        if not overwrite:
            raise OutputPathError(f"{label}: the file exists; add {overwrite_flag} to "
                                  f"replace it, or choose another file name")
    _check_folder(path.parent, label)
    return path


def check_output_folder(text: str | Path, what: str) -> Path:
    """The output folder ``text`` names, checked before any work: an existing folder this
    process can write in, or a new one whose parent folder exists and is writable (the
    command creates it, not its parents). Raises :class:`OutputPathError`."""
    if not str(text):  # Path("") is the current folder
        raise OutputPathError(f"{what}: empty path; give a folder")
    path, label = Path(text), f"{what} {text}"
    if path.exists() or path.is_symlink():
        if path.is_symlink() and not path.exists():
            raise OutputPathError(f"{label}: is a broken symbolic link")
        if not path.is_dir():
            raise OutputPathError(f"{label}: {path} is a file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise OutputPathError(f"{label}: no permission to write in {path}")
        return path
    _check_folder(path.parent, label)
    return path


__all__ = ["OutputPathError", "check_output_file", "check_output_folder", "write_atomic",
           "write_text_atomic"]
