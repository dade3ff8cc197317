"""Shared by the end-to-end training tests: a tiny digits config and a way to run ``iabn``.

The tiny run is ResNet-18 on the embedded digits at 16x16, global batch 16, 2 epochs of 3
steps (about a second per epoch on one CPU thread). Subprocesses get one torch thread each, so runs
compared bitwise use the same kernels and the two CPU cores are not oversubscribed.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

TINY_CONFIG = {
    "network": {"arch": "resnet18", "norm_act": "iabn_sync"},
    "optimizer": {"lr": 0.02, "weight_decay": 1e-4},
    "schedule": {"epochs": 2, "max_steps_per_epoch": 3, "type": "cosine", "update": "step",
                 "warmup_epochs": 1},
    "input": {"crop_train": 16, "area_range_train": [0.5, 1.0], "flip_train": False,
              "scale_val": 16, "crop_val": 16, "mean": [0.3] * 3, "std": [0.38] * 3},
    "data": {"batch_size": 16, "val_batch_size": 128, "workers": 0, "digits_size": 16},
    "logging": {"log_every": 1, "progress": False},
}
DIGITS_VAL_IMAGES = 359  # round(0.2 * count) per class of scikit-learn's 1,797 digits


def write_config(path: Path, **sections) -> Path:
    """TINY_CONFIG with ``sections`` merged in (section by section), written to ``path``."""
    config = copy.deepcopy(TINY_CONFIG)
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path.write_text(json.dumps(config))
    return path


def environment() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def iabn_command(*args: str, ranks: int = 1) -> list[str]:
    """``python -m iabn ARGS``, under ``torchrun`` with ``ranks`` CPU processes if > 1."""
    if ranks == 1:
        return [sys.executable, "-m", "iabn", *args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(port), "-m", "iabn", *args]


def run_iabn(*args: str, ranks: int = 1, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(iabn_command(*args, ranks=ranks), env=environment(),
                          capture_output=True, text=True, timeout=timeout)


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@contextmanager
def one_torch_thread():
    """In-process runs with one intra-op thread, as the subprocesses (the cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
