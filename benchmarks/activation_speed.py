"""Forward + backward of the in-place activations against torch's own module, on CPU: paired,
interleaved repeats (ours, then torch's, each pair timed back to back), the median of the
paired ratios with its spread (the lower and upper quartile), and the load average with the
figures (the machine may be shared: say so with the numbers).

The activations alone (``gelu``, ``gelu_tanh``, ``silu``, ``mish``: ``InPlaceGELU``... against
``nn.GELU``...) take inputs ``scale * randn``; the norm layers with an activation
(``abn_silu``, ``abn_gelu``: ``InPlaceABN`` against ``nn.BatchNorm2d`` + the activation;
``gn_silu``, ``gn_gelu``: ``InPlaceGroupNormAct`` with 32 groups against ``nn.GroupNorm`` +
the activation; give a 4-d ``--shape``) normalise them first. Each row records the share of
the activation's inputs on its left branch (below the minimum ``y*``): the backward's CPU loop
costs more where that share is larger (docs/design.md).

Usage::

    python benchmarks/activation_speed.py [--shape 8,197,1536] [--dtype float32]
        [--repeats 15] [--threads 1] [--names gelu,silu,mish,gelu_tanh] [--scale 3]
        [--compiled] [--json PATH]
    python benchmarks/activation_speed.py --shape 8,64,56,56 --names abn_silu,gn_silu

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
from iabn.kernels import branch
from iabn.tools.bench import machine_info, results_folder, write_json

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
LAYERS = {
    "gelu": (lambda: iabn.InPlaceGELU(), lambda: nn.GELU()),
    "gelu_tanh": (lambda: iabn.InPlaceGELU("tanh"), lambda: nn.GELU(approximate="tanh")),
    "silu": (lambda: iabn.InPlaceSiLU(), lambda: nn.SiLU()),
    "mish": (lambda: iabn.InPlaceMish(), lambda: nn.Mish()),
}
#: The norm layers with an activation: factories of the channel count.
NORM_LAYERS = {
    "abn_silu": (lambda c: iabn.InPlaceABN(c, activation="silu"),
                 lambda c: nn.Sequential(nn.BatchNorm2d(c), nn.SiLU())),
    "abn_gelu": (lambda c: iabn.InPlaceABN(c, activation="gelu"),
                 lambda c: nn.Sequential(nn.BatchNorm2d(c), nn.GELU())),
    "gn_silu": (lambda c: iabn.InPlaceGroupNormAct(32, c, activation="silu"),
                lambda c: nn.Sequential(nn.GroupNorm(32, c), nn.SiLU())),
    "gn_gelu": (lambda c: iabn.InPlaceGroupNormAct(32, c, activation="gelu"),
                lambda c: nn.Sequential(nn.GroupNorm(32, c), nn.GELU())),
}


def make_layers(name: str, shape) -> tuple[nn.Module, nn.Module]:
    """``(ours, torch's)`` for ``name`` at inputs of ``shape``."""
    if name in LAYERS:
        return LAYERS[name][0](), LAYERS[name][1]()
    return NORM_LAYERS[name][0](shape[1]), NORM_LAYERS[name][1](shape[1])


def check(names: list[str], shape) -> str | None:
    """What is wrong with ``--names`` and ``--shape`` together, or None."""
    for name in names:
        if name not in LAYERS and name not in NORM_LAYERS:
            return (f"--names: unknown layer {name!r}; choose from "
                    f"{', '.join([*LAYERS, *NORM_LAYERS])}")
        if name in NORM_LAYERS and len(shape) != 4:
            return f"--shape: {name} needs a 4-d shape N,C,H,W, got {','.join(map(str, shape))}"
        if name.startswith("gn_") and shape[1] % 32:
            return (f"--shape: {name} needs C a multiple of 32 (the group norm's groups), got "
                    f"{','.join(map(str, shape))}")
    return None


def left_share(name: str, theirs: nn.Module, x) -> float:
    """The share of the activation's inputs below its minimum ``y*`` (torch's module's norm
    gives a norm layer's)."""
    activation = name.split("_", 1)[1] if name in NORM_LAYERS else name
    inputs = theirs[0](x.float()) if name in NORM_LAYERS else x.float()
    with torch.no_grad():
        return (inputs < branch.minimum(activation)[0]).float().mean().item()


def _step(layer, x, dz):
    leaf = x.clone().requires_grad_()
    start = time.perf_counter()
    layer(leaf * 1).backward(dz)
    return time.perf_counter() - start


def measure(name: str, shape, dtype, repeats: int, compiled: bool = False,
            scale: float = 3.0) -> dict:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    dz = torch.randn(shape, generator=g).to(dtype)
    ours, theirs = make_layers(name, shape)
    share = left_share(name, theirs, x)
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
           "scale": scale, "left_share": share,
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
    parser.add_argument("--scale", type=float, default=3.0,
                        help="the inputs' standard deviation")
    parser.add_argument("--compiled", action="store_true",
                        help="both modules under torch.compile (Inductor)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    names = args.names.split(",")
    problem = check(names, shape)
    if problem:
        parser.error(problem)
    rows = []
    for name in names:
        load = os.getloadavg()
        row = measure(name, shape, dtype, args.repeats, args.compiled, args.scale)
        row["loadavg_before"] = load
        row["loadavg_after"] = os.getloadavg()
        rows.append(row)
        print(f"{name:10s} ours {row['ours_ms']:8.2f} ms  torch {row['torch_ms']:7.2f} ms  "
              f"ratio {row['ratio_median']:6.2f} (quartiles {row['ratio_quartiles'][0]:.2f}"
              f" .. {row['ratio_quartiles'][1]:.2f})  left {row['left_share']:.2f}"
              f"  load {load[0]:.2f}", flush=True)
    default = "activation_speed_cpu_compiled.json" if args.compiled else "activation_speed_cpu.json"
    write_json(Path(args.json) if args.json else RESULTS / default, {
        "shape": shape, "dtype": args.dtype, "threads": args.threads, "scale": args.scale,
        "repeats": args.repeats, "compiled": args.compiled, "machine": machine_info(),
        "rows": rows,
    })
    return rows


if __name__ == "__main__":
    main()
