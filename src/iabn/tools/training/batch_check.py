"""Before a run writes anything: does every batch-norm layer see at least two values per
channel in training at the configured batch?

Batch norm in training divides by the batch variance, which one value does not have (PyTorch
and iabn raise at the first step). Whether a batch is large enough depends on the network:
a layer after the last downsampling of ResNet-18 sees one pixel per image at 16x16 inputs, so
one image per rank fails there. The model is built once more on the ``meta`` device (shapes
only: no memory, no arithmetic, no random numbers drawn) and run on one training sample's
shape (as the task's ``forward`` calls it), with hooks recording what each norm layer sees;
synchronised layers (``iabn_sync`` under ``torchrun``) count the batch of every rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm

from ...distributed import ABNSync, InPlaceABNSync
from .config import Config, ConfigError
from .ranks import Ranks
from .task import DataSplits, Task

SYNCHRONISED = (nn.SyncBatchNorm, InPlaceABNSync, ABNSync)


def _batch_norms(model: nn.Module) -> dict[str, nn.Module]:
    """The layers that normalise over the batch (instance norms normalise each sample)."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, _NormBase) and not isinstance(module, _InstanceNorm)}


def _recorder(seen: dict[str, Any], name: str) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:  # None: the input unchanged
        seen.setdefault(name, (type(module).__name__, tuple(args[0].shape)))

    return hook


def values_per_sample(task: Task, config: Config, splits: DataSplits) -> dict[str, Any]:
    """``{layer name: (type name, input shape at batch 2)}`` for every batch-norm layer the
    training forward reaches; empty when the model cannot be run on ``meta`` (the check is
    then left to the first step)."""
    try:
        sample = splits.train[(0, 0)][0]
    except Exception:  # a data problem shows up, with its message, in training
        return {}
    if not isinstance(sample, torch.Tensor):
        return {}
    seen: dict[str, Any] = {}
    meta = Ranks(0, 1, 0, torch.device("meta"))
    try:
        with torch.device("meta"):
            model = task.build_model(config, splits, meta)
        for name, module in _batch_norms(model).items():
            module.register_forward_pre_hook(_recorder(seen, name))
        model.train()
        with torch.no_grad():
            # the model itself, not task.forward: what the norm layers see is the same, and
            # a task may count or log its forwards
            model(torch.empty((2, *sample.shape), dtype=sample.dtype, device="meta"))
    except Exception:  # best effort (e.g. a layer without a meta form): what the hooks saw counts
        pass
    return seen


def check_training_batch(task: Task, config: Config, splits: DataSplits, model: nn.Module,
                         per_rank: int, ranks: Ranks) -> None:
    """Raise :class:`ConfigError` naming ``data.batch_size`` and the first layer that would
    see fewer than two values per channel (``model``: the run's own, to tell which layers
    synchronise over ranks)."""
    synchronised = {name for name, module in _batch_norms(model).items()
                    if isinstance(module, SYNCHRONISED)} if ranks.distributed else set()
    for name, (kind, shape) in values_per_sample(task, config, splits).items():
        pixels = math.prod(shape[2:])
        samples = per_rank * (ranks.world_size if name in synchronised else 1)
        if samples * pixels >= 2:
            continue
        ranks_counted = ranks.world_size if name in synchronised else 1
        needed = math.ceil(2 / (pixels * ranks_counted)) * ranks.world_size
        size = "x".join(str(s) for s in shape[2:]) or "1"
        raise ConfigError(
            f"data.batch_size={config['data']['batch_size']} gives layer {name} "
            f"({kind}) {samples} sample(s) of {size} pixel(s) per channel to normalise in "
            f"training; batch norm needs at least 2 values: use data.batch_size >= {needed}"
            + (f" ({needed // ranks.world_size} per rank)" if ranks.world_size > 1 else "")
            + ", or larger training crops")


__all__ = ["check_training_batch", "values_per_sample"]
