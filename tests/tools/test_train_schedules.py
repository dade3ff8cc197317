"""Learning-rate schedules against torch.optim.lr_scheduler and closed forms written here."""

import math

import pytest
import torch
from torch.optim import lr_scheduler

from iabn.tools.training.config import ENGINE_SCHEMA, defaults
from iabn.tools.training.schedules import build_scheduler

BASE_LR = 0.4
EPOCHS = 12


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)


def _schedule(**values) -> dict:
    section = defaults(ENGINE_SCHEMA)["schedule"]
    section.update(epochs=EPOCHS, **values)
    return section


def _ours(section: dict, steps_per_epoch: int, count: int) -> list[float]:
    return _torch(lambda optimizer: build_scheduler(optimizer, section, steps_per_epoch), count)


def _torch(make, count: int) -> list[float]:
    optimizer = _optimizer()
    scheduler = make(optimizer)
    lrs = []
    for _ in range(count):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


# (our schedule section, the torch scheduler that should give the same per-epoch rates)
TORCH_EQUIVALENTS = {
    "constant": ({"type": "constant"}, lambda o: lr_scheduler.ConstantLR(o, 1.0, 0)),
    "step": ({"type": "step", "step_size": 5, "gamma": 0.3},
             lambda o: lr_scheduler.StepLR(o, 5, 0.3)),
    "multistep": ({"type": "multistep", "milestones": [3, 7], "gamma": 0.5},
                  lambda o: lr_scheduler.MultiStepLR(o, [3, 7], 0.5)),
    "linear": ({"type": "linear", "final_lr": 0.01},
               lambda o: lr_scheduler.LinearLR(o, 1.0, 0.01 / BASE_LR, EPOCHS)),
    "poly": ({"type": "poly", "power": 0.9, "final_lr": 0.0},
             lambda o: lr_scheduler.PolynomialLR(o, EPOCHS, 0.9)),
    "cosine": ({"type": "cosine", "final_lr": 0.02},
               lambda o: lr_scheduler.CosineAnnealingLR(o, EPOCHS, 0.02)),
}


@pytest.mark.parametrize("name", TORCH_EQUIVALENTS)
def test_per_epoch_schedules_match_torch(name):
    section, make = TORCH_EQUIVALENTS[name]
    count = EPOCHS + 1  # up to and including the end, t = T
    torch.testing.assert_close(_ours(_schedule(**section), 7, count), _torch(make, count),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["linear", "poly", "cosine"])
def test_progress_schedules_hold_their_final_value_after_the_end(name):
    # (torch's cosine would rise again after T_max; a run never goes there.)
    lrs = _ours(_schedule(**TORCH_EQUIVALENTS[name][0]), 7, EPOCHS + 4)
    assert lrs[EPOCHS:] == [lrs[EPOCHS]] * 4


def test_per_step_update_counts_epoch_values_in_steps():
    steps = 4
    section = _schedule(type="multistep", milestones=[3, 7], gamma=0.5, update="step")
    expected = _torch(lambda o: lr_scheduler.MultiStepLR(o, [3 * steps, 7 * steps], 0.5),
                      EPOCHS * steps)
    assert _ours(section, steps, EPOCHS * steps) == pytest.approx(expected, rel=1e-12)


def test_warmup_chained_before_step_decay_matches_torch():
    section = _schedule(type="step", step_size=4, gamma=0.5, warmup_epochs=3,
                        warmup_factor=0.2)
    expected = _torch(lambda o: lr_scheduler.ChainedScheduler([
        lr_scheduler.LinearLR(o, 0.2, 1.0, 3), lr_scheduler.StepLR(o, 4, 0.5)]), EPOCHS)
    assert _ours(section, 1, EPOCHS) == pytest.approx(expected, rel=1e-12)


def test_fractional_warmup_then_cosine_and_poly_with_final_lr_closed_forms():
    steps, warmup_epochs, factor = 5, 1.5, 0.1
    total, warmup = EPOCHS * steps, warmup_epochs * steps
    for kind, final in (("cosine", 0.05), ("poly", 0.03)):
        section = _schedule(type=kind, final_lr=final, power=2.0, update="step",
                            warmup_epochs=warmup_epochs, warmup_factor=factor)
        expected = []
        for t in range(total + 2):
            p = min(t / total, 1.0)
            shape = (1 + math.cos(math.pi * p)) / 2 if kind == "cosine" else (1 - p) ** 2
            lr = final + (BASE_LR - final) * shape
            if t < warmup:
                lr *= factor + (1 - factor) * t / warmup
            expected.append(lr)
        assert _ours(section, steps, total + 2) == pytest.approx(expected, rel=1e-12), kind


def test_scheduler_state_round_trip_continues_the_same_rates():
    section = _schedule(type="cosine", final_lr=0.01, update="step", warmup_epochs=1)
    full = _ours(section, 3, 20)
    optimizer = _optimizer()
    scheduler = build_scheduler(optimizer, section, 3)
    for _ in range(8):
        optimizer.step()
        scheduler.step()
    saved_optimizer, saved_scheduler = optimizer.state_dict(), scheduler.state_dict()
    fresh_optimizer = _optimizer()
    fresh = build_scheduler(fresh_optimizer, section, 3)
    fresh_optimizer.load_state_dict(saved_optimizer)
    fresh.load_state_dict(saved_scheduler)
    resumed = []
    for _ in range(12):
        resumed.append(fresh_optimizer.param_groups[0]["lr"])
        fresh_optimizer.step()
        fresh.step()
    assert resumed == full[8:]
