"""InPlace-ABN paper Table 3 analogue: pixels per batch under a fixed activation-memory budget.

DeepLabV3 (19 classes, output stride 8) on a dilated ResNeXt-101 body
(``ResNeXt(dilation=True)``) and on WideResNet-38-A2 (dilated), trained with a
cross-entropy loss. The budget is the activation bytes that standard BN + LeakyReLU keeps for
backward at the baseline size (16 crops of 512x512 by default, the paper's ResNeXt-101
baseline), so the baseline is 1.00. For each method the benchmark finds

- FIXED CROP: the largest batch of baseline-size crops within the budget, and
- FIXED BATCH: the largest crop (a multiple of 8) for the baseline batch within the budget,

and reports their pixels per batch relative to the baseline, as the paper's brackets do.

Methods: ``bn`` (standard BN + LeakyReLU), ``iabn`` (InPlace-ABN), ``iabn_offload``
(InPlace-ABN + ``iabn.OffloadModel``: only the bytes kept on the device count) and
``iabn_offload_working`` (the same plus the largest offloaded activation, which must be back on
the device while backward uses it: a floor under offloading's real working set).

These are activation bytes saved for backward (model + loss, exact, counted on PyTorch's meta
device at the real sizes; equal to real CPU counts, see tests/tools/test_pixels_per_batch.py),
not GPU peak memory: weights, gradients, optimiser state, cuDNN workspaces, the backward
transient and allocator fragmentation are not in them, and GPU peak memory is unmeasured here.

Usage::

    python benchmarks/pixels_per_batch.py [--batch 16] [--crop 512] [--json PATH]
    python benchmarks/pixels_per_batch.py --quick      # CI smoke run, writes no JSON by default
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from iabn.tools.bench import machine_info, results_folder, write_json
from iabn.tools.bench.pixels import BODIES, ByteCounter, PixelsRow, pixels_per_batch

DEFAULT_JSON = results_folder(Path(__file__).resolve().parent / "results") / "pixels_per_batch.json"
GIB = 2**30

#: Table 3 of the paper (Cityscapes columns): (batch, crop) per setting, gains in brackets.
PAPER = {
    "resnext101": {"bn": "16 x 512^2", "iabn_fixed_crop": "28 x 512^2 [+75%]",
                   "iabn_fixed_batch": "16 x 672^2 [+72%]"},
    "wider_resnet38_a2": {"bn": "20 x 512^2", "iabn_fixed_crop": "28 x 512^2 [+40%]",
                          "iabn_fixed_batch": "20 x 640^2 [+56%]"},
}
#: --quick: smaller members of both families (ResNeXt-50, WideResNet-16-A2), a small baseline.
QUICK_DEPTHS = {"resnext101": 50, "wider_resnet38_a2": 16}
QUICK_NAMES = {"resnext101": "resnext50", "wider_resnet38_a2": "wider_resnet16_a2"}

DESCRIPTIONS = {
    "bn": "STD-BN + LeakyReLU",
    "iabn": "InPlace-ABN",
    "iabn_offload": "InPlace-ABN + offload (kept)",
    "iabn_offload_working": "  + largest activation back",
}

DEFINITIONS = {
    "bn": "nn.BatchNorm2d + in-place LeakyReLU: every saved byte counts",
    "iabn": "InPlaceABN: every saved byte counts",
    "iabn_offload": "InPlaceABN + OffloadModel(min_bytes=0): saved bytes kept on the device "
                    "(inputs of convolutions and poolings go to host memory)",
    "iabn_offload_working": "iabn_offload + the largest offloaded activation, back on the "
                            "device while backward uses it (a floor on the working set)",
}


def _size(size: tuple[int, int], gain: float) -> str:
    return f"{size[0]} x {size[1]}^2 [{100 * gain:+.0f}%]"


def format_table(rows: list[PixelsRow], names: dict[str, str]) -> str:
    batch, crop = rows[0].baseline
    lines = [
        f"Pixels per batch within the activation bytes of standard BN at {batch} x {crop}^2 "
        f"(= 1.00)",
        "ACTIVATION BYTES saved for backward (model + loss), exact, counted on the meta device; "
        "NOT GPU peak memory (unmeasured here).",
        "",
        f"{'body':<20}{'method':<31}{'bytes @ baseline':>20}   {'FIXED CROP':<24}"
        f"{'FIXED BATCH':<24}",
    ]
    for row in rows:
        used = f"{row.bytes_at_baseline / GIB:.2f} GiB {row.bytes_at_baseline / row.budget:.2f}"
        lines.append(f"{names[row.body]:<20}{DESCRIPTIONS[row.method]:<31}{used:>20}   "
                     f"{_size(row.fixed_crop, row.fixed_crop_gain):<24}"
                     f"{_size(row.fixed_batch, row.fixed_batch_gain):<24}")
    lines += ["", "paper (Cityscapes, GPU memory, InPlace-ABN): " + "; ".join(
        f"{body}: {p['bn']} -> {p['iabn_fixed_crop']}, {p['iabn_fixed_batch']}"
        for body, p in PAPER.items())]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=None,
                        help="baseline crops per batch (default 16; 4 with --quick)")
    parser.add_argument("--crop", type=int, default=None,
                        help="baseline crop side, a multiple of 8 (default 512; 64 with --quick)")
    parser.add_argument("--bodies", nargs="+", choices=BODIES, default=list(BODIES))
    parser.add_argument("--quick", action="store_true",
                        help="ResNeXt-50 and WideResNet-16-A2 at a small baseline (CI smoke)")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"where to write results (default {DEFAULT_JSON}; none with --quick)")
    args = parser.parse_args(argv)
    batch = args.batch or (4 if args.quick else 16)
    crop = args.crop or (64 if args.quick else 512)
    json_path = args.json or (None if args.quick else DEFAULT_JSON)
    depths = {body: QUICK_DEPTHS[body] if args.quick else None for body in args.bodies}

    start, rows = time.perf_counter(), []
    for body in args.bodies:
        rows += pixels_per_batch(ByteCounter.for_body(body, depths[body]), batch, crop)
        print(f"[pixels] {body} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr,
              flush=True)
    names = {body: QUICK_NAMES[body] if args.quick else body for body in args.bodies}
    print(format_table(rows, names))

    if json_path is not None:
        write_json(json_path, {
            "benchmark": "pixels_per_batch",
            "what": "activation bytes saved for backward by model + cross-entropy loss, exact, "
                    "counted on the meta device (float32); not GPU peak memory (unmeasured)",
            "model": "DeepLabV3 head (256 channels, dilations 12/24/36, image pooling), 19 "
                     "classes, bodies at output stride 8, LeakyReLU(0.01)",
            "methods": DEFINITIONS,
            "machine": machine_info(),
            "args": {"batch": batch, "crop": crop, "crop_step": 8, "quick": args.quick,
                     "bodies": names},
            "rows": [{
                "body": r.body, "method": r.method, "baseline": list(r.baseline),
                "budget_bytes": r.budget, "bytes_at_baseline": r.bytes_at_baseline,
                "relative_bytes_at_baseline": round(r.bytes_at_baseline / r.budget, 4),
                "fixed_crop": list(r.fixed_crop), "fixed_crop_gain": round(r.fixed_crop_gain, 4),
                "fixed_batch": list(r.fixed_batch),
                "fixed_batch_gain": round(r.fixed_batch_gain, 4),
            } for r in rows],
            "paper_table3_cityscapes": PAPER,
            "wall_time_s": round(time.perf_counter() - start, 1),
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
