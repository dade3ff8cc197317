"""Benchmark helpers shared by ``iabn bench`` and the scripts in ``benchmarks/``.

Timings are wall-clock milliseconds per call (a script may pass another clock, e.g. the
calling thread's CPU time). Providers are timed *interleaved*: each repeat
runs every provider once, so slow drifts of a shared machine (other jobs, frequency changes)
hit all providers alike instead of whichever happened to run last; the reported figure is the
median over repeats, which ignores the odd repeat disturbed by a burst of load.
"""

from __future__ import annotations

import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ... import __version__
from ..outputs import (
    OutputPathError,
    check_output_file,
    check_output_folder,
    write_atomic,
    write_text_atomic,
)

Step = Callable[[], object]

#: ``(channels, height = width)`` of ResNeXt-101's four stages: the paper's timing shapes.
RESNEXT101_STAGES = ((256, 56), (512, 28), (1024, 14), (2048, 7))
RepeatCallback = Callable[[int, dict[str, float]], None]


#: ``device_name`` of a run on a CPU: it starts with "cpu", which is how the GPU campaign's
#: summary tells a CPU (smoke) figure from a GPU measurement.
CPU_DEVICE_NAME = "cpu (not a GPU figure)"


def machine_info(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a reader needs to reproduce a timing: versions, CPU, threads and the date (UTC).

    With the ``device`` the figures were measured on, also what that device is:
    ``device_type``, ``device_name`` (the GPU's name, or :data:`CPU_DEVICE_NAME`), Triton's
    version (None without Triton) and, on CUDA, the CUDA, cuDNN and driver versions and the
    settings that change GPU timings (TF32, cuDNN's autotuner, the float32 matmul precision).
    """
    info = {
        "iabn_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device is None:
        return info
    device = torch.device(device)
    info["device_type"] = device.type
    if device.type == "cuda":
        info.update(device_name=torch.cuda.get_device_name(device),
                    cuda_version=torch.version.cuda,
                    cudnn_version=torch.backends.cudnn.version(),
                    driver_version=_driver_version(),
                    cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                    cudnn_benchmark=torch.backends.cudnn.benchmark,
                    matmul_precision=torch.get_float32_matmul_precision())
    else:
        info["device_name"] = CPU_DEVICE_NAME
    info["triton_version"] = None
    if importlib.util.find_spec("triton") is not None:
        import triton

        info["triton_version"] = triton.__version__
    return info


def _driver_version() -> str | None:
    """The NVIDIA driver's version from ``nvidia-smi``; None where it cannot be asked."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def train_step(model: torch.nn.Module, leaf: torch.Tensor,
               grad: torch.Tensor) -> torch.Tensor:
    """One forward and backward: ``model(leaf.clone()).backward(grad)``; returns the output.

    Gradients are reset to ``None`` first (as ``optimizer.zero_grad()`` does) so that every
    step does the same work; the input gradient lands in ``leaf.grad``. The clone gives
    in-place layers the non-leaf input they need, and every provider pays for it alike.
    """
    leaf.grad = None
    model.zero_grad(set_to_none=True)
    out = model(leaf.clone())
    out.backward(grad)
    return out


def training_step(model: torch.nn.Module, leaf: torch.Tensor, grad: torch.Tensor) -> Step:
    """:func:`train_step` as a zero-argument step for :func:`time_interleaved`."""
    return partial(train_step, model, leaf, grad)


def results_folder(committed: Path) -> Path:
    """Where a benchmark script writes by default: ``runs/benchmarks`` under the current
    folder (git ignores ``runs/``), so that running a benchmark never rewrites the figures
    committed in ``benchmarks/results/`` (``committed``). Set ``IABN_COMMIT_RESULTS=1`` to
    write those on purpose (or name the file with the script's ``--json``)."""
    if os.environ.get("IABN_COMMIT_RESULTS") == "1":
        return committed
    return Path("runs") / "benchmarks"


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    """Write a benchmark script's report (indented JSON) atomically, creating its folder (the
    scripts' default, ``runs/benchmarks``), and say where."""
    write_text_atomic(path, json.dumps(report, indent=2) + "\n", parents=True)
    print(f"results written to {path}")


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count when given; return the count in effect."""
    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def synchronize(device: torch.device | None) -> None:
    """Wait for ``device``'s queued work (a CUDA device; nothing to wait for elsewhere)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_call(step: Step, iters: int, device: torch.device | None = None,
               clock: Callable[[], float] = time.perf_counter) -> float:
    """Mean milliseconds of ``iters`` calls of ``step`` (on a CUDA ``device``, until its
    queued work has finished) by ``clock`` (seconds)."""
    # Collect garbage before, not during, the timed loop: a collection triggered inside it
    # would be charged to whichever provider happened to be running.
    gc.collect()
    synchronize(device)
    start = clock()
    for _ in range(iters):
        step()
    synchronize(device)
    return (clock() - start) * 1e3 / iters


def time_interleaved(
    steps: Mapping[str, Step],
    repeats: int,
    iters: int = 1,
    warmup: int = 1,
    on_repeat: RepeatCallback | None = None,
    device: torch.device | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time each step round-robin; return ``{name: [ms per call, one value per repeat]}``.

    Every step first runs ``warmup`` times untimed (allocator caches, lazy initialisation).
    Each repeat then times ``iters`` consecutive calls of every step. The starting step rotates
    from one repeat to the next so that no provider always runs first (or right after the
    same neighbour). ``on_repeat(index, {name: ms})`` is called after each repeat (progress).
    With a CUDA ``device`` each timing waits for the device to finish the steps' work.
    ``clock`` reads seconds (wall-clock by default; ``time.thread_time`` counts only this
    thread's CPU time, which time the process spends descheduled does not inflate).
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(repeats):
        shift = index % len(names)
        this_repeat = {}
        for name in names[shift:] + names[:shift]:
            this_repeat[name] = _time_call(steps[name], iters, device, clock)
            samples[name].append(this_repeat[name])
        if on_repeat is not None:
            on_repeat(index, {name: this_repeat[name] for name in names})
    return samples


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"NxCxHxW,..."`` as shapes of four positive integers; ValueError naming the item
    otherwise."""
    shapes = []
    for item in text.split(","):
        try:
            shape = tuple(int(n) for n in item.strip().lower().split("x"))
        except ValueError:
            shape = ()
        if len(shape) != 4 or min(shape) < 1:
            raise ValueError(f"{item.strip()!r} is not NxCxHxW (four positive integers, e.g. "
                             f"32x256x56x56)")
        shapes.append(shape)
    return shapes


def progress_printer(prefix: str, repeats: int) -> RepeatCallback:
    """A ``time_interleaved`` callback printing one line per repeat to stderr."""

    def report(index: int, times_ms: dict[str, float]) -> None:
        timings = "  ".join(f"{name} {ms:.2f}" for name, ms in times_ms.items())
        print(f"{prefix}repeat {index + 1}/{repeats} (ms): {timings}", file=sys.stderr, flush=True)

    return report


#: How far the 1-minute load average may exceed the cores a timed run leaves free before the
#: run counts as sharing its cores: an idle machine's load is not 0 (the shell, the timing
#: process's own start-up; 0.25 at this 2-core VM's start), and another job is about 1 per
#: busy core.
LOAD_MARGIN = 0.5
#: The period of the 1-minute load average's exponential decay, in seconds.
LOAD_PERIOD_S = 60.0


def load_average() -> float | None:
    """The machine's 1-minute load average (``os.getloadavg()[0]``: processes running or
    waiting for a core, averaged), or None where the platform has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


@dataclass(frozen=True)
class MachineLoad:
    """The 1-minute load average read before and after a timed run of ``threads`` threads
    that took ``seconds`` on a machine of ``cores`` cores, and whether other work shared the
    cores the run used: the load before it, or after it less the most the run itself can have
    added (``threads x (1 - exp(-seconds / 60))``, the load average's decay), above the
    cores it left free (``cores - threads``) by more than :data:`LOAD_MARGIN`."""

    before: float | None
    after: float | None
    seconds: float
    threads: int
    cores: int

    @property
    def free_cores(self) -> int:
        return max(self.cores - self.threads, 0)

    @property
    def own_at_most(self) -> float:
        """The most the run's own threads can have added to the load average after it."""
        return self.threads * (1.0 - math.exp(-max(self.seconds, 0.0) / LOAD_PERIOD_S))

    @property
    def others(self) -> float | None:
        """The load of other work: the larger of the load before and the load after less
        :attr:`own_at_most` (None: no load average on this platform)."""
        seen = [value for value in (self.before, None if self.after is None else
                                    self.after - self.own_at_most) if value is not None]
        return max(seen) if seen else None

    @property
    def busy(self) -> bool:
        others = self.others
        return others is not None and others > self.free_cores + LOAD_MARGIN

    def note(self) -> str | None:
        """One line saying the machine was busy, naming the figures; None when it was not."""
        if not self.busy:
            return None
        after = "n/a" if self.after is None else f"{self.after:.2f}"
        before = "n/a" if self.before is None else f"{self.before:.2f}"
        return (f"the machine was busy: 1-minute load average {before} before the run and "
                f"{after} after it ({self.seconds:.0f} s; at most {self.own_at_most:.2f} of it "
                f"this run's), with {self.threads} thread(s) on {self.cores} core(s) leaving "
                f"{self.free_cores} free: other work shared the cores, so the times and their "
                f"ratios are a busy machine's; rerun when the load is below "
                f"{self.free_cores + LOAD_MARGIN:g}, or with fewer --threads")

    def to_json(self) -> dict[str, Any]:
        return {"load_average_1min_before": self.before,
                "load_average_1min_after": self.after, "run_seconds": round(self.seconds, 2),
                "threads": self.threads, "cores": self.cores, "free_cores": self.free_cores,
                "own_load_at_most": round(self.own_at_most, 3), "margin": LOAD_MARGIN,
                "busy": self.busy, "note": self.note()}


__all__ = [
    "LOAD_MARGIN", "RESNEXT101_STAGES", "MachineLoad", "OutputPathError", "check_output_file",
    "check_output_folder", "load_average", "machine_info", "parse_shapes", "progress_printer",
    "set_threads", "synchronize", "time_interleaved", "train_step", "training_step",
    "write_atomic", "write_json", "write_text_atomic",
]
