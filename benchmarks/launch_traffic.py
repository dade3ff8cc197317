"""Launches, memory traffic and backward memory of one norm + LeakyReLU layer, counted on CPU.

A batch-norm layer on a GPU is memory-bound: its time is the bytes it moves over the
bandwidth plus the host time of its launches. Both are counted exactly here, by
:mod:`iabn.measure.traffic` (its docstring has the rules), for one forward + backward
``layer(leaf.clone()).backward(grad)`` of each provider:

``bn``              ``nn.BatchNorm2d`` + ``nn.LeakyReLU(0.01, inplace=True)`` (the baseline)
``abn``             ``iabn.ABN`` (not in place)
``iabn_reference``  ``iabn.InPlaceABN`` on the reference kernels (the default backend)
``iabn_triton``     ``iabn.InPlaceABN`` on the Triton kernels, run by Triton's CPU interpreter
                    (``TRITON_INTERPRET=1``, set by this script before Triton is imported)

in float32, bfloat16 and float16, NCHW and channels-last, training and eval mode (eval: the
running statistics normalise; every gradient is still computed). Half-precision inputs run
with float32 parameters, as under ``torch.autocast`` on a GPU (which leaves batch norm to
its mixed-precision kernels) and as in iabn's own autocast test.

Each row gives the launches, the bytes of full-size tensors read + written (also in
activations, the bytes of one input tensor), the peak of full-size memory allocated by the
backward (its input gradient included), and the dtypes of the full-size tensors the step
allocated. Bytes and peak scale linearly with the number of elements at a fixed channel count
(per-channel tensors are not counted); launches do not depend on the shape.

Usage::

    python benchmarks/launch_traffic.py [--shape 8 64 28 28] [--json PATH] [--quick]
"""

from __future__ import annotations

import os

# Triton reads this when its kernels are defined: before anything imports them.
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

import iabn
from iabn.kernels.backends import has_triton, use_backend
from iabn.measure import traffic
from iabn.tools.bench import machine_info, results_folder, write_json

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
#: A ResNet stage-2 layer at batch 8: large enough that per-channel work is negligible,
#: small enough for Triton's interpreter (about a second per step).
SHAPE = (8, 64, 28, 28)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LAYOUTS = {"nchw": torch.contiguous_format, "channels_last": torch.channels_last}
SLOPE = 0.01


def providers(channels: int) -> dict[str, tuple[nn.Module, str | None]]:
    """``{name: (layer, backend)}``, float32 parameters, the same weights for all."""
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
    layers = {
        "bn": (nn.Sequential(bn, nn.LeakyReLU(SLOPE, inplace=True)), None),
        "abn": (iabn.ABN(channels, activation_param=SLOPE), None),
        "iabn_reference": (iabn.InPlaceABN(channels, activation_param=SLOPE), "reference"),
    }
    if has_triton():
        layers["iabn_triton"] = (iabn.InPlaceABN(channels, activation_param=SLOPE), "triton")
    for name, (layer, _) in layers.items():
        if name != "bn":
            layer.load_state_dict(bn.state_dict())
    return layers


def _phase(counter: traffic.TrafficCounter) -> dict:
    return {"launches": len(counter.launches), "ops": counter.names(),
            "read_bytes": counter.read, "written_bytes": counter.written}


def count_row(layer: nn.Module, backend: str | None, shape, dtype, layout,
              training: bool) -> dict:
    layer.train(training)
    torch.manual_seed(0)
    leaf = torch.randn(shape).to(dtype).contiguous(memory_format=layout).requires_grad_()
    grad = torch.randn(shape).to(dtype).contiguous(memory_format=layout)
    if backend is None:
        step = traffic.count_step(layer, leaf, grad)
    else:
        with use_backend(backend):
            step = traffic.count_step(layer, leaf, grad)
    activation = leaf.numel() * leaf.element_size()
    allocated = step.forward.allocations + step.backward.allocations
    moved = step.forward.moved + step.backward.moved
    return {
        "launches": len(step.forward.launches) + len(step.backward.launches),
        "bytes": moved,
        "activations_moved": moved / activation,
        "backward_peak_bytes": step.backward.peak_bytes,
        "backward_peak_activations": step.backward.peak_bytes / activation,
        "full_size_dtypes": sorted({str(a.dtype).removeprefix("torch.") for a in allocated}),
        "full_size_float32": any(a.dtype == torch.float32 for a in allocated),
        "forward": _phase(step.forward),
        "backward": _phase(step.backward),
    }


def measure(shape, quick: bool = False) -> list[dict]:
    rows = []
    layers = providers(shape[1])
    dtypes = {"float32": torch.float32} if quick else DTYPES
    for dtype_name, dtype in dtypes.items():
        for layout_name, layout in LAYOUTS.items():
            for mode in ("train", "eval"):
                base = None
                for name, (layer, backend) in layers.items():
                    row = {"provider": name, "dtype": dtype_name, "layout": layout_name,
                           "mode": mode}
                    row.update(count_row(layer, backend, shape, dtype, layout,
                                         mode == "train"))
                    base = base or row
                    row["bytes_vs_bn"] = row["bytes"] / base["bytes"]
                    row["launches_vs_bn"] = row["launches"] - base["launches"]
                    rows.append(row)
                    print(f"{name:15} {dtype_name:9} {layout_name:13} {mode:5} "
                          f"launches {row['launches']:3} ({row['launches_vs_bn']:+d})  "
                          f"moved {row['activations_moved']:5.2f} act "
                          f"({row['bytes_vs_bn']:.3f}x bn)  backward peak "
                          f"{row['backward_peak_activations']:.2f} act  "
                          f"{','.join(row['full_size_dtypes'])}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=4, default=SHAPE, metavar=("N", "C", "H", "W"))
    parser.add_argument("--quick", action="store_true", help="float32 only (CI smoke)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.shape) < 1:
        print("error: --shape: every size must be >= 1", file=sys.stderr)
        return 2
    shape = tuple(args.shape)
    rows = measure(shape, args.quick)
    path = args.json or RESULTS / "launch_traffic.json"
    write_json(path, {
        "machine": machine_info(),
        "device": "cpu (counts, not timings: they do not depend on the device)",
        "triton": "interpreted (TRITON_INTERPRET=1)" if has_triton() else "not installed",
        "shape": list(shape),
        "activation_bytes": {name: torch.Size(shape).numel() * torch.empty(0, dtype=d)
                             .element_size() for name, d in DTYPES.items()},
        "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
