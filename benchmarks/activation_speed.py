"""Forward + backward of the in-place activations without a norm against torch's own module, on
CPU: paired, interleaved repeats (ours, then torch's, each pair timed back to back), the
median of the paired ratios with its spread (the lower and upper quartile), and the load
average with the figures (the machine may be shared: say so with the numbers).

Usage::

    python benchmarks/activation_speed.py [--shape 8,197,1536] [--dtype float32]
        [--repeats 15] [--threads 1] [--names gelu,silu,mish,gelu_tanh]
        [--compiled] [--json PATH]

``--compiled``: both modules under ``torch.compile`` (Inductor; each compiled once, before
the timed repeats, in ``TORCHINDUCTOR_CACHE_DIR``), and the eager ``InPlace*`` module timed
alongside (``ours_eager_ms``).

Writes ``runs/benchmarks/activation_speed_cpu.json`` (``IABN_COMMIT_RESULTS=1``: the committed
``benchmarks/results/activation_speed_cpu.json``), atomically.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import iabn
from iabn.tools.bench import machine_info, results_folder, write_json

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
LAYERS = {
    "gelu": (lambda: iabn.InPlaceGELU(), lambda: nn.GELU()),
    "gelu_tanh": (lambda: iabn.InPlaceGELU("tanh"), lambda: nn.GELU(approximate="tanh")),
    "silu": (lambda: iabn.InPlaceSiLU(), lambda: nn.SiLU()),
    "mish": (lambda: iabn.InPlaceMish(), lambda: nn.Mish()),
}


def _step(layer, x, dz):
    leaf = x.clone().requires_grad_()
    start = time.perf_counter()
    layer(leaf * 1).backward(dz)
    return time.perf_counter() - start


def measure(name: str, shape, dtype, repeats: int, compiled: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    dz = torch.randn(shape, generator=g).to(dtype)
    ours, theirs = LAYERS[name][0](), LAYERS[name][1]()
    eager = ours
    if compiled:
        torch._dynamo.reset()
        ours, theirs = torch.compile(ours), torch.compile(theirs)
    for _ in range(2):  # warm up (and compile) both
        _step(ours, x, dz), _step(theirs, x, dz)
    triples = [(_step(ours, x, dz), _step(theirs, x, dz),
                _step(eager, x, dz) if compiled else 0.0) for _ in range(repeats)]
    ratios = sorted(a / b for a, b, _ in triples)
    q = statistics.quantiles(ratios, n=4)
    row = {"name": name, "compiled": compiled,
           "ours_ms": 1e3 * statistics.median(a for a, _, _ in triples),
           "torch_ms": 1e3 * statistics.median(b for _, b, _ in triples),
           "ratio_median": statistics.median(ratios), "ratio_quartiles": [q[0], q[2]],
           "note": "ours includes the x * 1 copy torch's step also makes"}
    if compiled:
        row["ours_eager_ms"] = 1e3 * statistics.median(c for _, _, c in triples)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8,197,1536")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--names", default=",".join(LAYERS))
    parser.add_argument("--compiled", action="store_true",
                        help="both modules under torch.compile (Inductor)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    rows = []
    for name in args.names.split(","):
        load = os.getloadavg()
        row = measure(name, shape, dtype, args.repeats, args.compiled)
        row["loadavg_before"] = load
        row["loadavg_after"] = os.getloadavg()
        rows.append(row)
        print(f"{name:10s} ours {row['ours_ms']:8.2f} ms  torch {row['torch_ms']:7.2f} ms  "
              f"ratio {row['ratio_median']:6.2f} (quartiles {row['ratio_quartiles'][0]:.2f}"
              f" .. {row['ratio_quartiles'][1]:.2f})  load {load[0]:.2f}", flush=True)
    default = "activation_speed_cpu_compiled.json" if args.compiled else "activation_speed_cpu.json"
    write_json(Path(args.json) if args.json else RESULTS / default, {
        "shape": shape, "dtype": args.dtype, "threads": args.threads,
        "repeats": args.repeats, "compiled": args.compiled, "machine": machine_info(),
        "rows": rows,
    })
    return rows


if __name__ == "__main__":
    main()
