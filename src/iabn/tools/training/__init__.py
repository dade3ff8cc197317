"""Training and evaluation tools: a generic engine and the tasks it runs.

Generic (any task): :mod:`.config` (JSON schema of documented defaults, merge, checks),
:mod:`.engine` (the loop, ``torchrun``/DDP, autocast, channels_last, gradient clipping,
snapshots and exact resume, stop on SIGINT/SIGTERM, divergence), :mod:`.optim` (SGD/Adam/AdamW,
no weight decay on norm layers), :mod:`.schedules` (closed-form learning-rate schedules with
warm-up), :mod:`.snapshot` (atomic files, checked loading), :mod:`.logdir` (the log folder's
checks and lock), :mod:`.batch_check` (a batch every batch-norm layer can train on, checked on
the meta device), :mod:`.ranks` (process group, device, collectives),
:mod:`.rng`, :mod:`.logs` (per-rank log files, TensorBoard), :mod:`.progress`, :mod:`.loops`
(autocast, the distributed evaluation loop).

Classification (``iabn train`` / ``iabn test``): :mod:`.classification` (the task),
:mod:`.classification_data` (ImageFolder or embedded digits, transforms), :mod:`.evaluate`
(single/ten-crop testing, loading weights across norm/activation variants), :mod:`.commands`.

The task interface (:class:`~.task.Task`)
----------------------------------------
A task is an object with::

    name: str             # stored in snapshots; resuming another task's snapshot is refused
    schema: Schema        # its config keys, merged into ENGINE_SCHEMA with config.combine()
    best_metric: str      # the metric whose highest value selects best.pth
    check_config(config, source)          # ConfigError for combinations it cannot run
    datasets(config) -> DataSplits        # train (keys (index, seed)), val (int keys)
    build_model(config, splits, ranks) -> nn.Module       # on CPU; the engine places it
    forward(model, inputs) -> outputs     # inside autocast; model may be DDP-wrapped
    loss(outputs, targets) -> scalar      # mean over the rank's batch
    new_meter(device) -> Meter            # metric sums for one epoch or one evaluation

and a :class:`~.task.Meter` has ``sums`` (a float64 tensor the engine adds over ranks),
``update(outputs, targets, loss)`` and ``summarize(sums) -> {"loss": ..., name: value}``.
Training data items are fetched with ``(index, seed)`` keys: build any randomness of the
sample from ``numpy.random.default_rng(seed)`` (as
:class:`~iabn.tools.data.transforms.TransformedDataset` does) and resumed runs stay exact.

The engine reads these config sections (:data:`~.config.ENGINE_SCHEMA`): ``network``
(``precision``, ``channels_last``), ``optimizer``, ``schedule``, ``data`` (``batch_size``,
``val_batch_size``, ``workers``, ``seed``) and ``logging``; the task adds the rest. A new task
(e.g. segmentation) supplies the object above and calls
``engine.train(task, config, TrainOptions(log_dir, resume, device))``.
"""

import importlib
from typing import Any

# The names below load their module on first use (PEP 562): importing a light submodule, as the
# CLI's parser does with .snapshot, must not pull in the data stack (torchvision) with the tasks.
_EXPORTS = {
    "ClassificationTask": "classification",
    "ENGINE_SCHEMA": "config", "Config": "config", "ConfigError": "config",
    "combine": "config", "load_config": "config",
    "EXIT_FAILED": "engine", "EXIT_FINISHED": "engine", "EXIT_INTERRUPTED": "engine",
    "EXIT_STOPPED": "engine", "TrainOptions": "engine", "TrainingFailed": "engine",
    "train": "engine",
    "TestOptions": "evaluate", "load_weights": "evaluate", "run_test": "evaluate",
    "SnapshotError": "snapshot",
    "DataSplits": "task", "Meter": "task", "Task": "task",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)

__all__ = [
    "ENGINE_SCHEMA",
    "EXIT_FAILED",
    "EXIT_FINISHED",
    "EXIT_INTERRUPTED",
    "EXIT_STOPPED",
    "ClassificationTask",
    "Config",
    "ConfigError",
    "DataSplits",
    "Meter",
    "SnapshotError",
    "Task",
    "TestOptions",
    "TrainOptions",
    "TrainingFailed",
    "combine",
    "load_config",
    "load_weights",
    "run_test",
    "train",
]
