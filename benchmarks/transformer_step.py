"""Training step of transformers and ConvNeXt, as given against ``iabn.convert``'s lossless
conversion (output-only layer and RMS norms, in-place GELU and SiLU).

Models: timm's ``vit_small_patch16_224`` and ``convnext_tiny`` (random weights, nothing
downloaded) and the Llama-style decoder of tests/support/transformer_models.py (the
``decoder`` here: dim 512, 8 heads, SwiGLU hidden 1376, 4 blocks, 256 tokens), the default;
asked for by name, torchvision's ``efficientnet_b0`` (batch norm + SiLU, which the conversion
makes ``InPlaceABN`` with SiLU, and the squeeze-excitation's SiLU ``InPlaceSiLU``). Providers:

``given``       the model as built
``converted``   ``iabn.convert(model, example, verify=False)`` of a copy (same weights)
``norms_only``  the same with ``activations=False``: only the layer and RMS norms replaced
``converted_triton``  (CUDA, eager) ``converted`` with ``IABN_BACKEND=triton``: the
                      activations' backward in one Triton launch each

Modes: ``eager`` and ``compile`` (``torch.compile`` of each provider's model, Inductor; the
ratio is compiled against compiled). A step is ``zero_grad(set_to_none=True)``, forward, a
sum of the outputs, backward; inputs are made outside the timed region. Each repeat times one
step of each provider, interleaved (``iabn.tools.bench.time_interleaved``), after warm-up
steps (the compilation among them); the figure is the median, and ``ratio`` is the median of
the per-repeat ratios ``provider / given`` with their quartiles. Also per provider:
``saved_bytes``, the exact bytes autograd keeps for backward in one eager training forward
(``iabn.memory.saved_tensor_bytes``), and on CUDA ``peak_step_bytes``, the allocator's peak
above what was allocated before one more step. The target: ``converted``'s ratio <= 1.10 on
CPU compiled against compiled (reported, never asserted). The JSON (machine, versions, date)
is rewritten after every cell.

Usage::

    python benchmarks/transformer_step.py [--device cpu|cuda] [--models vit_small,...]
        [--modes eager,compile] [--dtypes float32,bfloat16] [--batch N] [--repeats 15]
        [--warmup 3] [--threads N] [--capture-dynamic-shapes] [--quick] [--json PATH]

``--capture-dynamic-shapes``: compile with ``torch._dynamo.config.capture_dynamic_output_shape_ops
= True``, under which Dynamo traces the output-only layer norms' count of kept features
(``nonzero``) instead of breaking the graph there (docs/limits.md: without it a converted
ConvNeXt-T broke into 42 graphs and hit Dynamo's recompile limit).

``--quick``: tiny settings for a smoke test (ViT-S at 32x32 with depth 2, the decoder with
2 blocks of dim 64, batch 2, eager, 2 repeats).
"""

from __future__ import annotations

import argparse
import copy
import sys
from datetime import datetime, timezone
from pathlib import Path
from statistics import median, quantiles

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the decoder's definition

import iabn  # noqa: E402
from iabn.kernels.backends import has_triton, use_backend  # noqa: E402
from iabn.memory import saved_tensor_bytes  # noqa: E402
from iabn.tools.bench import (  # noqa: E402
    machine_info,
    progress_printer,
    results_folder,
    set_threads,
    synchronize,
    time_interleaved,
    write_json,
)

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
MODELS = ("vit_small", "convnext_tiny", "decoder", "efficientnet_b0")
#: ``--models``' default (the GPU campaign names its models itself)
DEFAULT_MODELS = ("vit_small", "convnext_tiny", "decoder")
MODES = ("eager", "compile")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TARGET = 1.10


def build(name: str, batch: int, quick: bool, device: torch.device):
    """``(model, example input)`` on ``device``, the same weights for every call."""
    torch.manual_seed(0)
    if name == "decoder":
        from transformer_models import Decoder
        model = (Decoder(vocabulary=128, dim=64, heads=4, hidden=176, depth=2) if quick else
                 Decoder(vocabulary=32000, dim=512, heads=8, hidden=1376, depth=4))
        example = torch.randint(0, model.head.out_features, (batch, 16 if quick else 256))
    elif name == "efficientnet_b0":
        import torchvision
        model = torchvision.models.efficientnet_b0()
        size = 32 if quick else 224
        example = torch.randn(batch, 3, size, size)
    else:
        import timm
        kwargs = {"img_size": 32, "depth": 2} if quick and name == "vit_small" else {}
        model = timm.create_model({"vit_small": "vit_small_patch16_224",
                                   "convnext_tiny": "convnext_tiny"}[name], pretrained=False,
                                  **kwargs)
        size = 32 if quick else 224
        example = torch.randn(batch, 3, size, size)
    return model.to(device), example.to(device)


def step_of(model, example, dtype):
    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(example.device.type, dtype=dtype,
                            enabled=dtype is not torch.float32):
            out = model(example)
        out.float().sum().backward()
    return step


def with_backend(name: str, step):
    def run():
        with use_backend(name):
            step()
    return run


def peak_step_bytes(step, device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def cell(name: str, mode: str, dtype_name: str, args, device) -> dict:
    model, example = build(name, args.batch, args.quick, device)
    converted, report = iabn.convert(model, example, verify=False)
    norms_only, _ = iabn.convert(model, example, verify=False, activations=False)
    models = {"given": model.train(), "converted": converted.train(),
              "norms_only": norms_only.train()}
    saved = {}
    for provider, m in models.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            saved[provider] = saved_tensor_bytes(m, example)
    if mode == "compile":
        torch._dynamo.reset()
        models = {p: torch.compile(copy.deepcopy(m)) for p, m in models.items()}
    steps = {p: step_of(m, example, DTYPES[dtype_name]) for p, m in models.items()}
    if device.type == "cuda" and mode == "eager" and has_triton():
        steps["converted_triton"] = with_backend("triton", steps["converted"])
    label = f"{name} {mode} {dtype_name}"
    print(f"{label}: warming up ({args.warmup} steps each{', compiling' * (mode == 'compile')})",
          file=sys.stderr, flush=True)
    times = time_interleaved(steps, args.repeats, warmup=args.warmup,
                             on_repeat=progress_printer(f"{label} ", args.repeats),
                             device=device if device.type == "cuda" else None)
    ratio, spread = {}, {}
    others = [p for p in steps if p != "given"]
    for provider in others:
        ratios = [c / g for c, g in zip(times[provider], times["given"], strict=True)]
        quartiles = quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        ratio[provider], spread[provider] = median(ratios), [quartiles[0], quartiles[2]]
    result = {
        "model": name, "mode": mode, "dtype": dtype_name, "batch": args.batch,
        "input_shape": list(example.shape),
        "step_ms": {p: median(t) for p, t in times.items()},
        "step_ms_all": times,
        "ratio": ratio, "ratio_quartiles": spread,
        "saved_bytes": saved,
        "saved_ratio": {p: saved[p] / saved["given"] for p in ("converted", "norms_only")},
        "layers": report.counts,
        "peak_step_bytes": {p: peak_step_bytes(s, device) for p, s in steps.items()},
    }
    times_ms = result["step_ms"]
    print(f"{label}: given {times_ms['given']:.1f} ms; " + "; ".join(
        f"{p} {times_ms[p]:.1f} ms, {ratio[p]:.3f}x (quartiles {spread[p][0]:.3f}-"
        f"{spread[p][1]:.3f}), saved bytes {result['saved_ratio'][p]:.3f}x"
        for p in others if p in saved) + "".join(
        f"; {p} {times_ms[p]:.1f} ms, {ratio[p]:.3f}x" for p in others if p not in saved),
        flush=True)
    return result


def _list(parser: argparse.ArgumentParser, text: str, known, what: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    if not items or any(t not in known for t in items):
        parser.error(f"--{what} {text!r}: use a comma-separated list of {', '.join(known)}")
    return items


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--capture-dynamic-shapes", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.capture_dynamic_shapes:
        torch._dynamo.config.capture_dynamic_output_shape_ops = True
    models = _list(parser, args.models, MODELS, "models")
    modes = _list(parser, args.modes, MODES, "modes")
    dtypes = _list(parser, args.dtypes, DTYPES, "dtypes")
    if args.quick:
        args.repeats, args.warmup = min(args.repeats, 2), 1
        modes = ["eager"] if args.modes == ",".join(MODES) else modes
    if args.batch is None:
        args.batch = 2 if args.quick else 8
    if args.batch < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--batch and --repeats must be >= 1, --warmup >= 0")
    device = torch.device(args.device)
    threads = set_threads(args.threads)
    path = args.json or RESULTS / f"transformer_step_{device.type}.json"
    report = {"machine": machine_info(device), "device": str(device), "threads": threads,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "repeats": args.repeats, "warmup": args.warmup, "quick": args.quick,
              "capture_dynamic_output_shape_ops": args.capture_dynamic_shapes,
              "target_ratio": TARGET, "cells": []}
    for name in models:
        for mode in modes:
            for dtype_name in dtypes:
                report["cells"].append(cell(name, mode, dtype_name, args, device))
                write_json(path, report)
    for c in report["cells"]:
        if c["mode"] == "compile" and device.type == "cpu":
            verdict = "PASS" if c["ratio"]["converted"] <= TARGET else "FAIL"
            print(f"{verdict}: {c['model']} {c['dtype']} compiled step "
                  f"{c['ratio']['converted']:.3f}x of the compiled model as given (target "
                  f"<= {TARGET}; norms only {c['ratio']['norms_only']:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
