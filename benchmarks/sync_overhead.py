"""Per-layer cost of synchronising batch statistics: InPlaceABNSync vs InPlaceABN.

``--world`` processes (default 2; 3 also works) run under ``torch.distributed`` with gloo on
CPU, each with its own ``(batch, C, H, H)`` float32 input (default batch 8 per rank). Shapes:
``(C, H)`` in (64, 56), (256, 28), (512, 14), (1024, 7). Providers, on the same weights:

``iabn``                 ``iabn.InPlaceABN`` (no communication), forward + backward
``iabn_sync``            ``iabn.InPlaceABNSync``, forward + backward: one ``all_gather`` of
                         ``2C + 1`` float64 (count, mean, var) and one ``all_reduce`` of ``2C``
                         float32 (the backward sums) per step
``allgather+allreduce``  those two collectives alone, on tensors of those sizes: the pure
                         communication cost
``nn_syncbn``            ``nn.SyncBatchNorm`` + ``nn.LeakyReLU(0.01, inplace=True)``; only with
                         ``--device cuda`` (see below)

A step is ``out = layer(leaf.clone()); out.backward(grad)`` after ``leaf.grad = None`` and
``layer.zero_grad(set_to_none=True)`` (the in-place layers need a fresh non-leaf input).

nn.SyncBatchNorm only runs on CUDA, so there is no CPU baseline from PyTorch. The GPU
comparison (nn.SyncBatchNorm + LeakyReLU, world size 1, where neither layer communicates) is
left for a session with a lent GPU: ``--device cuda`` uses nccl, one GPU per rank, and adds the
``nn_syncbn`` provider; on CPU that provider is skipped, not imitated.

Timing: every rank runs every provider in the same order (a collective that one rank skips
would deadlock the others). Each of ``--repeats`` repeats times ``iters`` consecutive steps of
each provider, interleaved and in an order that rotates from repeat to repeat, as in
``iabn.tools.bench.time_interleaved``; ``iters`` is calibrated per provider to about
``--target-ms`` and agreed across ranks. A barrier precedes every timed block so that the
ranks start it together. Each rank takes the median over repeats; the table shows the maximum
of those medians over ranks (a synchronised step waits for the slowest rank, so that is the
honest figure) next to rank 0's own. On CPU each rank uses ``--threads`` (default 1) torch
thread: with 2 ranks on a 2-core machine more would oversubscribe the cores (gloo's own
threads come on top).

Usage::

    python benchmarks/sync_overhead.py [--world 2] [--repeats 7] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import iabn
from iabn.tools.bench import machine_info, progress_printer, results_folder, training_step

#: ``(channels, height = width)`` of the timed inputs; the batch is ``--batch`` per rank.
SHAPES = ((64, 56), (256, 28), (512, 14), (1024, 7))
LOCAL, SYNC, COMM, TORCH_SYNC = "iabn", "iabn_sync", "allgather+allreduce", "nn_syncbn"
NEGATIVE_SLOPE = 0.01
MAX_ITERS = 1000
DEFAULT_JSON = results_folder(Path(__file__).resolve().parent / "results") / "sync_overhead.json"
CPU_NOTE = (
    "note: nn.SyncBatchNorm only runs on CUDA, so there is no CPU baseline from PyTorch; the "
    "GPU comparison (nn.SyncBatchNorm + LeakyReLU, world size 1) is left for a session with a "
    "lent GPU (--device cuda)"
)

Step = Callable[[], object]


def providers(device: str) -> tuple[str, ...]:
    """The providers timed on ``device``, in the order every rank runs them."""
    return (LOCAL, SYNC, COMM, TORCH_SYNC) if device == "cuda" else (LOCAL, SYNC, COMM)


def make_layers(channels: int, names: tuple[str, ...], device: torch.device,
                seed: int) -> dict[str, nn.Module]:
    """One layer per layer provider, all with the same randomised weights on every rank."""
    torch.manual_seed(seed)
    local = iabn.InPlaceABN(channels, activation_param=NEGATIVE_SLOPE)
    with torch.no_grad():
        local.weight.uniform_(0.5, 1.5)
        local.bias.normal_(0.0, 0.2)
    layers: dict[str, nn.Module] = {LOCAL: local}
    layers[SYNC] = iabn.InPlaceABNSync(channels, activation_param=NEGATIVE_SLOPE)
    if TORCH_SYNC in names:
        layers[TORCH_SYNC] = nn.Sequential(
            nn.SyncBatchNorm(channels), nn.LeakyReLU(NEGATIVE_SLOPE, inplace=True)
        )
    state = local.state_dict()
    for name, layer in layers.items():
        if name != LOCAL:
            (layer[0] if name == TORCH_SYNC else layer).load_state_dict(state)
        layer.to(device).train()
    return layers


def make_comm_step(channels: int, world: int, device: torch.device) -> Step:
    """The two collectives of one InPlaceABNSync step, alone, on tensors of the layer's sizes:
    an all-gather of ``2C + 1`` float64 and an all-reduce (sum) of ``(2, C)`` float32."""
    moments = torch.zeros(2 * channels + 1, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(moments) for _ in range(world)]
    sums = torch.zeros(2, channels, dtype=torch.float32, device=device)

    def step() -> None:
        dist.all_gather(gathered, moments)
        dist.all_reduce(sums)  # zeros: summing them in place leaves them unchanged

    return step


def shape_steps(args: argparse.Namespace, rank: int, world: int, channels: int, size: int,
                device: torch.device) -> dict[str, Step]:
    """The step of every provider on this rank's ``(batch, channels, size, size)`` input."""
    names = providers(args.device)
    layers = make_layers(channels, names, device, args.seed)
    torch.manual_seed(args.seed + 1 + rank)  # each rank its own data
    shape = (args.batch, channels, size, size)
    leaf = torch.randn(shape, device=device).requires_grad_()
    grad = torch.randn(shape, device=device)
    steps = {}
    for name in names:
        steps[name] = (make_comm_step(channels, world, device) if name == COMM
                       else training_step(layers[name], leaf, grad))
    return steps


class Timer:
    """Wall-clock timing of blocks of steps that start together on every rank."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def block(self, step: Step, iters: int) -> float:
        """Mean milliseconds of ``iters`` consecutive calls of ``step``, after a barrier."""
        gc.collect()  # before the barrier: a collection mid-block would be charged to it
        self.sync()
        dist.barrier()
        self.sync()
        start = time.perf_counter()
        for _ in range(iters):
            step()
        self.sync()
        return (time.perf_counter() - start) * 1e3 / iters

    def calibrate(self, steps: dict[str, Step], target_ms: float, fixed: int) -> dict[str, int]:
        """Steps per timed block for every provider, the same on every rank (collectives must
        match): enough for about ``target_ms`` on the slowest rank, or ``fixed`` if > 0."""
        if fixed:
            return dict.fromkeys(steps, fixed)
        # The fastest of three single steps, so that one disturbed step does not set the count.
        fastest = [min(self.block(step, 1) for _ in range(3)) for step in steps.values()]
        times = torch.tensor(fastest, dtype=torch.float64, device=self.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return {name: max(1, min(MAX_ITERS, math.ceil(target_ms / max(ms, 1e-3))))
                for name, ms in zip(steps, times.tolist(), strict=True)}


def time_shape(args: argparse.Namespace, rank: int, world: int, channels: int, size: int,
               device: torch.device) -> dict[str, Any]:
    """This rank's samples (ms per step, one per repeat) of every provider on one shape."""
    steps = shape_steps(args, rank, world, channels, size, device)
    timer = Timer(device)
    names = list(steps)
    for name in names:  # the first InPlaceABNSync step also runs its one-off rank check
        for _ in range(args.warmup):
            steps[name]()
    iters = timer.calibrate(steps, args.target_ms, args.iters)
    label = f"{channels}x{size}x{size}"
    report = (progress_printer(f"[sync_overhead {label}] ", args.repeats)
              if rank == 0 and not args.quiet else None)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(args.repeats):
        shift = index % len(names)  # the same rotation on every rank
        this_repeat = {}
        for name in names[shift:] + names[:shift]:
            this_repeat[name] = timer.block(steps[name], iters[name])
            samples[name].append(this_repeat[name])
        if report is not None:
            report(index, {name: this_repeat[name] for name in names})
    return {"iters": iters, "samples": samples}


def summarise(shape: tuple[int, ...], iters: dict[str, int],
              per_rank_samples: list[dict[str, list[float]]]) -> dict[str, Any]:
    """One table row from every rank's samples of one shape."""
    per_rank = [{p: median(s) for p, s in samples.items()} for samples in per_rank_samples]
    names = list(per_rank[0])
    worst = {p: max(medians[p] for medians in per_rank) for p in names}

    def figures(m: dict[str, float]) -> dict[str, float]:
        out = {"overhead_ms": m[SYNC] - m[LOCAL], "ratio": m[SYNC] / m[LOCAL]}
        if TORCH_SYNC in m:
            out["ratio_vs_nn_syncbn"] = m[SYNC] / m[TORCH_SYNC]
        return out

    return {
        "shape_per_rank": list(shape),
        "iters_per_block": iters,
        "median_ms_max_over_ranks": worst,
        "median_ms_rank0": per_rank[0],
        "median_ms_per_rank": per_rank,
        "max_over_ranks": figures(worst),
        "rank0": figures(per_rank[0]),
        "samples_ms_per_rank": per_rank_samples,
    }


def format_table(rows: list[dict[str, Any]], args: argparse.Namespace, world: int,
                 backend: str, threads: int) -> str:
    """The printed report: max over ranks on the left, rank 0's own medians on the right."""
    torch_sync = args.device == "cuda"
    cpu = (f"{os.cpu_count()} CPU cores, {threads} torch thread(s) per rank"
           if args.device == "cpu" else "one GPU per rank")
    lines = [
        f"InPlaceABNSync vs InPlaceABN, forward+backward per layer, {args.device}, {backend}, "
        f"world size {world}, {cpu}, float32, batch {args.batch} per rank, "
        f"torch {torch.__version__}",
        f"ms per step (input clone included), median of {args.repeats} interleaved repeats; "
        f"left: max over ranks of each rank's median (a synchronised step waits for the "
        f"slowest rank), right: rank 0's own",
        f"overhead = {SYNC} - {LOCAL}; ratio = {SYNC} / {LOCAL}; comm = {COMM} alone "
        f"(2C+1 float64 gathered, 2C float32 reduced)"
        + (f"; vs nn = {SYNC} / {TORCH_SYNC}" if torch_sync else ""),
        "",
    ]
    extra = f"{TORCH_SYNC:>10}{'vs nn':>7}" if torch_sync else ""
    half = f"{LOCAL:>8}{SYNC:>10}{'overhead':>10}{'ratio':>7}{'comm':>8}"
    lines.append(f"{'C x H x W':<13}{half}{extra}  | rank 0:{half}")
    for row in rows:
        cells = []
        for which in ("median_ms_max_over_ranks", "median_ms_rank0"):
            m = row[which]
            f = row["max_over_ranks" if which == "median_ms_max_over_ranks" else "rank0"]
            cell = (f"{m[LOCAL]:>8.3f}{m[SYNC]:>10.3f}{f['overhead_ms']:>10.3f}"
                    f"{f['ratio']:>7.3f}{m[COMM]:>8.3f}")
            if torch_sync and which == "median_ms_max_over_ranks":
                cell += f"{m[TORCH_SYNC]:>10.3f}{f['ratio_vs_nn_syncbn']:>7.3f}"
            cells.append(cell)
        label = "x".join(map(str, row["shape_per_rank"][1:]))
        lines.append(f"{label:<13}{cells[0]}  | {'':7}{cells[1]}")
    cores = os.cpu_count() or 1
    if args.device == "cpu" and world * threads > cores:
        lines += ["", f"warning: {world} ranks x {threads} thread(s) > {cores} cores: the ranks "
                  f"take turns on the cores, so the timings include waiting for a core"]
    if not torch_sync:
        lines += ["", CPU_NOTE]
    elif world == 1:
        lines += ["", "world size 1: neither synchronised layer communicates (both normalise "
                  "with this process's batch), so this compares the layers' compute"]
    return "\n".join(lines)


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace,
             started: float) -> None:
    """``torch.multiprocessing.spawn`` entry point: one rank times every shape."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device, backend = torch.device("cuda", rank), "nccl"
        torch.cuda.set_device(device)
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world)
    # At world size 1 (the GPU comparison) InPlaceABNSync warns that it has nobody to sync with.
    warnings.filterwarnings("ignore", message="InPlaceABNSync runs without")
    try:
        rows = []
        for channels, size in SHAPES:
            mine = time_shape(args, rank, world, channels, size, device)
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, mine["samples"])
            rows.append(summarise((args.batch, channels, size, size), mine["iters"], everyone))
        if rank == 0:
            report(rows, args, world, backend, torch.get_num_threads(), started)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def report(rows: list[dict[str, Any]], args: argparse.Namespace, world: int, backend: str,
           threads: int, started: float) -> None:
    """Print the table and write the JSON file (rank 0)."""
    print(format_table(rows, args, world, backend, threads), flush=True)
    result = {
        "benchmark": "sync_overhead",
        "description": "forward+backward of one InPlaceABNSync vs InPlaceABN layer per step "
        "(input clone included), plus the layer's two collectives alone; per shape the median "
        "over repeats of every rank, and their max over ranks",
        "note": CPU_NOTE if args.device == "cpu" else None,
        "machine": machine_info(),
        "device": args.device,
        "backend": backend,
        "world_size": world,
        "threads_per_rank": threads,
        "dtype": "float32",
        "providers": list(providers(args.device)),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "shapes": rows,
        "wall_time_s": round(time.time() - started, 2),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results written to {args.json} ({result['wall_time_s']:.1f} s)", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Per-layer synchronisation overhead of InPlaceABNSync over "
        "torch.distributed (gloo on CPU by default).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--world", type=int, default=None,
                        help="number of ranks (default: 2 on CPU; on CUDA min(2, GPUs))")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo; cuda: nccl, one GPU per rank, adds nn_syncbn")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank")
    parser.add_argument("--repeats", type=int, default=7, help="timed interleaved repeats")
    parser.add_argument("--iters", type=int, default=0,
                        help="steps per timed block (0: enough for about --target-ms)")
    parser.add_argument("--target-ms", type=float, default=100.0,
                        help="aimed duration of one timed block when --iters is 0")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per provider")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="MASTER_PORT (0: a free one)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="results file")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1 or args.batch < 1:
        parser.error("--repeats, --threads and --batch must be >= 1")
    if args.iters < 0 or args.warmup < 0:
        parser.error("--iters and --warmup must be >= 0")
    if args.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            parser.error("--device cuda: CUDA is not available here")
        if args.world is None:
            args.world = min(2, gpus)
        if not 1 <= args.world <= gpus:
            parser.error(f"--device cuda needs one GPU per rank: --world 1..{gpus}")
        if not dist.is_nccl_available():
            parser.error("--device cuda needs the nccl backend, which this torch lacks")
    else:
        if args.world is None:
            args.world = 2
        if args.world < 2:
            parser.error("--world must be >= 2 on CPU (one rank has nothing to synchronise)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.time()  # wall clock: compared across processes
    port = args.port or free_port()
    mp.spawn(run_rank, args=(args.world, port, args, started), nprocs=args.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
