"""Where a run reports: a plain log file per rank, the console and TensorBoard (rank 0).

    LOG_DIR/logs/rank{R}.log    every rank: timestamped lines, appended across resumptions
    LOG_DIR/tensorboard/        rank 0: scalars, x-axis = global training step

On resume, TensorBoard events after the snapshot's step are purged (those at its step were
written, and flushed, before the snapshot and are kept), so a killed and resumed run shows one
curve, the same as an uninterrupted run's; that needs the new event file to be named after
the old ones (:func:`after_existing_event_files`). A fresh start in a folder whose earlier run
died before its first snapshot moves that run's event files aside
(:func:`set_aside_tensorboard`), so its points do not mix with the new curve.
"""

from __future__ import annotations

import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from .ranks import Ranks


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory so far in MiB: allocated CUDA memory on a GPU, else the process's maximum
    resident set size (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summary_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or an ImportError saying how to get it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError("logging.tensorboard is true but the tensorboard package is not "
                          "installed: pip install tensorboard (or 'iabn[tools]'), or set "
                          "logging.tensorboard to false") from error
    return SummaryWriter


TENSORBOARD = "tensorboard"


class RunLogError(RuntimeError):
    """The log file or TensorBoard's events could not be written (a full disk, a folder that
    turned read-only); the message names the file and the reason."""


@contextmanager
def _writing(what: str | Path) -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise RunLogError(f"cannot write {error.filename or what}: "
                          f"{error.strerror or error}") from None


def set_aside_tensorboard(log_dir: Path) -> Path | None:
    """Move ``LOG_DIR/tensorboard`` to ``LOG_DIR/tensorboard.abandoned-<time>`` when it holds
    event files (of a run that left no snapshot: a fresh start is only allowed then); returns
    the new folder, or None when there was nothing to move. TensorBoard shows the moved
    folder as a run of its own, if at all (when pointed at a parent of LOG_DIR)."""
    folder = log_dir / TENSORBOARD
    if not folder.is_dir() or not any(folder.rglob("events.out.tfevents.*")):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = log_dir / f"{TENSORBOARD}.abandoned-{stamp}"
    counter = 1
    while target.exists():
        counter += 1
        target = log_dir / f"{TENSORBOARD}.abandoned-{stamp}-{counter}"
    os.replace(folder, target)
    return target


EVENT_FILE_PREFIX = "events.out.tfevents."


def after_existing_event_files(folder: Path) -> None:
    """Wait (a second at most) until a new event file in ``folder`` gets a later name than
    the ones there. Readers load a folder's files in name order, which starts with the
    creation time in whole seconds: a resumed run's file named before the killed run's would
    be read first, and the older points would then replace the newer ones (TensorBoard drops
    the points at and after a step that goes back)."""
    stamps = []
    for path in folder.glob(EVENT_FILE_PREFIX + "*"):
        field = path.name[len(EVENT_FILE_PREFIX):].split(".", 1)[0]
        if field.isdigit():
            stamps.append(int(field))
    wait = max(stamps, default=-1) + 1 - time.time()
    if 0 < wait <= 2:  # more: a clock set back, which waiting would not mend
        time.sleep(wait)


def _writer_thread_errors_to_the_caller(previous: object) -> object:
    """A ``threading.excepthook`` that keeps quiet about an OSError of TensorBoard's writer
    thread (a full disk, a folder that turned read-only): the writer raises it again in the
    training thread at its next write or flush, where the engine reports it in one line."""

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == (
                "_AsyncWriterThread"):
            return
        previous(args)  # type: ignore[operator]

    return hook


class RunLog:
    """The run's log file (this rank), console lines and TensorBoard scalars (rank 0)."""

    def __init__(self, log_dir: Path, ranks: Ranks, tensorboard: bool,
                 purge_step: int | None = None) -> None:
        self.ranks = ranks
        self.writer = None
        self.file = None
        self._excepthook = threading.excepthook
        try:
            if tensorboard and ranks.is_main:
                writer_class = summary_writer_class()
                threading.excepthook = _writer_thread_errors_to_the_caller(self._excepthook)
                after_existing_event_files(log_dir / TENSORBOARD)
                self.writer = writer_class(log_dir / TENSORBOARD, purge_step=purge_step)
                # The writer's thread opens the event file at its first write: flush now, so
                # a folder that cannot be written fails here, before the run starts.
                self.writer.flush()
            (log_dir / "logs").mkdir(parents=True, exist_ok=True)
            # Kept open for the whole run (closed by close()); line-buffered so a killed run's
            # log is complete up to its last line.
            self.file = open(  # noqa: SIM115
                log_dir / "logs" / f"rank{ranks.rank}.log", "a", buffering=1)
        except BaseException:
            with suppress(RunLogError):
                self.close()
            raise
        self.events = log_dir / TENSORBOARD
        self.path = log_dir / "logs" / f"rank{ranks.rank}.log"

    def info(self, message: str, console: bool = True) -> None:
        """A line in this rank's log file, and on stdout when rank 0 and ``console``."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with _writing(self.path):
            self.file.write(f"{stamp} rank {self.ranks.rank}: {message}\n")
        if console and self.ranks.is_main:
            print(message, file=sys.stdout, flush=True)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """TensorBoard scalars (rank 0 only; a no-op without TensorBoard)."""
        if self.writer is not None:
            with _writing(f"TensorBoard events in {self.events}"):
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        """Put TensorBoard's pending events on disk (before a snapshot: a run killed after
        it resumes from there and must find every point up to it)."""
        if self.writer is not None:
            with _writing(f"TensorBoard events in {self.events}"):
                self.writer.flush()

    def close(self) -> None:
        try:
            if self.writer is not None:
                writer, self.writer = self.writer, None
                with _writing("TensorBoard events"):
                    writer.close()
        finally:
            threading.excepthook = self._excepthook
            if self.file is not None:
                self.file.close()


__all__ = ["EVENT_FILE_PREFIX", "TENSORBOARD", "RunLog", "RunLogError",
           "after_existing_event_files", "peak_memory_mib", "set_aside_tensorboard",
           "summary_writer_class"]
