"""The planner's predicted step of a converted transformer against its measured step, on CPU.

timm's ``vit_small_patch16_224`` (random weights, 10 classes, training mode, float32) at a
small batch: ``iabn.plan(model, x, smallest, allow=["inplace"])`` converts every unit it can
(each block is converted on its own; ``benchmarks/results/plan_transformer_cpu.json`` lists
what). The plan's predicted step is the report's ``predicted_step_ms`` (the model as
given: counted operations over the calibrated rates, :mod:`iabn.planning.cost`) plus
``predicted_overhead_ms`` (the converted layers' measured extra time,
:mod:`iabn.planning.recovery`). Both models' training
steps (forward, ``sum``, backward) are then timed side by side
(:func:`iabn.tools.bench.time_interleaved`, one thread): the JSON has the medians, the
fastest and the median of the paired ratios, with the load average before and after (the
figures move with other jobs on a shared machine; the rows say how loaded it was).

``error`` rows: the plan's predicted step against its measured median and fastest step, the
predicted step of the model as given against the measured one, and the predicted overhead
against the measured difference of the two models (medians, and fastest).

Usage::

    python benchmarks/plan_transformer.py [--batch 2] [--repeats 7] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from statistics import median

import torch

import iabn
from iabn.tools.bench import (
    machine_info,
    results_folder,
    set_threads,
    time_interleaved,
    write_json,
)

RESULTS = results_folder(Path(__file__).resolve().parent / "results")


def _smallest(model: torch.nn.Module, x: torch.Tensor) -> int:
    """The fewest bytes an in-place-only plan reaches (the second plan converts all)."""
    return iabn.plan(copy.deepcopy(model), x, 1.0, allow=["inplace"])[1].smallest


def measure(batch: int, repeats: int) -> dict:
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_small_patch16_224", num_classes=10).train()
    x = torch.randn(batch, 3, 224, 224)
    started = time.perf_counter()
    budget = _smallest(model, x)
    planned, report = iabn.plan(copy.deepcopy(model), x, budget, allow=["inplace"])
    planning_s = time.perf_counter() - started

    def step(m: torch.nn.Module):
        def run() -> None:
            m(x).sum().backward()
        return run

    load_before = os.getloadavg()
    times = time_interleaved({"given": step(model), "planned": step(planned)}, repeats,
                             warmup=1)
    load_after = os.getloadavg()
    given, plan = times["given"], times["planned"]
    predicted = report.predicted_step_ms + report.predicted_overhead_ms
    ratios = [p / g for p, g in zip(plan, given, strict=True)]
    converted = sorted({f"{type(m).__name__}" for m in planned.modules()
                        if type(m).__module__.startswith("iabn.layers")})
    result = {
        "converted_layers": converted,
        "batch": batch, "repeats": repeats, "planning_s": planning_s,
        "counts": report.counts, "budget": budget, "as_given_bytes": report.as_given,
        "plan_bytes": report.measured,
        "predicted_step_given_ms": report.predicted_step_ms,
        "predicted_overhead_ms": report.predicted_overhead_ms,
        "predicted_step_plan_ms": predicted,
        "measured_given_ms": {"median": median(given), "fastest": min(given), "all": given},
        "measured_plan_ms": {"median": median(plan), "fastest": min(plan), "all": plan},
        "paired_ratio": {"median": median(ratios), "min": min(ratios), "max": max(ratios)},
        "error": {
            "plan_step_vs_median": predicted / median(plan) - 1,
            "plan_step_vs_fastest": predicted / min(plan) - 1,
            "given_step_vs_median": report.predicted_step_ms / median(given) - 1,
            "given_step_vs_fastest": report.predicted_step_ms / min(given) - 1,
            "overhead_vs_median_difference":
                report.predicted_overhead_ms / (median(plan) - median(given)) - 1,
            "overhead_vs_fastest_difference":
                report.predicted_overhead_ms / (min(plan) - min(given)) - 1,
        },
        "speed": report.speed,
        "load_average_before": load_before, "load_average_after": load_after,
    }
    for key, value in result["error"].items():
        print(f"{key:34} {100 * value:+6.1f} %")
    print(f"predicted: given {report.predicted_step_ms:.0f} ms + overhead "
          f"{report.predicted_overhead_ms:.0f} ms; measured medians: given {median(given):.0f}"
          f" ms, plan {median(plan):.0f} ms; load {load_before} -> {load_after}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        parser.error(f"--batch {args.batch} --repeats {args.repeats}: both must be >= 1")
    threads = set_threads(args.threads)
    result = measure(args.batch, args.repeats)
    write_json(args.json or RESULTS / "plan_transformer_cpu.json",
               {"machine": machine_info("cpu"), "threads": threads, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
