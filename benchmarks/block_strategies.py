"""Paper Fig. 4 analogue: one BN -> LeakyReLU -> conv block per memory strategy.

For each ResNeXt-101 stage shape (C = 256/512/1024/2048 at 56/28/14/7 pixels, here with a
1x1 conv C -> C/2 as in the bottleneck's reduction), every strategy of :class:`iabn.BNActConv`
runs the same weights on the same data: forward + backward time (median of interleaved
repeats) and the exact activation bytes it keeps for backward. The paper used batch 32 and 200
iterations on a GPU (``--device cuda``: batch 32, 5 repeats x 40 steps by default, timed until
the device finished); on CPU the default is batch 4 and a few repeats (`--batch`,
`--repeats`), so CPU times show the relative cost of the extra work, not GPU behaviour.

Usage::

    python benchmarks/block_strategies.py [--device cuda] [--batch N] [--repeats N]
        [--iters N] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from statistics import median

import torch

from iabn.memory import saved_tensor_bytes
from iabn.memory.bn_act_conv import STRATEGIES, BNActConv
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
BASELINE = "standard"
DEFAULT_JSON = results_folder(Path(__file__).resolve().parent / "results") / "block_strategies.json"


def bench_shape(batch: int, channels: int, size: int, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    device = torch.device(args.device)
    blocks = {s: BNActConv(channels, channels // 2, 1, strategy=s) for s in STRATEGIES}
    state = blocks[BASELINE].state_dict()
    for block in blocks.values():
        block.load_state_dict(state)
        block.to(device)
    leaf = torch.randn(batch, channels, size, size, device=device, requires_grad=True)
    grad = torch.randn(batch, channels // 2, size, size, device=device)
    saved = {s: saved_tensor_bytes(b, leaf.clone()) for s, b in blocks.items()}

    label = f"{channels}x{size}x{size}"
    callback = None if args.quiet else progress_printer(f"[blocks {label}] ", args.repeats)
    steps = {s: training_step(b, leaf, grad) for s, b in blocks.items()}
    samples = time_interleaved(steps, args.repeats, iters=args.iters, warmup=2,
                               on_repeat=callback, device=device)
    medians = {s: median(v) for s, v in samples.items()}
    return {"shape": [batch, channels, size, size], "saved_bytes": saved,
            "activation_bytes": leaf.nbytes, "median_ms": medians,
            "time_ratio": {s: medians[s] / medians[BASELINE] for s in STRATEGIES},
            "samples_ms": samples}


def format_table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"BN -> LeakyReLU(0.01) -> conv1x1 block, fwd+bwd, {args.device} float32, "
             f"batch {args.batch}, "
             f"torch {torch.__version__}, {torch.get_num_threads()} threads, median of "
             f"{args.repeats} interleaved repeats x {args.iters} steps",
             "saved = activation memory kept for backward in units of the block input; "
             "time relative to standard", ""]
    header = f"{'C x H x W':<12}" + "".join(f"{s:>22}" for s in STRATEGIES)
    lines.append(header)
    for row in rows:
        cells = "".join(
            f"{row['saved_bytes'][s] / row['activation_bytes']:>9.2f}x "
            f"{row['median_ms'][s]:>7.2f}ms {row['time_ratio'][s]:>4.2f}"
            for s in STRATEGIES
        )
        lines.append(f"{'x'.join(map(str, row['shape'][1:])):<12}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--batch", type=int, default=None, help="default: 32 cuda, 4 cpu")
    parser.add_argument("--repeats", type=int, default=None, help="default: 5 cuda, 7 cpu")
    parser.add_argument("--iters", type=int, default=None,
                        help="steps per repeat (default: 40 cuda, 3 cpu)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None,
                        help="default: results/block_strategies.json on cpu, "
                             "results/block_strategies_cuda.json on cuda (CPU figures stay)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.json is None:
        args.json = DEFAULT_JSON.with_name("block_strategies_cuda.json") if cuda else DEFAULT_JSON
    for name, on_gpu, on_cpu in (("batch", 32, 4), ("repeats", 5, 7), ("iters", 40, 3)):
        if getattr(args, name) is None:
            setattr(args, name, on_gpu if cuda else on_cpu)
    set_threads(args.threads)
    rows = [bench_shape(args.batch, c, s, args) for c, s in SHAPES]
    print(format_table(rows, args))
    report = {"benchmark": "block_strategies", "machine": machine_info(),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "shapes": rows}
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
