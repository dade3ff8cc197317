"""Seeding, and the random-number-generator states a snapshot keeps so a resumed run continues
exactly: torch (CPU and every CUDA device), NumPy's global generator and Python's ``random``.

States are stored as tensors, numbers and lists only, so snapshots load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed torch (all devices), NumPy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states (see module doc)."""
    numpy_state = np.random.get_state(legacy=False)
    version, python_state, gauss_next = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "python": {"version": version, "state": torch.tensor(python_state, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    torch.set_rng_state(state["torch"])
    # CUDA states only onto the same number of devices (a run moved to another machine
    # cannot continue bitwise anyway).
    if state["cuda"] and torch.cuda.is_available() and (
            len(state["cuda"]) == torch.cuda.device_count()):
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy_state = state["numpy"]
    np.random.set_state({
        "bit_generator": "MT19937",
        "state": {"key": numpy_state["key"].numpy().astype(np.uint32),
                  "pos": numpy_state["pos"]},
        "has_gauss": numpy_state["has_gauss"],
        "gauss": numpy_state["gauss"],
    })
    python_state = state["python"]
    random.setstate((python_state["version"], tuple(python_state["state"].tolist()),
                     python_state["gauss_next"]))


__all__ = ["capture_rng_state", "restore_rng_state", "seed_everything"]
