"""Run the test suite and keep its log with what it ran on: the record a GPU run leaves behind.

The log of every whole-suite run on a GPU machine is committed under
``benchmarks/results/``, with the device, driver, torch and Triton versions and the date, so
that switching ``IABN_BACKEND=auto`` to the Triton kernels rests on a green run anyone can read.
This script runs ``python -m pytest -q`` with the given arguments (default ``-n 8`` when
pytest-xdist is installed), streams its output, and writes the header and the whole output to
``runs/benchmarks/suite_<device>.log``, or with ``IABN_COMMIT_RESULTS=1`` the committed
``benchmarks/results/suite_<device>.log`` (atomically). It exits with pytest's exit code. On
SIGINT (a time limit: the GPU campaign caps its test parts) pytest reports the failures it has
seen, and the log is written with that report.

Usage::

    python benchmarks/suite_log.py [--log PATH] [-- PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _command_output(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def header() -> list[str]:
    """``key: value`` lines: date, host, versions, device and driver."""
    import torch

    lines = [
        f"date_utc: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"platform: {platform.platform()}",
        f"python: {platform.python_version()}",
        f"torch: {torch.__version__} (CUDA {torch.version.cuda})",
    ]
    if importlib.util.find_spec("triton") is not None:
        import triton

        lines.append(f"triton: {triton.__version__}")
    git = _command_output(["git", "-C", str(ROOT), "rev-parse", "HEAD"])
    lines.append(f"commit: {git or 'unknown'}")
    if torch.cuda.is_available():
        lines.append(f"device: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}")
        driver = _command_output(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"])
        lines.append(f"driver: {driver.splitlines()[0] if driver else 'unknown'}")
    else:
        lines.append("device: cpu (no CUDA)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, default=None,
                        help="log file (default: runs/benchmarks/suite_<cuda|cpu>.log; "
                        "benchmarks/results/ with IABN_COMMIT_RESULTS=1)")
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    import torch

    from iabn.tools.bench import write_text_atomic

    pytest_args = args.pytest_args
    if not pytest_args and importlib.util.find_spec("xdist") is not None:
        pytest_args = ["-n", "8"]
    command = [sys.executable, "-m", "pytest", "-q", *pytest_args]
    lines = [*header(), f"command: {' '.join(command[1:])}", ""]
    print("\n".join(lines), flush=True)
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None

    def copy_output() -> None:
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))

    try:
        copy_output()
    except KeyboardInterrupt:
        # a time limit's SIGINT reaches pytest too (one process group): it reports the
        # failures it has seen and ends; keep that and write the log
        lines.append("=== suite_log: interrupted (SIGINT); pytest's report follows")
        copy_output()
    code = process.wait()
    lines.append(f"exit code: {code}")
    from iabn.tools.bench import results_folder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = args.log or results_folder(RESULTS) / f"suite_{device}.log"
    write_text_atomic(path, "\n".join(lines) + "\n", parents=True)
    print(f"log written to {path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
