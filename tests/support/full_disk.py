"""A full disk for the tests of the tools' writes: files opened for writing take half of the
first write and then fail with ENOSPC, as a real full disk does (the data up to the error is
on disk). Whatever opens the file (``open``, ``Path.write_text``, ``os.fdopen``, Pillow's
``save``) goes through ``io.open``/``builtins.open``, which :func:`install` replaces."""

import builtins
import errno
import io
import os


class _FullDiskFile:
    def __init__(self, stream):
        self._stream = stream

    def write(self, data):
        self._stream.write(data[: len(data) // 2])
        self._stream.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stream.close()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def install(monkeypatch):
    """Make every file opened for writing (or appending) from now on a full disk's."""
    real_open = io.open

    def full_open(file, mode="r", *args, **kwargs):
        stream = real_open(file, mode, *args, **kwargs)
        return _FullDiskFile(stream) if set(mode) & set("wax+") else stream

    monkeypatch.setattr(io, "open", full_open)
    monkeypatch.setattr(builtins, "open", full_open)


class _FillingRaw(io.FileIO):
    """The kernel's side of a file on a disk with ``capacity`` bytes free: writes are taken
    up to it, then fail with ENOSPC."""

    def __init__(self, path, capacity: int):
        super().__init__(path, "wb")
        self._left = capacity

    def write(self, data):
        if self._left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = super().write(bytes(memoryview(data)[: self._left]))
        self._left -= written
        return written


def filling_file(path, capacity: int) -> io.BufferedWriter:
    """``open(path, "wb")`` on a disk that fills after ``capacity`` bytes: Python's own
    buffered writer over it, so writers (``torch.save``'s zip archive) react as they do to
    a real full disk."""
    return io.BufferedWriter(_FillingRaw(path, capacity))
