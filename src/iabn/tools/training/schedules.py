"""Learning-rate schedules as closed-form multipliers of the base rate, with linear warm-up.

The multiplier at time ``t`` (the epoch index, or the number of optimizer steps applied when
the schedule updates per step: a step that fp16's loss scaler skips does not count) is
``warmup(t) * main(t)``. With progress ``p = min(t / T, 1)`` over the whole run ``T`` and
``r = final_lr / lr``:

    constant   1                        linear  r + (1 - r) * (1 - p)
    step       gamma ** (t // step_size)    poly    r + (1 - r) * (1 - p) ** power
    multistep  gamma ** #{m <= t}       cosine  r + (1 - r) * (1 + cos(pi * p)) / 2
    warmup(t)  = f + (1 - f) * t / W for t < W (f = warmup_factor), else 1

``step_size``, ``milestones`` and ``W`` are configured in epochs and converted to steps for
per-step updates, so "decay at epoch 30" means the same either way. Milestones count from the
start of the run, not from the end of the warm-up. These match ``torch.optim.lr_scheduler``'s
StepLR, MultiStepLR, LinearLR, PolynomialLR and CosineAnnealingLR (chained after a LinearLR
warm-up); a closed form keeps resumed runs exact and the state trivially small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


@dataclass
class LRFactor:
    """The multiplier of the base learning rate at time ``t`` (module doc); all times are in
    the same unit as ``t``. A plain object, so ``LambdaLR.state_dict`` can store it."""

    kind: str
    total: float
    step_size: float = 1.0
    milestones: list[float] = field(default_factory=list)
    gamma: float = 0.1
    power: float = 1.0
    final_ratio: float = 0.0
    warmup: float = 0.0
    warmup_factor: float = 1.0

    def main(self, t: float) -> float:
        progress = min(t / self.total, 1.0)
        r = self.final_ratio
        if self.kind == "constant":
            return 1.0
        if self.kind == "step":
            return self.gamma ** math.floor(t / self.step_size)
        if self.kind == "multistep":
            return self.gamma ** sum(1 for m in self.milestones if m <= t)
        if self.kind == "linear":
            return r + (1.0 - r) * (1.0 - progress)
        if self.kind == "poly":
            return r + (1.0 - r) * (1.0 - progress) ** self.power
        if self.kind == "cosine":
            return r + (1.0 - r) * (1.0 + math.cos(math.pi * progress)) / 2.0
        raise ValueError(f"unknown schedule {self.kind!r}")

    def __call__(self, t: int) -> float:
        factor = self.main(t)
        if t < self.warmup:
            factor *= self.warmup_factor + (1.0 - self.warmup_factor) * t / self.warmup
        return factor


def lr_factor(schedule: dict[str, Any], base_lr: float, steps_per_epoch: int) -> LRFactor:
    """The :class:`LRFactor` of a ``schedule`` config section (see
    :data:`iabn.tools.training.config.ENGINE_SCHEMA`), in epochs or steps per
    ``schedule.update``."""
    unit = steps_per_epoch if schedule["update"] == "step" else 1
    return LRFactor(
        kind=schedule["type"],
        total=schedule["epochs"] * unit,
        step_size=schedule["step_size"] * unit,
        milestones=[m * unit for m in schedule["milestones"]],
        gamma=schedule["gamma"],
        power=schedule["power"],
        final_ratio=schedule["final_lr"] / base_lr if base_lr > 0 else 0.0,
        warmup=schedule["warmup_epochs"] * unit,
        warmup_factor=schedule["warmup_factor"],
    )


def build_scheduler(optimizer: Optimizer, schedule: dict[str, Any],
                    steps_per_epoch: int) -> LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_factor` to every parameter group; call ``step()``
    after every optimizer step (``update="step"``) or after every epoch (``"epoch"``)."""
    base_lr = optimizer.param_groups[0]["lr"]
    return LambdaLR(optimizer, lr_factor(schedule, base_lr, steps_per_epoch))


__all__ = ["LRFactor", "build_scheduler", "lr_factor"]
