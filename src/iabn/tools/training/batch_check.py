"""Before a run writes anything: can the network train on the training inputs' shape, and
does every batch-norm layer see at least two values per channel at the configured batch?

Batch norm in training divides by the batch variance, which one value does not have (PyTorch
and iabn raise at the first step). Whether a batch is large enough depends on the network:
a layer after the last downsampling of ResNet-18 sees one pixel per image at 16x16 inputs, so
one image per rank fails there. The model is built once more on the ``meta`` device (shapes
only: no memory, no arithmetic, no random numbers drawn) and run on one training sample's
shape (as the task's ``forward`` calls it), with hooks recording what each norm layer sees;
synchronised layers (``iabn_sync`` under ``torchrun``) count the batch of every rank. A layer
that fails on those shapes (a pooling window larger than its input, as DenseNet's at 16x16)
is reported too; errors of running on ``meta`` itself (an operation without a meta form, one
that reads values) leave the check to the first step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm

from ...distributed import ABNSync, InPlaceABNSync
from ..bench.module_trace import trace_modules
from .config import Config, ConfigError
from .ranks import Ranks
from .task import DataSplits, Task

SYNCHRONISED = (nn.SyncBatchNorm, InPlaceABNSync, ABNSync)


def _batch_norms(model: nn.Module) -> dict[str, nn.Module]:
    """The layers that normalise over the batch (instance norms normalise each sample)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, _NormBase) and not isinstance(module, _InstanceNorm)}


@dataclass
class Probe:
    """What a training forward on ``meta`` found: ``norms`` maps every batch-norm layer it
    reached to ``(type name, input shape at batch 2)``; ``failure`` is ``(layer, type name,
    error)`` when a layer could not run on the training input's shape."""

    sample_shape: tuple[int, ...] = ()
    norms: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    failure: tuple[str, str, Exception] | None = None


def _shape_error(error: Exception) -> bool:
    """An error of the network on these shapes, not of running it on ``meta`` (an operation
    without a meta form, or one that needs values, such as ``.item()``)."""
    return isinstance(error, (RuntimeError, ValueError)) and not isinstance(
        error, NotImplementedError) and "meta" not in str(error).lower()


def probe(task: Task, config: Config, splits: DataSplits) -> Probe:
    """Run the task's model on ``meta`` at a batch of 2 training samples' shape (see module
    doc); an empty :class:`Probe` when there is no sample to take the shape of."""
    try:
        sample = splits.train[(0, 0)][0]
    except Exception:  # a data problem shows up, with its message, in training
        return Probe()
    if not isinstance(sample, torch.Tensor):
        return Probe()
    found = Probe(tuple(sample.shape))

    def record(name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        if name in norms and args and isinstance(args[0], torch.Tensor):
            found.norms.setdefault(name, (type(module).__name__, tuple(args[0].shape)))

    norms: dict[str, nn.Module] = {}
    running: list[tuple[str, nn.Module]] = []  # the modules whose forward is under way
    try:
        with torch.device("meta"):
            model = task.build_model(config, splits, Ranks(0, 1, 0, torch.device("meta")))
        norms = _batch_norms(model)
        model.train()
        with trace_modules(model, record) as trace, torch.no_grad():
            running = trace.running
            # the model itself, not task.forward: what the layers see is the same, and a task
            # may count or log its forwards
            model(torch.empty((2, *sample.shape), dtype=sample.dtype, device="meta"))
    except Exception as error:  # best effort: what the hooks saw still counts
        if running and _shape_error(error):
            name, module = running[-1]
            found.failure = (name or "(the model)", type(module).__name__, error)
    return found


def check_training_batch(task: Task, config: Config, splits: DataSplits, model: nn.Module,
                         per_rank: int, ranks: Ranks) -> None:
    """Raise :class:`ConfigError` for a training input the network cannot run on, or naming
    ``data.batch_size`` and the first batch-norm layer that would see fewer than two values
    per channel (``model``: the run's own, to tell which layers synchronise over ranks)."""
    found = probe(task, config, splits)
    if found.failure is not None:
        name, kind, error = found.failure
        shape = "x".join(str(s) for s in found.sample_shape)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"the network cannot train on {shape} inputs: layer {name} ({kind}) "
                          f"fails: {first}; use larger training crops or another network")
    synchronised = {name for name, module in _batch_norms(model).items()
                    if isinstance(module, SYNCHRONISED)} if ranks.distributed else set()
    for name, (kind, shape) in found.norms.items():
        pixels = math.prod(shape[2:])
        ranks_counted = ranks.world_size if name in synchronised else 1
        samples = per_rank * ranks_counted
        if samples * pixels >= 2:
            continue
        needed = math.ceil(2 / (pixels * ranks_counted)) * ranks.world_size
        size = "x".join(str(s) for s in shape[2:]) or "1"
        raise ConfigError(
            f"data.batch_size={config['data']['batch_size']} gives layer {name} "
            f"({kind}) {samples} sample(s) of {size} pixel(s) per channel to normalise in "
            f"training; batch norm needs at least 2 values: use data.batch_size >= {needed}"
            + (f" ({needed // ranks.world_size} per rank)" if ranks.world_size > 1 else "")
            + ", or larger training crops")


__all__ = ["Probe", "check_training_batch", "probe"]
