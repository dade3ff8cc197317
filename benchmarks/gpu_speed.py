"""GPU speed of one norm + activation layer: eager BN, compiled BN, iabn reference, iabn Triton.

Shapes of the paper's timing figure (ResNeXt-101 CONV1..CONV4 inputs at batch 32) and one
segmentation-size tensor; float32 and bfloat16; NCHW and channels-last. Providers:

``eager``      ``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=True)`` (cuDNN on a GPU)
``compile``    the same module under ``torch.compile``
``reference``  ``iabn.InPlaceABN`` on the pure-PyTorch kernels (``IABN_BACKEND=reference``)
``triton``     ``iabn.InPlaceABN`` on the fused Triton kernels (``IABN_BACKEND=triton``)

Modes: ``forward``, ``backward`` (after an untimed forward) and ``full`` (forward + backward).
Every timed call gets a fresh non-leaf input made outside the timed region (in-place layers
overwrite it), and is timed alone with CUDA events; the figure is the median over repeats,
with providers interleaved within each repeat. Also reported:

- effective bandwidth: the bytes a fused layer must move (docs/design.md, "Kernels: numerics
  and launch plan": 3 tensor-sizes forward, 5 backward, 8 full), over the time, as a fraction
  of a measured device-to-device copy;
- peak memory of one training step above what was allocated before it (MiB);
- the largest relative error of each provider's output and input gradient against a float64
  ``nn.BatchNorm2d`` computation on the same input.

With ``--profile``, one more forward + backward of every provider runs under
``torch.profiler`` (``iabn.tools.bench.profile``): its kernel launches, their summed device time
against the wall time, and the top kernels; a layer short of its bandwidth target is explained
by these (``profile`` in each row of mode ``full``).

Results go to a JSON file (with device name, versions and date) and are appended to a CSV.
Plot with ``benchmarks/plot_gpu_speed.py``. ``--device cpu --quick`` is a smoke run for CI:
CPU times say nothing about GPU behaviour.

Usage::

    python benchmarks/gpu_speed.py [--repeats 50] [--dtypes float32,bfloat16]
        [--layouts nchw,channels_last] [--providers eager,compile,reference,triton]
        [--shapes 32x256x56x56,...] [--profile]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import torch
from torch import nn

import iabn
from iabn.tools.bench import (
    RESNEXT101_STAGES,
    machine_info,
    parse_shapes,
    results_folder,
    write_json,
)
from iabn.tools.bench.profile import format_profile, profile_call

PAPER_SHAPES = [*((32, c, s, s) for c, s in RESNEXT101_STAGES), (8, 256, 128, 128)]
QUICK_SHAPES = [(4, 8, 6, 6), (2, 16, 3, 5)]
PROVIDERS = ("eager", "compile", "reference", "triton")
MODES = ("forward", "backward", "full")
#: Tensor-sizes a fused in-place layer must move per mode (docs/design.md, "Kernels: numerics
#: and launch plan").
MIN_TRAFFIC = {"forward": 3, "backward": 5, "full": 8}
SLOPE = 0.01
RESULTS = results_folder(Path(__file__).resolve().parent / "results")


class Timer:
    """Times one call: CUDA events on a GPU, the host clock (after a sync) elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    nbytes = 1 << 30 if device.type == "cuda" else 1 << 26
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    timer = Timer(device)
    dst.copy_(src)
    times = [timer(lambda: dst.copy_(src)) for _ in range(repeats)]
    return 2 * nbytes / (median(times) * 1e-3) / 1e9


def layer_parameters(channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (non-trivial) weight and bias every provider and the float64 reference share."""
    generator = torch.Generator().manual_seed(0)
    return torch.rand(channels, generator=generator) + 0.5, torch.randn(channels,
                                                                         generator=generator)


def make_layer(provider: str, channels: int, device: torch.device,
               fmt: torch.memory_format) -> Callable[[torch.Tensor], torch.Tensor]:
    """The provider's layer with the same (non-trivial) parameters and statistics."""
    weight, bias = layer_parameters(channels)
    if provider in ("eager", "compile"):
        bn = nn.BatchNorm2d(channels)
        model: nn.Module = nn.Sequential(bn, nn.LeakyReLU(SLOPE, inplace=True))
    else:
        bn = model = iabn.InPlaceABN(channels, activation="leaky_relu", activation_param=SLOPE)
    with torch.no_grad():
        bn.weight.copy_(weight)
        bn.bias.copy_(bias)
    # float32 parameters with low-precision inputs, as mixed-precision training has them
    model = model.to(device=device, memory_format=fmt)
    if provider == "compile":
        return torch.compile(model)
    if provider == "eager":
        return model

    def run(x: torch.Tensor) -> torch.Tensor:
        os.environ["IABN_BACKEND"] = provider  # read by iabn on every call
        return model(x)

    return run


def max_relative_errors(layer: Callable, leaf: torch.Tensor, grad: torch.Tensor,
                        channels: int) -> tuple[float, float]:
    """Relative error (max |diff| / max |ref|) of output and input gradient against float64."""
    ref_bn = nn.BatchNorm2d(channels).double().to(leaf.device)
    weight, bias = layer_parameters(channels)
    with torch.no_grad():
        ref_bn.weight.copy_(weight)
        ref_bn.bias.copy_(bias)
    x64 = leaf.detach().double().requires_grad_()
    out64 = nn.functional.leaky_relu(ref_bn(x64), SLOPE)
    out64.backward(grad.double())
    leaf.grad = None
    out = layer(leaf.clone())
    out.backward(grad)
    errors = []
    for ours, ref in ((out.detach(), out64.detach()), (leaf.grad, x64.grad)):
        errors.append(((ours.double() - ref).abs().max() / ref.abs().max()).item())
    return errors[0], errors[1]


def time_mode(layer: Callable, leaf: torch.Tensor, grad: torch.Tensor, mode: str,
              timer: Timer) -> float:
    leaf.grad = None
    x = leaf.clone()  # a fresh non-leaf input, outside the timed region
    if mode == "forward":
        with torch.no_grad():
            return timer(lambda: layer(x))
    if mode == "full":
        return timer(lambda: layer(x).backward(grad))
    out = layer(x)
    return timer(lambda: out.backward(grad))


def peak_step_mib(layer: Callable, leaf: torch.Tensor, grad: torch.Tensor) -> float | None:
    if leaf.device.type != "cuda":
        return None
    leaf.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer(leaf.clone()).backward(grad)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def bench_config(shape, dtype, layout, providers, args, timer, copy_gbps) -> list[dict]:
    device = torch.device(args.device)
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    channels = shape[1]
    leaf = (torch.randn(shape, device=device) * 2 + 0.5).to(dtype)
    leaf = leaf.contiguous(memory_format=fmt).requires_grad_()
    grad = torch.randn(shape, device=device).to(dtype).contiguous(memory_format=fmt)
    layers = {p: make_layer(p, channels, device, fmt) for p in providers}
    for layer in layers.values():  # warm-up: compilation, autotuning, allocator
        for mode in MODES:
            for _ in range(args.warmup):
                time_mode(layer, leaf, grad, mode, timer)
    times: dict[tuple[str, str], list[float]] = {(p, m): [] for p in providers for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            for provider, layer in layers.items():
                times[provider, mode].append(time_mode(layer, leaf, grad, mode, timer))
    tensor_bytes = leaf.numel() * leaf.element_size()
    rows = []
    for provider, layer in layers.items():
        out_err, grad_err = max_relative_errors(layer, leaf, grad, channels)
        peak = peak_step_mib(layer, leaf, grad)
        profiled = None
        if args.profile:
            leaf.grad = None
            x = leaf.clone()
            profiled = profile_call(lambda layer=layer, x=x: layer(x).backward(grad), device)
            print(f"    {provider}: {format_profile(profiled)}", file=sys.stderr, flush=True)
        for mode in MODES:
            ms = median(times[provider, mode])
            gbps = MIN_TRAFFIC[mode] * tensor_bytes / (ms * 1e-3) / 1e9
            rows.append({
                "shape": "x".join(map(str, shape)), "dtype": str(dtype).removeprefix("torch."),
                "layout": layout, "provider": provider, "mode": mode, "median_ms": ms,
                "effective_gbps": gbps, "fraction_of_copy": gbps / copy_gbps,
                "peak_step_mib": peak, "output_rel_err": out_err, "grad_rel_err": grad_err,
                **({"profile": profiled} if mode == "full" and profiled else {}),
            })
    return rows


def summary(rows: list[dict]) -> str:
    """Full-step time of each iabn provider relative to eager BN, and its bandwidth fraction."""
    lines = [f"{'shape':<18}{'dtype':<10}{'layout':<15}{'provider':<11}{'full ms':>9}"
             f"{'vs eager':>10}{'of copy':>9}{'peak MiB':>10}"]
    eager = {(r["shape"], r["dtype"], r["layout"]): r["median_ms"] for r in rows
             if r["provider"] == "eager" and r["mode"] == "full"}
    for r in rows:
        if r["mode"] != "full":
            continue
        base = eager.get((r["shape"], r["dtype"], r["layout"]))
        ratio = f"{r['median_ms'] / base:.2f}x" if base else "-"
        peak = f"{r['peak_step_mib']:.0f}" if r["peak_step_mib"] is not None else "-"
        lines.append(f"{r['shape']:<18}{r['dtype']:<10}{r['layout']:<15}{r['provider']:<11}"
                     f"{r['median_ms']:>9.3f}{ratio:>10}{r['fraction_of_copy']:>9.0%}"
                     f"{peak:>10}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few repeats")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layouts", default="nchw,channels_last")
    parser.add_argument("--providers", default=",".join(PROVIDERS))
    parser.add_argument("--shapes", default=None,
                        help="NxCxHxW,... (default: the paper's shapes; --quick: tiny ones)")
    parser.add_argument("--profile", action="store_true",
                        help="profile one forward + backward per provider (kernels, time)")
    parser.add_argument("--json", type=Path, default=RESULTS / "gpu_speed.json")
    parser.add_argument("--csv", type=Path, default=RESULTS / "gpu_speed.csv")
    args = parser.parse_args(argv)
    args.providers = args.providers.split(",")
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        parser.error(f"--providers: unknown {sorted(unknown)}; use some of {PROVIDERS}")
    args.dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    args.layouts = args.layouts.split(",")
    if set(args.layouts) - {"nchw", "channels_last"}:
        parser.error("--layouts: use nchw and/or channels_last")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures GPU kernels (use --device cpu "
                     "--quick only for a smoke run of the script)")
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 3), 1
    try:
        args.shapes = (parse_shapes(args.shapes) if args.shapes is not None
                       else QUICK_SHAPES if args.quick else PAPER_SHAPES)
    except ValueError as error:
        parser.error(f"--shapes: {error}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    timer = Timer(device)
    copy_gbps = copy_bandwidth(device, max(args.repeats // 5, 3))
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s", file=sys.stderr)
    rows: list[dict] = []
    configs = [(s, d, lay) for s in args.shapes for d in args.dtypes for lay in args.layouts]
    for index, (shape, dtype, layout) in enumerate(configs, 1):
        print(f"[{index}/{len(configs)}] {shape} {dtype} {layout}", file=sys.stderr, flush=True)
        rows.extend(bench_config(shape, dtype, layout, args.providers, args, timer, copy_gbps))
    info = machine_info(device)
    write_json(args.json, {"machine": info, "copy_gbps": copy_gbps, "repeats": args.repeats,
                           "warmup": args.warmup, "rows": rows})
    new_file = not args.csv.exists()
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open("a", newline="") as handle:
        # flat columns only: a row's profile (a nested record) stays in the JSON
        fields = ["date_utc", "device_name", "torch_version", "triton_version",
                  *(key for key in rows[0] if key != "profile")]
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        if new_file:
            writer.writeheader()
        for row in rows:
            writer.writerow({**{k: info[k] for k in fields[:4]}, **row})
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
