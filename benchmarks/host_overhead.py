"""Host cost of one norm + activation layer: microseconds per forward + backward at tiny shapes.

At tiny shapes a layer's time is what the host spends on it (Python, dispatch, checks, kernel
launches), not what the kernels compute. With ~50 such layers per network that cost decides
whether the GPU waits for the host. Providers, on the same input and weights:

``bn``            ``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=True)`` (what users replace)
``iabn``          ``iabn.InPlaceABN`` on the default backend (the reference kernels)
``abn``           ``iabn.ABN``: the same ATen calls as ``bn`` behind iabn's module logic
``iabn_triton``   ``iabn.InPlaceABN`` with ``IABN_BACKEND=triton`` (CUDA only)
``noop_function`` a Python ``torch.autograd.Function`` that overwrites nothing and computes
                  nothing (marks its input dirty, saves it, passes the gradient through): the
                  floor of any layer written as a Python autograd function, as iabn's is
``bare_function`` iabn's reference kernels (``forward_``/``backward``, the same ATen calls as
                  ``iabn``) in a bare Python ``Function`` with fixed settings: no checks, no
                  backend choice, no module logic. ``iabn`` minus this is what work on the
                  layer's own Python could still save; this minus ``bn`` is what it cannot

Each layer is also compared with its floor, the provider doing the same work without iabn's
layer logic: ``iabn`` (and ``iabn_triton``) with ``bare_function``, ``abn`` with ``bn``. As the
providers run interleaved, each repeat gives one ratio ``layer / floor`` from timings taken
moments apart; ``ratio_to_floor`` is the median of these ratios (with their quartiles), which
load on a shared machine moves less than the ratio of two medians.

One call is ``layer(leaf.clone()).backward(grad)`` with the gradients reset as
``optimizer.zero_grad()`` does; the clone is in every provider's call. Calls are timed in loops
of ``--iters`` after a warm-up, providers interleaved within each repeat, median over repeats;
on CUDA the loop ends with a synchronisation, which at these sizes costs less than the launches
it waits for. The ratio ``provider / bn`` of the medians is printed with the figures, and
everything goes to a JSON file with the machine, versions and date.

Usage::

    python benchmarks/host_overhead.py [--device cpu|cuda] [--repeats 41] [--iters 100]
        [--threads N] [--clock wall|thread] [--quick]
        [--json benchmarks/results/host_overhead_<device>.json]

``--threads`` sets torch's intra-op threads (default: torch's own). On CPU, ATen's batch-norm
kernels split even a tiny tensor's channels across threads; on a machine whose cores are busy
with other work each such split waits for a thread to be scheduled, which multiplied BN's
time by up to 50 on the shared 2-core VM; ``--threads 1`` measures the host path without that.

``--clock thread`` (CPU only; implies ``--threads 1``, so that all of a step's work is on the
timing thread) times by the thread's CPU time instead of the wall clock: the time the process
waits for a core while other jobs run is not counted. On the loaded 2-core VM the quartiles of
the per-repeat ratio ``iabn / bare_function`` spanned 0.6-1.4 by the wall clock and about
+-2 % by the thread clock. On a quiet machine the two agree; the wall clock is the default.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median, quantiles

import torch
from torch import nn

import iabn
from iabn.kernels import reference
from iabn.kernels.backends import use_backend
from iabn.kernels.common import LayerConfig
from iabn.tools.bench import (
    machine_info,
    results_folder,
    set_threads,
    time_interleaved,
    training_step,
    write_json,
)

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
SHAPES = [(2, 8, 4, 4), (8, 64, 8, 8)]


def _on_backend(step, name: str | None):
    """``step`` run with ``IABN_BACKEND=name`` (None: as it is)."""
    if name is None:
        return step

    def run():
        with use_backend(name):
            return step()

    return run


class _NoOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias)
        return x

    @staticmethod
    def backward(ctx, dz):
        return dz, None, None


#: InPlaceABN's defaults in training: the settings every provider here runs with.
_BARE = LayerConfig(True, 0.1, 1e-5, "leaky_relu", 0.01, "signed", 2)


class _Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var):
        invstd, scale = reference.forward_(x, weight, bias, running_mean, running_var, _BARE)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias, invstd, scale)
        return x

    @staticmethod
    def backward(ctx, dz):
        z, weight, bias, invstd, scale = ctx.saved_tensors
        dx, dweight, dbias = reference.backward(
            z, dz, weight, bias, invstd, scale, _BARE, [True, True, True]
        )
        return dx, dweight, dbias, None, None


class BareFunctionLayer(nn.Module):
    """InPlaceABN's work and nothing else: its kernels in a Python ``Function`` (training,
    leaky_relu 0.01, momentum 0.1, eps 1e-5, signed scale, affine)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.num_batches_tracked.add_(1)  # as nn.BatchNorm2d and InPlaceABN do
        return _Bare.apply(x, self.weight, self.bias, self.running_mean, self.running_var)


class NoOpFunctionLayer(nn.Module):
    """What every Python-autograd-function layer pays, with the layer's parameters."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NoOp.apply(x, self.weight, self.bias)


def providers(device: torch.device, channels: int) -> dict[str, tuple[nn.Module, str | None]]:
    layers = {
        "bn": (nn.Sequential(nn.BatchNorm2d(channels), nn.LeakyReLU(0.01, inplace=True)), None),
        "iabn": (iabn.InPlaceABN(channels), None),
        "abn": (iabn.ABN(channels), None),
        "noop_function": (NoOpFunctionLayer(channels), None),
        "bare_function": (BareFunctionLayer(channels), None),
    }
    if device.type == "cuda":
        layers["iabn_triton"] = (iabn.InPlaceABN(channels), "triton")
    return {name: (layer.to(device), backend) for name, (layer, backend) in layers.items()}


def measure(shape, device: torch.device, repeats: int, iters: int,
            clock=time.perf_counter) -> dict:
    leaf = torch.randn(shape, device=device, requires_grad=True)
    grad = torch.randn(shape, device=device)
    steps = {name: _on_backend(training_step(layer, leaf, grad), backend)
             for name, (layer, backend) in providers(device, shape[1]).items()}
    samples = time_interleaved(steps, repeats, iters, warmup=5, device=device, clock=clock)
    us = {name: median(values) * 1e3 for name, values in samples.items()}
    return {"shape": list(shape), "us_per_call": us,
            "ratio_to_bn": {name: value / us["bn"] for name, value in us.items()},
            "ratio_to_floor": {name: paired_ratio(samples[name], samples[floor]) | {"floor": floor}
                               for name, floor in FLOORS.items() if name in samples},
            "samples_ms": samples}


#: Each layer's floor: the provider that does its work without iabn's layer logic.
FLOORS = {"iabn": "bare_function", "iabn_triton": "bare_function", "abn": "bn"}


def paired_ratio(times: list[float], floor: list[float]) -> dict[str, float]:
    """Median and quartiles of ``times[i] / floor[i]``, the ratios within each repeat."""
    ratios = sorted(t / f for t, f in zip(times, floor, strict=True))
    q1, q2, q3 = quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": q2, "q1": q1, "q3": q3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall",
                        help="wall clock, or the thread's CPU time (CPU only, --threads 1)")
    parser.add_argument("--quick", action="store_true", help="3 repeats of 20 calls (CI smoke)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.iters = 3, 20
    try:
        device = torch.device(args.device)
    except RuntimeError:
        print(f"error: --device {args.device!r}: use cpu, cuda or cuda:N", file=sys.stderr)
        return 2
    if device.type not in ("cpu", "cuda"):
        print(f"error: --device {args.device!r}: use cpu, cuda or cuda:N", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but CUDA is not available", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.iters < 1:
        print("error: --repeats and --iters must be >= 1", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print("error: --threads must be >= 1", file=sys.stderr)
        return 2
    if args.clock == "thread":
        if device.type != "cpu" or args.threads not in (None, 1):
            print("error: --clock thread times CPU work on one thread: use it with --device "
                  "cpu and without --threads (or --threads 1)", file=sys.stderr)
            return 2
        args.threads = 1
    set_threads(args.threads)
    rows = []
    for shape in SHAPES:
        row = measure(shape, device, args.repeats, args.iters, CLOCKS[args.clock])
        rows.append(row)
        figures = "  ".join(f"{name} {us:7.1f} µs ({row['ratio_to_bn'][name]:.2f}x)"
                            for name, us in row["us_per_call"].items())
        print(f"{'x'.join(map(str, shape)):>10}  {figures}", flush=True)
        floors = "  ".join(
            f"{name}/{r['floor']} {r['median']:.3f} (quartiles {r['q1']:.3f}-{r['q3']:.3f})"
            for name, r in row["ratio_to_floor"].items()
        )
        print(f"{'':>10}  {floors}", flush=True)
    info = machine_info(device)
    path = args.json or RESULTS / f"host_overhead_{device.type}.json"
    write_json(path, {"machine": info, "device": str(device), "repeats": args.repeats,
                      "iters": args.iters, "clock": args.clock, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
