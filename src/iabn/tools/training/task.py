"""What a task (classification, segmentation, ...) gives the generic training engine.

The engine (:mod:`iabn.tools.training.engine`) owns the loop, ``torchrun``/DDP, the optimizer and
schedule, autocast and channels_last, snapshots and exact resume, logs, TensorBoard and the
progress bar. A task owns what is specific to its problem: its config keys, data, model, loss
and metrics. See the package docstring for the full contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from .config import Config, Schema
from .ranks import Ranks


@dataclass
class DataSplits:
    """A task's data: ``train`` is indexed by the ``(index, seed)`` keys of
    :class:`~iabn.tools.data.samplers.ShuffledShardSampler` (the seed drives its augmentation),
    ``val`` by plain indices. Both yield ``(input, target)`` pairs the default collate can
    batch. ``description`` is one line for the log. ``metadata``: plain data (strings,
    numbers, lists, dicts) the snapshots keep as ``"dataset"``, for tools that use a trained
    model without its data (e.g. a segmentation dataset's class names and colours)."""

    train: Dataset
    val: Dataset
    num_classes: int
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)


class Meter(Protocol):
    """Accumulates a task's metrics as sums, so the engine can add them up over ranks.

    ``sums`` is a 1-D float64 tensor on the run's device whose meaning is the task's own
    (e.g. loss sum, correct top-1, correct top-5, sample count).
    """

    sums: Tensor

    def update(self, outputs: Tensor, targets: Tensor, loss: Tensor) -> None:
        """Add one batch (``loss`` is the batch's mean loss, detached)."""

    def summarize(self, sums: Tensor) -> dict[str, float]:
        """Named metrics (``"loss"`` among them) from ``sums`` added over every rank."""


class Task(Protocol):
    """The task-specific half of a training run (see the package docstring)."""

    name: str
    """Stored in snapshots; a snapshot of another task is refused on resume."""
    schema: Schema
    """Config keys the task adds to :data:`~iabn.tools.training.config.ENGINE_SCHEMA`."""
    best_metric: str
    """The :meth:`Meter.summarize` key whose highest value selects ``best.pth``."""

    def check_config(self, config: Config, source: str) -> None:
        """Raise :class:`~iabn.tools.training.config.ConfigError` for key combinations the task
        cannot run; called before anything is built or written."""

    def datasets(self, config: Config) -> DataSplits:
        """Training and validation data (errors name the folder or key to fix)."""

    def build_model(self, config: Config, splits: DataSplits, ranks: Ranks) -> nn.Module:
        """The model, on CPU; the engine moves it and wraps it in DDP."""

    def forward(self, model: nn.Module, inputs: Tensor) -> Tensor:
        """The outputs :meth:`loss` and the meter take (inside autocast)."""

    def loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """The mean loss of a batch (a scalar)."""

    def new_meter(self, device: torch.device) -> Meter:
        """An empty meter for one epoch of training or one evaluation."""


__all__ = ["DataSplits", "Meter", "Task"]
