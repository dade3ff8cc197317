"""The PCIe bound of offloading: host <-> device copy bandwidth and the bytes OffloadModel moves.

An offloaded training step can be no faster than the larger of the same step without
offloading and the time its copies take. ``iabn.OffloadModel`` sends every offloaded byte to
the host in the forward pass and fetches it back in the backward pass, both on its one copy
stream, so the copies take at least ``transferred / D2H bandwidth + transferred / H2D
bandwidth``. This script measures, in one process:

- the pinned host <-> device copy bandwidth: a ``--copy-mib`` buffer of random float32 copied
  device -> pinned host and back (``non_blocking``, CUDA events, median of ``--repeats`` after a
  warm-up), each byte counted once (it crosses the bus once);
- the bytes ``OffloadModel`` (its default layers: inputs of the convolutions and poolings, as
  ``memory_time_pareto.py``'s ``offload_all``) offloads and transfers in one training step of
  the model: VGG-19 with BatchNorm, batch 32 at 128 x 128 by default, the setting of
  ``memory_time_pareto.py``, which times the steps themselves;

and writes ``copy_ms = transferred / d2h + transferred / h2d`` with them. The bound,
``max(eager step, copy_ms)``, is formed by ``benchmarks/gpu_campaign.py``'s summary from this
file and ``memory_time_pareto.py``'s eager step time. ``--device cpu --quick`` is a smoke run:
plain host copies, no PCIe, not a measurement.

Usage::

    python benchmarks/offload_pcie.py [--device cuda] [--model vgg19:bn] [--batch 32]
        [--size 128] [--copy-mib 1024] [--repeats 10] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

import torch
from torch import nn

from iabn.memory.offloading import OffloadModel
from iabn.models import MODELS, NORM_ACT_NAMES, create
from iabn.tools.bench import machine_info, results_folder, write_json

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
MIB = 2**20


class UsageError(Exception):
    """A bad command line: one line on stderr, exit status 2."""


def _timed_ms(copy, cuda: bool) -> float:
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    begin = time.perf_counter()
    copy()
    return (time.perf_counter() - begin) * 1e3


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """GB/s (bytes crossing once) of device -> host and host -> device copies."""
    cuda = device.type == "cuda"
    on_device = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=cuda).normal_()
    directions = {"d2h": lambda: host.copy_(on_device, non_blocking=cuda),
                  "h2d": lambda: on_device.copy_(host, non_blocking=cuda)}
    samples: dict[str, list[float]] = {}
    for name, copy in directions.items():
        for _ in range(2):  # warm-up
            _timed_ms(copy, cuda)
        samples[name] = [_timed_ms(copy, cuda) for _ in range(repeats)]
    return {"copy_bytes": nbytes,
            **{f"{name}_gbps": nbytes / (median(ms) * 1e-3) / 1e9
               for name, ms in samples.items()},
            **{f"{name}_samples_ms": ms for name, ms in samples.items()}}


def offloaded_bytes(name: str, norm_act: str, batch: int, size: int,
                    device: torch.device) -> dict:
    """What ``OffloadModel`` offloads, keeps and transfers in one training step (the second:
    the first sizes the host pool)."""
    torch.manual_seed(0)
    model = create(name, norm_act=norm_act).to(device)
    wrapped = OffloadModel(model)
    x = torch.randn(batch, 3, size, size, device=device)
    target = torch.randint(0, 1000, (batch,), device=device)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(wrapped(x), target).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = wrapped.stats
    return {"offloaded_bytes": stats.offloaded_bytes, "kept_bytes": stats.kept_bytes,
            "transferred_bytes": stats.transferred_bytes}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="vgg19:bn", help="name:norm_act (default vgg19:bn)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true",
                        help="smoke: batch 2, 32x32, 16 MiB copies, 3 repeats")
    parser.add_argument("--json", type=Path, default=None,
                        help="default: results/offload_pcie_<device>.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.size, args.copy_mib, args.repeats = 2, 32, 16, 3
    try:
        args.device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r}: use cpu, cuda or cuda:N") from None
    if args.device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: use cpu, cuda or cuda:N")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but CUDA is not available (--device cpu --quick is "
                         "the smoke run)")
    name, _, norm_act = args.model.partition(":")
    if name not in MODELS or norm_act not in NORM_ACT_NAMES:
        raise UsageError(f"--model {args.model!r}: use name:norm_act with a name from "
                         f"{', '.join(MODELS)} and norm_act from {', '.join(NORM_ACT_NAMES)}")
    args.model_name, args.norm_act = name, norm_act
    if args.batch < 2 or args.size < 32:
        raise UsageError("--batch must be >= 2 and --size >= 32")
    if args.copy_mib < 1 or args.repeats < 1:
        raise UsageError("--copy-mib and --repeats must be >= 1")
    args.json = args.json or RESULTS / f"offload_pcie_{args.device.type}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as error:
        print(f"offload_pcie: error: {error}", file=sys.stderr)
        return 2
    device = args.device
    bandwidth = copy_bandwidth(device, args.copy_mib * MIB, args.repeats)
    moved = offloaded_bytes(args.model_name, args.norm_act, args.batch, args.size, device)
    transferred = moved["transferred_bytes"]
    copy_ms = (transferred / (bandwidth["d2h_gbps"] * 1e9)
               + transferred / (bandwidth["h2d_gbps"] * 1e9)) * 1e3
    info = machine_info(device)  # on a CPU: host copies, no PCIe
    print(f"d2h {bandwidth['d2h_gbps']:.1f} GB/s, h2d {bandwidth['h2d_gbps']:.1f} GB/s; "
          f"{args.model} b{args.batch} {args.size}px offloads {moved['offloaded_bytes'] / MIB:.1f}"
          f" MiB, transfers {transferred / MIB:.1f} MiB: copies >= {copy_ms:.2f} ms per step")
    write_json(args.json, {
        "benchmark": "offload_pcie", "machine": info, "device": str(device),
        "model": args.model_name, "norm_act": args.norm_act, "batch": args.batch,
        "size": args.size, "repeats": args.repeats, **bandwidth, **moved, "copy_ms": copy_ms,
        "copy_ms_is": "transferred_bytes / d2h_gbps + transferred_bytes / h2d_gbps (one copy "
                      "stream: forward sends, backward fetches)"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
