"""Input gradients at the activation's kink: how many elements take the other slope than
float64, per provider (iabn Triton, iabn reference, PyTorch's BatchNorm2d + LeakyReLU), dtype,
layout and seed. See :mod:`iabn.tools.bench.slopes` for what is counted and why.

On a CUDA machine it runs the compiled kernels at the GPU sweep's sizes (100k-524k values per
channel); elsewhere ``--device cpu`` runs the Triton kernels under the interpreter (it sets
``TRITON_INTERPRET=1`` itself), about 30 s per 6.4M-element case on 2 cores; the interpreter
truncates float32 to bfloat16 where a GPU rounds (tests/support/triton_interpreter.py), which moves
values by one unit in the last place, far below the counting tolerance. Results go to a JSON
file with the machine, versions and date; a table is printed as each case finishes.

Usage::

    python benchmarks/slope_errors.py [--device cuda] [--shapes 32x64x56x56,2x64x512x512]
        [--dtypes float32,bfloat16,float16] [--layouts nchw,channels_last] [--seeds 0,1,2]
        [--json benchmarks/results/slope_errors.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from iabn.tools.bench import results_folder

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
GPU_SHAPES = "32x64x56x56,8x64x128x128,8x256x128x128,16x64x128x128,2x64x512x512"
CPU_SHAPES = "32x64x56x56"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--shapes", default=None,
                        help=f"NxCxHxW list (default: {GPU_SHAPES} on cuda, {CPU_SHAPES} on cpu)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--layouts", default="nchw,channels_last")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--providers", default="triton,reference,torch")
    parser.add_argument("--json", type=Path, default=None,
                        help="output file (default: results/slope_errors_<device>.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    from iabn.tools.bench import machine_info, parse_shapes, write_json

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:  # before the restart below: a usage error costs one start of Python, not two
        shapes = parse_shapes(args.shapes or (GPU_SHAPES if device != "cpu" else CPU_SHAPES))
        dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
        if not all(isinstance(d, torch.dtype) for d in dtypes):
            raise ValueError
    except (ValueError, AttributeError):
        print(f"error: --shapes takes NxCxHxW,... and --dtypes torch dtype names; got "
              f"{args.shapes!r}, {args.dtypes!r}", file=sys.stderr)
        return 2
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads the variable when its kernels are defined: start again with it set
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    from iabn.tools.bench.slopes import study
    providers = tuple(args.providers.split(","))
    rows = []
    print(f"{'shape':>16} {'dtype':>8} {'layout':>13} seed  "
          + "  ".join(f"{p:>22}" for p in providers) + "   (mismatched / at zero outputs)")
    for shape in shapes:
        for dtype in dtypes:
            for layout in args.layouts.split(","):
                for seed in (int(s) for s in args.seeds.split(",")):
                    start = time.perf_counter()
                    row = study(shape, dtype, layout == "channels_last", seed, device,
                                providers)
                    row["seconds"] = round(time.perf_counter() - start, 1)
                    rows.append(row)
                    cells = "  ".join(
                        f"{row[p]['mismatched']:>12} / {row[p]['mismatched_at_zero_outputs']:>7}"
                        for p in providers)
                    print(f"{'x'.join(map(str, shape)):>16} {row['dtype']:>8} {layout:>13} "
                          f"{seed:>4}  {cells}", flush=True)
    info = machine_info(device)
    path = args.json or RESULTS / f"slope_errors_{device.split(':')[0]}.json"
    write_json(path, {"machine": info, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
