"""Where a run reports: a plain log file per rank, the console and TensorBoard (rank 0).

    LOG_DIR/logs/rank{R}.log    every rank: timestamped lines, appended across resumptions
    LOG_DIR/tensorboard/        rank 0: scalars, x-axis = global training step

On resume, TensorBoard events after the snapshot's step are purged (those at its step were
written before the snapshot and are kept), so a killed and resumed run shows one curve, the
same as an uninterrupted run's.
"""

from __future__ import annotations

import resource
import sys
import time
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


class RunLog:
    """The run's log file (this rank), console lines and TensorBoard scalars (rank 0)."""

    def __init__(self, log_dir: Path, ranks: Ranks, tensorboard: bool,
                 purge_step: int | None = None) -> None:
        self.ranks = ranks
        self.writer = None
        if tensorboard and ranks.is_main:
            writer_class = summary_writer_class()
            self.writer = writer_class(log_dir / "tensorboard", purge_step=purge_step)
        (log_dir / "logs").mkdir(parents=True, exist_ok=True)
        # Kept open for the whole run (closed by close()); line-buffered so a killed run's
        # log is complete up to its last line.
        self.file = open(  # noqa: SIM115
            log_dir / "logs" / f"rank{ranks.rank}.log", "a", buffering=1)

    def info(self, message: str, console: bool = True) -> None:
        """A line in this rank's log file, and on stdout when rank 0 and ``console``."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        self.file.write(f"{stamp} rank {self.ranks.rank}: {message}\n")
        if console and self.ranks.is_main:
            print(message, file=sys.stdout, flush=True)

    def scalars(self, values: dict[str, float], step: int) -> None:
        """TensorBoard scalars (rank 0 only; a no-op without TensorBoard)."""
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.file.close()


__all__ = ["RunLog", "peak_memory_mib", "summary_writer_class"]
