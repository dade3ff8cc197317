"""``network.memory_budget``: the run's model planned with :func:`iabn.plan` at one training
batch's shape, so that the activations it keeps for backward fit the budget.

The plan is lossless (in-place units where exact, recomputation with running statistics
updated once, offloading on CUDA): training computes what the model as built computes, to
rounding. It runs under the run's autocast, at the per-rank batch of training samples'
shape, on the run's device, and leaves the random streams as they were. The planned model keeps
the ``state_dict`` keys, so snapshots load into the model as built (``iabn test``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .batch_check import SYNCHRONISED
from .config import ConfigError
from .loops import autocast


def plan_model(model: nn.Module, budget: float, sample: torch.Tensor, per_rank: int,
               device: torch.device, precision: str, channels_last: bool,
               distributed: bool) -> tuple[nn.Module, Any]:
    """``(planned model, iabn.PlanReport)``; :class:`ConfigError` naming
    ``network.memory_budget`` when the budget is out of reach."""
    import iabn

    if distributed and any(isinstance(m, SYNCHRONISED) for m in model.modules()):
        raise ConfigError("network.memory_budget: planning runs the model's forward many times "
                          "on each rank, which synchronised norm layers (iabn_sync) would "
                          "wait on; use a norm_act that does not synchronise, or no budget")
    value: int | float = int(budget) if budget > 1 else float(budget)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        x = torch.randn((per_rank, *sample.shape), dtype=sample.dtype if
                        sample.is_floating_point() else torch.float32, device=device)
        if channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        with autocast(device, precision):
            try:
                # verify: each converted unit is compared with the original, and one
                # backward pass runs through the planned model before training starts
                planned, report = iabn.plan(model, x, value, policy="lossless", verify=True)
            except ValueError as error:
                raise ConfigError(f"network.memory_budget={budget:g}: {error}") from None
    return planned, report


def summary(report: Any) -> str:
    """One line for the run's log."""
    counts = ", ".join(f"{n} {choice}" for choice, n in report.counts.items())
    return (f"memory plan: {report.measured / 2**20:.2f} MiB of activations kept for backward "
            f"({report.measured / report.as_given:.3f} of the model's {report.as_given / 2**20:.2f}"
            f" MiB; budget {report.budget / 2**20:.2f} MiB): {counts}; predicted extra time "
            f"{100 * report.overhead:.1f} %")


__all__ = ["plan_model", "summary"]
