"""CPU speed of one norm + activation layer: standard BatchNorm vs InPlace-ABN.

Providers, all on the same ``(8, C, H, W)`` float32 input and the same weights:

``standard``  ``nn.BatchNorm2d`` + ``nn.LeakyReLU(0.01, inplace=True)`` (what users replace)
``iabn_II``   ``iabn.InPlaceABN`` (variant II, the default) — the headline
``iabn_I``    ``iabn.InPlaceABN(variant=1)``
``abn``       ``iabn.ABN`` (not in place)

Shapes are the four stages of ResNeXt-101 (C = 256/512/1024/2048 at 56/28/14/7 pixels).

One step is ``out = layer(leaf.clone()); out.backward(grad)`` for every provider: the in-place
layer must get a fresh non-leaf input each time, so everyone gets it the same way, and the same
fixed upstream gradient. The clone is part of every provider's step, so the headline ratio
``iabn_II / standard`` is of full step times. The clone's own cost ("prep": the forward copy
only; its backward just hands the gradient through) is timed as a sixth provider, and the
ratio net of it, ``(t - prep) / (t_standard - prep)``, is reported next to the raw one.

Timing: ``--repeats`` interleaved repeats (each provider once per repeat, in a rotating
order), each timing ``--iters`` consecutive steps after a warm-up; the median over repeats is
shown. Two ways to interleave:

``--isolate`` (default)
    every (repeat, provider) runs in a fresh worker process that times all shapes. On the
    project's CPU machines the step time depends strongly on the state of the C heap (glibc
    returns large freed blocks to the OS, so re-used vs. freshly page-faulted buffers differ
    by up to 2x), and in one process each provider inherits the heap the others left
    behind. Separate processes give each provider the heap its own allocations make, as in a
    training run that uses one kind of layer.
``--in-process``
    all providers in one process, one after the other within each repeat (faster to run;
    shows the heap interaction, which can favour either side).

Usage::

    python benchmarks/cpu_speed.py [--threads 2] [--repeats 11] [--in-process] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from statistics import median, quantiles
from typing import Any

import torch
from torch import Tensor, nn

import iabn
from iabn.tools.bench import (
    RESNEXT101_STAGES,
    machine_info,
    progress_printer,
    results_folder,
    set_threads,
    time_interleaved,
    training_step,
    write_json,
)

SHAPES = RESNEXT101_STAGES
PROVIDERS = ("standard", "iabn_II", "iabn_I", "abn")
BASELINE = "standard"
HEADLINE = "iabn_II"
PREP = "prep"
TARGET_RATIO = 1.10
NEGATIVE_SLOPE = 0.01
DEFAULT_JSON = results_folder(Path(__file__).resolve().parent / "results") / "cpu_speed.json"


def make_layer(provider: str, channels: int) -> nn.Module:
    """The norm + LeakyReLU(0.01) layer of ``provider`` for ``channels`` channels."""
    if provider == "standard":
        return nn.Sequential(
            nn.BatchNorm2d(channels), nn.LeakyReLU(NEGATIVE_SLOPE, inplace=True)
        )
    if provider == "iabn_II":
        return iabn.InPlaceABN(channels, activation_param=NEGATIVE_SLOPE, variant=2)
    if provider == "iabn_I":
        return iabn.InPlaceABN(channels, activation_param=NEGATIVE_SLOPE, variant=1)
    if provider == "abn":
        return iabn.ABN(channels, activation_param=NEGATIVE_SLOPE)
    raise ValueError(f"unknown provider {provider!r}")


def make_layers(channels: int) -> dict[str, nn.Module]:
    """One layer per provider, all with the standard layer's (randomised) state."""
    layers = {p: make_layer(p, channels) for p in PROVIDERS}
    bn = layers["standard"][0]
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_(0.0, 0.2)
    for provider, layer in layers.items():
        if provider != "standard":
            layer.load_state_dict(bn.state_dict())
        layer.train()
    return layers


def make_prep_step(leaf: Tensor):
    """The part of every step that is not the layer: producing the non-leaf input."""

    def step() -> None:
        leaf.grad = None
        leaf.clone()

    return step


def calibrate_iters(step, target_ms: float) -> int:
    """Steps per repeat so that one repeat of one provider takes about ``target_ms``."""
    # The fastest of three single steps: a step slowed by other load (or by first-touch page
    # faults) would otherwise set a far too small count.
    times_ms = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times_ms.append((time.perf_counter() - start) * 1e3)
    return max(1, min(200, math.ceil(target_ms / max(min(times_ms), 1e-3))))


def shape_steps(batch: int, channels: int, size: int, seed: int, providers) -> dict:
    """The step of each of ``providers`` (prep included) on ``(batch, channels, size, size)``."""
    torch.manual_seed(seed)
    shape = (batch, channels, size, size)
    leaf = torch.randn(shape).requires_grad_()
    grad = torch.randn(shape)
    layers = make_layers(channels)
    steps = {p: training_step(layers[p], leaf, grad) for p in providers if p != PREP}
    if PREP in providers:
        steps[PREP] = make_prep_step(leaf)
    return steps


def summarise(shape: tuple[int, ...], iters: int, samples: dict[str, list[float]]) -> dict:
    """One table row from the per-repeat samples (ms per step) of every provider."""
    medians = {p: median(s) for p, s in samples.items()}
    prep, base = medians[PREP], medians[BASELINE]
    ratio = {p: medians[p] / base for p in PROVIDERS}
    net_ratio = {p: (medians[p] - prep) / (base - prep) for p in PROVIDERS}
    # The spread of the ratio within the repeats shows how far one run can be trusted.
    paired = sorted(a / b for a, b in zip(samples[HEADLINE], samples[BASELINE], strict=True))
    return {
        "shape": list(shape),
        "iters_per_repeat": iters,
        "median_ms": medians,
        "ratio": ratio,
        "net_ratio": net_ratio,
        "within_target": ratio[HEADLINE] <= TARGET_RATIO,
        "headline_ratio_per_repeat": {"min": paired[0], "max": paired[-1],
                                      "quartiles": quantiles(paired, n=4) if len(paired) > 1
                                      else paired * 3},
        "samples_ms": samples,
    }


def bench_in_process(args: argparse.Namespace) -> list[dict[str, Any]]:
    """All providers in this process, interleaved within each repeat, shape by shape."""
    rows = []
    for channels, size in SHAPES:
        steps = shape_steps(args.batch, channels, size, args.seed, (*PROVIDERS, PREP))
        for _ in range(args.warmup):
            steps[BASELINE]()
        iters = args.iters or calibrate_iters(steps[BASELINE], args.target_ms)
        label = f"{channels}x{size}x{size}"
        callback = None if args.quiet else progress_printer(f"[cpu_speed {label}] ", args.repeats)
        samples = time_interleaved(
            steps, args.repeats, iters=iters, warmup=args.warmup, on_repeat=callback
        )
        rows.append(summarise((args.batch, channels, size, size), iters, samples))
    return rows


def run_worker(args: argparse.Namespace) -> int:
    """Worker of ``--isolate``: time one provider on every shape, print JSON ``{label: ms}``."""
    results = {}
    for channels, size in SHAPES:
        step = shape_steps(args.batch, channels, size, args.seed, (args.worker,))[args.worker]
        for _ in range(args.warmup):
            step()
        iters = args.iters or calibrate_iters(step, args.target_ms)
        samples = time_interleaved({args.worker: step}, 3, iters=iters, warmup=0)
        results[f"{channels}x{size}x{size}"] = {"ms": median(samples[args.worker]),
                                                "iters": iters}
    print(json.dumps(results))
    return 0


def bench_isolated(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each (repeat, provider) in a fresh process; providers rotate from repeat to repeat."""
    names = [*PROVIDERS, PREP]
    labels = [f"{c}x{s}x{s}" for c, s in SHAPES]
    samples = {label: {name: [] for name in names} for label in labels}
    iters = {label: 0 for label in labels}
    command = [sys.executable, str(Path(__file__).resolve()), "--threads", str(args.threads),
               "--batch", str(args.batch), "--iters", str(args.iters), "--target-ms",
               str(args.target_ms), "--warmup", str(args.warmup), "--seed", str(args.seed)]
    for index in range(args.repeats):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            output = subprocess.run([*command, "--worker", name], check=True,
                                    capture_output=True, text=True).stdout
            for label, result in json.loads(output).items():
                samples[label][name].append(result["ms"])
                iters[label] = max(iters[label], result["iters"])
        if not args.quiet:
            last = {label: samples[label][HEADLINE][-1] / samples[label][BASELINE][-1]
                    for label in labels}
            line = "  ".join(f"{label}: {ratio:.3f}" for label, ratio in last.items())
            print(f"[cpu_speed isolated] repeat {index + 1}/{args.repeats} {HEADLINE}/{BASELINE} "
                  f"{line}", file=sys.stderr, flush=True)
    return [summarise((args.batch, c, s, s), iters[label], samples[label])
            for (c, s), label in zip(SHAPES, labels, strict=True)]


def format_table(rows: list[dict[str, Any]], threads: int, repeats: int, isolate: bool) -> str:
    """The printed report: one line per shape, times in ms per step, ratios vs standard."""
    header = (
        f"{'C x H x W':<14}{'iters':>6}{'standard':>10}{'iabn_II':>10}{'ratio':>8}"
        f"{'net':>7}{'IQR of ratio':>14}{'<=' + str(TARGET_RATIO):>7}{'iabn_I':>9}{'ratio':>7}"
        f"{'abn':>8}{'ratio':>7}{'prep':>8}"
    )
    lines = [
        f"norm + LeakyReLU({NEGATIVE_SLOPE}) forward+backward on CPU, float32, torch "
        f"{torch.__version__}, {threads} threads",
        f"ms per step, median of {repeats} interleaved repeats "
        f"({'one process per repeat and provider' if isolate else 'all in one process'}); "
        f"ratio = provider / standard "
        f"(raw, full step); net = ratio after subtracting prep (the shared input clone); "
        f"IQR = quartiles of the {HEADLINE}/{BASELINE} ratio over repeats",
        "",
        header,
    ]
    for row in rows:
        m, r = row["median_ms"], row["ratio"]
        q1, _, q3 = row["headline_ratio_per_repeat"]["quartiles"]
        iqr = f"{q1:.2f}-{q3:.2f}"
        lines.append(
            f"{'x'.join(map(str, row['shape'][1:])):<14}{row['iters_per_repeat']:>6}"
            f"{m['standard']:>10.2f}{m['iabn_II']:>10.2f}{r['iabn_II']:>8.3f}"
            f"{row['net_ratio']['iabn_II']:>7.3f}{iqr:>14}"
            f"{'yes' if row['within_target'] else 'NO':>7}"
            f"{m['iabn_I']:>9.2f}{r['iabn_I']:>7.3f}{m['abn']:>8.2f}{r['abn']:>7.3f}"
            f"{m[PREP]:>8.2f}"
        )
    missed = ["x".join(map(str, row["shape"][1:])) for row in rows if not row["within_target"]]
    verdict = f"NOT met at {', '.join(missed)}" if missed else "met at every shape"
    lines += ["", f"target {HEADLINE} / {BASELINE} <= {TARGET_RATIO} (raw): {verdict}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="CPU forward+backward time: BatchNorm2d + LeakyReLU vs InPlace-ABN.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=11, help="timed interleaved repeats")
    parser.add_argument("--iters", type=int, default=0,
                        help="steps per repeat (0: enough for about --target-ms)")
    parser.add_argument("--target-ms", type=float, default=100.0,
                        help="aimed duration of one provider's repeat when --iters is 0")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per provider")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="results file")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--in-process", dest="isolate", action="store_false",
                        help="time all providers in this process instead of one fresh process "
                        "per (repeat, provider)")
    parser.add_argument("--worker", choices=(*PROVIDERS, PREP), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.iters < 0 or args.warmup < 0 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1, --iters and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    threads = set_threads(args.threads)
    if args.worker:
        return run_worker(args)
    rows = bench_isolated(args) if args.isolate else bench_in_process(args)
    print(format_table(rows, threads, args.repeats, args.isolate))
    report = {
        "benchmark": "cpu_speed",
        "description": "forward+backward of one norm + LeakyReLU(0.01) layer per step; "
        "every provider's step includes the shared input clone (timed alone as 'prep')",
        "machine": machine_info(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "baseline": BASELINE,
        "headline": HEADLINE,
        "target_ratio": TARGET_RATIO,
        "isolated_processes": args.isolate,
        "all_within_target": all(row["within_target"] for row in rows),
        "shapes": rows,
        "wall_time_s": round(time.perf_counter() - start, 2),
    }
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
