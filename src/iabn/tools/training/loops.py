"""The per-batch plumbing shared by training and evaluation: device placement, memory format,
autocast, and the distributed evaluation loop."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .progress import ProgressLine, bar
from .ranks import Ranks, all_reduce_sum
from .task import Task

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast to ``precision`` (``"fp32"``: a no-op context)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def to_device(batch: Any, device: torch.device, channels_last: bool) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` on ``device``; 4-D inputs in the requested memory format."""
    inputs, targets = batch
    inputs = inputs.to(device, non_blocking=True)
    if channels_last and inputs.dim() == 4:
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return inputs, targets.to(device, non_blocking=True)


def evaluate(task: Task, model: nn.Module, batches: Iterable[Any], ranks: Ranks,
             precision: str = "fp32", channels_last: bool = False,
             progress: ProgressLine | None = None, total: int = 0) -> dict[str, float]:
    """The task's metrics over ``batches`` (this rank's share), summed over all ranks.

    ``model`` must not be wrapped in DDP: ranks may hold different numbers of batches, and
    DDP's forward may start collectives that would then wait forever.
    """
    model.eval()
    meter = task.new_meter(ranks.device)
    with torch.no_grad():
        for done, batch in enumerate(batches, 1):
            inputs, targets = to_device(batch, ranks.device, channels_last)
            with autocast(ranks.device, precision):
                outputs = task.forward(model, inputs)
                loss = task.loss(outputs, targets)
            meter.update(outputs, targets, loss)
            if progress is not None:
                progress.show(f"evaluating {bar(done, total)} {done}/{total}")
    if progress is not None:
        progress.end()
    return meter.summarize(all_reduce_sum(meter.sums, ranks))


__all__ = ["AUTOCAST_DTYPES", "autocast", "evaluate", "memory_format", "to_device"]
