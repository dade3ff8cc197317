"""Host cost of the in-place layers' run-time writability rule (``autograd/call.overwrite_refused``,
docs/design.md, "The in-place contract"): each layer's call with the rule and with it replaced by
``lambda input, grad: False`` (what a layer did before the rule on these inputs: a computed tensor,
no view, no checkpoint), in one process, interleaved.

Each repeat times both variants back to back (alternating which goes first) by the thread's CPU
time with one intra-op thread, so load on a shared machine moves both alike; the figure is the
median of the per-repeat ratios ``with / without`` with its quartiles, next to each variant's
median time. Also printed: the rule's own cost per call on its paths (timeit), and the load.

Usage::

    python benchmarks/writability_cost.py [--repeats 25] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch

import iabn
from iabn.autograd import call


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="3 repeats of few calls (smoke)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def _cases() -> dict:
    abn, norm, gelu = iabn.InPlaceABN(8), iabn.InPlaceLayerNorm(8), iabn.InPlaceGELU()
    image = torch.randn(2, 8, 4, 4, requires_grad=True)
    rows = torch.randn(2, 4, 8, requires_grad=True)

    def step(layer, leaf):
        layer(leaf * 1.0).backward(torch.ones_like(leaf))
        for p in (leaf, *layer.parameters()):
            p.grad = None

    def forward(layer, x):
        with torch.no_grad():
            layer(x * 1.0)

    return {
        "InPlaceABN forward+backward": (lambda: step(abn, image), 300),
        "InPlaceLayerNorm forward+backward": (lambda: step(norm, rows), 300),
        "InPlaceGELU no_grad forward": (lambda: forward(gelu, rows.detach()), 2000),
    }


def _thread_time(fn, calls: int) -> float:
    start = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - start) / calls / 1000


def _rule_alone(number: int) -> dict[str, float]:
    x = torch.randn(2, 8, 4, 4, requires_grad=True) * 1
    view, plain = x.permute(0, 2, 3, 1), x.detach()
    paths = {"computed tensor, with a node": lambda: call.overwrite_refused(x, True),
             "permuted view, with a node": lambda: call.overwrite_refused(view, True),
             "no node": lambda: call.overwrite_refused(plain, False),
             "empty call (floor)": lambda: None}
    return {name: min(timeit.repeat(f, number=number, repeat=5)) / number * 1e9
            for name, f in paths.items()}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(1)
    repeats, scale = (3, 0.05) if args.quick else (args.repeats, 1.0)
    real, off = call.overwrite_refused, (lambda input, grad: False)
    rows = []
    try:
        for name, (fn, calls) in _cases().items():
            calls = max(1, int(calls * scale))
            with_rule, without, ratios = [], [], []
            for r in range(repeats):
                for on in ((True, False) if r % 2 else (False, True)):
                    call.overwrite_refused = real if on else off  # layer_call reads it per call
                    (with_rule if on else without).append(_thread_time(fn, calls))
                ratios.append(with_rule[-1] / without[-1])
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            rows.append({"case": name, "with_us": statistics.median(with_rule),
                         "without_us": statistics.median(without),
                         "ratio": statistics.median(ratios),
                         "quartiles": [quartiles[0], quartiles[-1]]})
            print(f"{name}: with the rule {rows[-1]['with_us']:.2f} us, without "
                  f"{rows[-1]['without_us']:.2f} us, paired ratio {rows[-1]['ratio']:.4f} "
                  f"(quartiles {quartiles[0]:.4f}-{quartiles[-1]:.4f})")
    finally:
        call.overwrite_refused = real
    alone = _rule_alone(2000 if args.quick else 100000)
    print("the rule alone, ns a call: " + ", ".join(f"{k} {v:.0f}" for k, v in alone.items()))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "rule_alone_ns": alone,
                                         "load": list(load), "torch": torch.__version__},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
