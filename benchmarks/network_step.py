"""Whole-network training step: BatchNorm + activation against InPlace-ABN, whole networks.

For each model (ResNet-50, ResNeXt-101, WideResNet-38-A2 by default, at the issue's batches 64,
32 and 16 of 224 x 224 images), dtype (float32; bfloat16 = autocast), layout (channels-last,
NCHW) and mode (eager; ``torch.compile``; ``torch.compile(mode="reduce-overhead")``, CUDA
graphs on a GPU, asked for with ``--modes reduce_overhead``), one SGD step of every provider is
timed:

``bn``            the model built with ``norm_act="bn"`` (``nn.BatchNorm2d`` + in-place LeakyReLU)
``iabn``          ``norm_act="iabn"`` on the default backend
``iabn_triton``   the same with ``IABN_BACKEND=triton`` around the step (CUDA only)
``original``      the original package's ``inplace_abn.InPlaceABN`` through the models'
                  pluggable ``norm_act`` callable (when ``import inplace_abn`` works)

All providers start from the same weights. A step is ``zero_grad(set_to_none=True)``, forward,
cross-entropy on random labels, backward and ``SGD(momentum=0.9).step()``; images and labels are
made outside the timed region. Each provider is warmed up (and compiled, in the compiled modes:
once per provider, ``torch._dynamo`` reset at the start of every compiled cell); then each
repeat times one step of every provider, providers interleaved
(``iabn.tools.bench.time_interleaved``, synchronised on CUDA); the figure is the median.
Memory, per provider:

- ``peak_step_bytes`` (CUDA): ``torch.cuda.max_memory_allocated`` during one more step, minus
  what was allocated before it (after ``zero_grad``: parameters, optimiser state and the batch
  are outside; activations, gradients and workspaces inside) — the issue's "peak".
- ``saved_bytes`` (every device, eager cells): the exact bytes autograd keeps for backward in
  the forward + loss, from ``iabn.memory.saved_tensor_bytes`` (parameters and buffers excluded).
  A CPU has no allocator peak; this is its memory figure. Counted by real forwards at batch 2,
  4 and the cell's batch: the count is ``a + k * batch`` exactly (every saved activation grows
  with the batch; per-channel statistics and autocast's weight copies do not), which the third
  count checks (``saved_bytes_linear``).

With ``--profile``, one more step of every provider runs under ``torch.profiler``
(``iabn.tools.bench.profile``): the kernels it launched, their summed device time against the
step's wall time, and the top kernels (``profile`` of each provider): a step slower than its
target is explained by where its time goes, device or host.

Largest batch in a fixed memory budget (``--budget-gib``, eager cells only):

- ``largest_batch_saved``: the largest batch whose saved bytes stay within the budget, solved
  from the exact linear count (no search needed; any device).
- ``largest_batch_peak`` (CUDA): a search (gallop from the linear guess, then bisection; at most
  ``--max-batch``) over real steps of a freshly built copy of the model. A batch fits when two
  steps run without ``torch.cuda.OutOfMemoryError`` and the allocator's peak above what was
  allocated before the model came to the device (model, gradients, optimiser state, batch,
  activations, workspaces) stays within the budget. ``--no-peak-search`` skips it.

Printed as it goes (one line per provider of each cell, with its ratio to ``bn`` from the same
run), then the targets as PASS/FAIL lines (reported, never asserted): step time
``iabn <= 0.95 x bn`` eager and ``<= 1.0 x`` compiled ``bn`` in the compiled modes; peak memory
``<= 0.55 x bn`` and the largest batch at equal memory ``>= 1.8 x bn`` for ResNeXt-101 and
WideResNet-38-A2 (1.8 is about 1 / 0.55: the batch form of the memory target). On CPU the
memory targets use saved bytes, and times say nothing about a GPU. The JSON (machine, device,
driver, CUDA and Triton versions, date) is rewritten after every cell, so an interrupted run
keeps what it measured, and ``--resume`` measures only the cells that file lacks (same device
and settings): a long GPU run can be split by ``--models`` / ``--modes`` into commands that
each fit a time limit. The PNG (ratios to ``bn``; needs matplotlib) is made at the end.

Usage::

    python benchmarks/network_step.py [--device cuda] [--models resnet50,resnext101,...]
        [--batch N] [--image-size 224] [--dtypes float32,bfloat16]
        [--layouts channels_last,nchw] [--modes eager,compile,reduce_overhead]
        [--providers bn,iabn,...]
        [--repeats 8] [--warmup 3] [--budget-gib 16] [--max-batch 1024] [--no-peak-search]
        [--cudnn-benchmark] [--threads N] [--quick] [--resume] [--profile]
        [--json benchmarks/results/network_step_<device>.json] [--png PATH]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from iabn.kernels.backends import use_backend
from iabn.memory import saved_tensor_bytes
from iabn.models import create
from iabn.tools.bench import (
    machine_info,
    pixels,
    results_folder,
    set_threads,
    time_interleaved,
    write_json,
    write_text_atomic,
)
from iabn.tools.bench.profile import format_profile, profile_call

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
#: Models and their batch in the whole-network table (224 x 224 images).
MODELS = {"resnet50": 64, "resnext101": 32, "wider_resnet38_a2": 16}
PROVIDERS = ("bn", "iabn", "iabn_triton", "original")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LAYOUTS = {"channels_last": torch.channels_last, "nchw": torch.contiguous_format}
MODES = ("eager", "compile", "reduce_overhead")
#: ``torch.compile`` keyword arguments of the compiled modes.
COMPILE_OPTIONS = {"compile": {}, "reduce_overhead": {"mode": "reduce-overhead"}}
NUM_CLASSES = 1000
#: The targets for the iabn providers against ``bn`` in the same cell.
EAGER_TIME_TARGET = 0.95
COMPILED_TIME_TARGET = 1.0
PEAK_TARGET = 0.55
BATCH_TARGET = 1.8
MEMORY_TARGET_MODELS = ("resnext101", "wider_resnet38_a2")
IABN_PROVIDERS = ("iabn", "iabn_triton")
QUICK = {"models": "resnet50", "batch": 2, "image_size": 32, "repeats": 2, "warmup": 1,
         "dtypes": "float32", "layouts": "channels_last", "modes": "eager"}
DEFAULTS = {"models": ",".join(MODELS), "batch": None, "image_size": 224, "repeats": 8,
            "warmup": 3, "dtypes": "float32,bfloat16", "layouts": "channels_last,nchw",
            "modes": None}
MIB = 2**20
GIB = 2**30


class UsageError(Exception):
    """A bad command line: one line on stderr, exit status 2."""


# --- providers -----------------------------------------------------------------------------


def original_available() -> bool:
    return importlib.util.find_spec("inplace_abn") is not None


def original_norm_act(channels: int, activation: str | None = None) -> nn.Module:
    """The original package's ``InPlaceABN`` as the models' ``norm_act`` callable
    (``make(channels, activation=None)``, see ``iabn.models.norm_act``)."""
    import inplace_abn

    return inplace_abn.InPlaceABN(channels, activation=activation or "leaky_relu",
                                  activation_param=0.01)


def build_model(provider: str, name: str) -> nn.Module:
    """Model ``name`` with ``provider``'s norm + activation layer, in training mode, on CPU."""
    norm_act: Any = {"bn": "bn", "iabn": "iabn", "iabn_triton": "iabn",
                     "original": original_norm_act}[provider]
    return create(name, norm_act=norm_act, num_classes=NUM_CLASSES).train()


def backend_of(provider: str) -> str | None:
    return "triton" if provider == "iabn_triton" else None


@dataclass
class Cell:
    model: str
    batch: int
    image_size: int
    dtype: str
    layout: str
    mode: str

    @property
    def label(self) -> str:
        return (f"{self.model} b{self.batch} {self.image_size}px {self.dtype} {self.layout} "
                f"{self.mode}")


@dataclass
class Runner:
    """One provider's model, optimiser and step for a cell."""

    model: nn.Module
    forward: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    backend: str | None
    dtype: torch.dtype
    device: torch.device

    def scope(self) -> AbstractContextManager[None]:
        """The provider's backend (for forward and backward)."""
        return use_backend(self.backend) if self.backend else nullcontext()

    def loss(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Forward and loss (under autocast for bfloat16)."""
        with ExitStack() as stack:
            if self.dtype != torch.float32:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
            return F.cross_entropy(self.forward(images), labels)

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        with self.scope():
            self.optimizer.zero_grad(set_to_none=True)
            self.loss(images, labels).backward()
            self.optimizer.step()


def make_runner(provider: str, cell: Cell, device: torch.device,
                weights: dict[str, torch.Tensor]) -> Runner:
    model = build_model(provider, cell.model)
    model.load_state_dict(weights)
    model = model.to(device=device, memory_format=LAYOUTS[cell.layout])
    forward = (torch.compile(model, **COMPILE_OPTIONS[cell.mode]) if cell.mode != "eager"
               else model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return Runner(model, forward, optimizer, backend_of(provider), DTYPES[cell.dtype], device)


def make_batch(batch: int, cell: Cell, device: torch.device,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, cell.image_size, cell.image_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    images = images.to(device).contiguous(memory_format=LAYOUTS[cell.layout])
    return images, labels.to(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def short_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    return text.splitlines()[0][:300]


# --- memory ---------------------------------------------------------------------------------


def peak_step_bytes(runner: Runner, images: torch.Tensor, labels: torch.Tensor) -> int:
    """Allocator peak of one step above what was allocated before it (CUDA)."""
    device = runner.device
    runner.optimizer.zero_grad(set_to_none=True)
    free_memory(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.step(images, labels)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def saved_bytes(runner: Runner, images: torch.Tensor, labels: torch.Tensor) -> int:
    """Exact bytes autograd keeps for backward in one forward + loss (eager only)."""
    state = [*runner.model.parameters(), *runner.model.buffers()]
    with runner.scope():
        count = saved_tensor_bytes(runner.loss, images, labels, exclude=state)
    runner.optimizer.zero_grad(set_to_none=True)
    return count


@dataclass
class SavedFit:
    """Saved bytes as ``fixed + per_image * batch`` from counts at batch 2 and 4."""

    fixed: int
    per_image: int
    at_batch: int         # the count at the cell's batch
    linear: bool | None   # whether that count equals the fit's (None: batch 2 or 4, no check)

    def largest_batch(self, budget: int) -> int:
        return max(0, (budget - self.fixed) // self.per_image)


def fit_saved_bytes(runner: Runner, cell: Cell) -> SavedFit:
    counts = {}
    for batch in sorted({2, 4, cell.batch}):
        images, labels = make_batch(batch, cell, runner.device, seed=1)
        counts[batch] = saved_bytes(runner, images, labels)
        del images, labels
    per_image = (counts[4] - counts[2]) // 2
    fixed = counts[2] - 2 * per_image
    checked = cell.batch not in (2, 4)
    return SavedFit(fixed, per_image, counts[cell.batch],
                    counts[cell.batch] == fixed + per_image * cell.batch if checked else None)


def largest_fitting(fits: Callable[[int], bool], guess: int, minimum: int = 2) -> int:
    """The largest batch >= ``minimum`` with ``fits(batch)``, 0 when ``minimum`` does not fit:
    :func:`iabn.tools.bench.pixels.largest_fitting` (gallop from ``guess``, then bisect)."""
    try:
        return pixels.largest_fitting(fits, guess, step=1, minimum=minimum)
    except ValueError:  # minimum does not fit
        return 0


def largest_batch_peak(provider: str, cell: Cell, device: torch.device,
                       weights: dict[str, torch.Tensor], budget: int, max_batch: int,
                       guess: int, log: Callable[[str], None]) -> dict[str, Any]:
    """The largest batch whose real training steps stay within ``budget`` bytes (CUDA)."""
    free_memory(device)
    outside = torch.cuda.memory_allocated(device)
    held = [make_runner(provider, cell, device, weights)]  # a list: freed before returning
    peaks: dict[int, int | None] = {}

    def fits(batch: int) -> bool:
        if batch > max_batch:
            return False
        if batch not in peaks:
            runner = held[0]
            runner.optimizer.zero_grad(set_to_none=True)
            free_memory(device)
            torch.cuda.reset_peak_memory_stats(device)
            try:
                images, labels = make_batch(batch, cell, device)
                for _ in range(2):
                    runner.step(images, labels)
                torch.cuda.synchronize(device)
                peaks[batch] = torch.cuda.max_memory_allocated(device) - outside
            except torch.cuda.OutOfMemoryError:
                peaks[batch] = None  # out of memory: does not fit
            images = labels = runner = None
            held[0].optimizer.zero_grad(set_to_none=True)
            free_memory(device)
            peak = peaks[batch]
            log(f"    search {provider} batch {batch}: "
                + ("out of memory" if peak is None else f"{peak / MIB:.0f} MiB"))
        peak = peaks[batch]
        return peak is not None and peak <= budget

    try:
        best = largest_fitting(fits, guess)
    finally:
        held.clear()
        free_memory(device)
    return {"batch": best, "capped": best == max_batch, "trials": len(peaks),
            "peak_bytes_at_batch": peaks.get(best)}


# --- one cell --------------------------------------------------------------------------------


def ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return value / base


def run_cell(cell: Cell, providers: list[str], device: torch.device, args: argparse.Namespace,
             log: Callable[[str], None]) -> dict[str, Any]:
    if cell.mode != "eager":
        torch._dynamo.reset()  # a fresh cache per cell: no recompile limit across cells
    torch.manual_seed(0)
    weights = build_model("bn", cell.model).state_dict()
    images, labels = make_batch(cell.batch, cell, device)
    results: dict[str, dict[str, Any]] = {p: {} for p in providers}
    runners: dict[str, Runner] = {}
    for provider in providers:
        what = "compile + warm-up" if cell.mode != "eager" else "warm-up"
        log(f"    {provider}: {what} ({args.warmup} steps)")
        try:
            runner = make_runner(provider, cell, device, weights)
            for _ in range(args.warmup):
                runner.step(images, labels)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runners[provider] = runner
        except Exception as error:  # reported; the other providers go on
            results[provider]["error"] = short_error(error)
            log(f"    {provider}: failed: {results[provider]['error']}")
            runner = None
            free_memory(device)
    steps = {p: (lambda r=r: r.step(images, labels)) for p, r in runners.items()}
    samples = time_interleaved(steps, args.repeats, iters=1, warmup=0,
                               device=device) if steps else {}
    for provider, runner in runners.items():
        out = results[provider]
        out["ms"] = median(samples[provider])
        out["samples_ms"] = samples[provider]
        out["peak_step_bytes"] = (peak_step_bytes(runner, images, labels)
                                  if device.type == "cuda" else None)
        if args.profile:
            out["profile"] = profile_call(lambda r=runner: r.step(images, labels), device)
            log(f"    {provider}: {format_profile(out['profile'])}")
        fit = fit_saved_bytes(runner, cell) if cell.mode == "eager" else None
        out["saved_bytes"] = fit.at_batch if fit else None
        out["saved_bytes_fixed"] = fit.fixed if fit else None
        out["saved_bytes_per_image"] = fit.per_image if fit else None
        out["saved_bytes_linear"] = fit.linear if fit else None
        out["largest_batch_saved"] = fit.largest_batch(args.budget_bytes) if fit else None
        out["largest_batch_peak"] = None
    runners.clear()
    steps.clear()
    images = labels = None
    free_memory(device)
    if device.type == "cuda" and cell.mode == "eager" and not args.no_peak_search:
        for provider in providers:
            out = results[provider]
            if "ms" not in out:
                continue
            # A guess: parameters and momentum stay, the step's own peak (activations,
            # gradients, workspaces) grows about linearly with the batch.
            per_image = max(out["peak_step_bytes"] or 1, 1) / cell.batch
            state = 2 * sum(t.numel() * t.element_size() for t in weights.values())
            guess = max(2, min(args.max_batch, int((args.budget_bytes - state) / per_image)))
            try:
                found = largest_batch_peak(provider, cell, device, weights, args.budget_bytes,
                                           args.max_batch, guess, log)
            except Exception as error:  # reported; the search is optional
                out["largest_batch_peak_error"] = short_error(error)
                log(f"    search {provider}: failed: {out['largest_batch_peak_error']}")
                free_memory(device)
                continue
            out["largest_batch_peak"] = found["batch"]
            out["largest_batch_peak_search"] = found
    base = results.get("bn", {})
    ratios = {}
    for provider, out in results.items():
        if "ms" not in out:
            continue
        ratios[provider] = {
            "step_time": ratio(out["ms"], base.get("ms")),
            "peak_step": ratio(out["peak_step_bytes"], base.get("peak_step_bytes")),
            "saved_bytes": ratio(out["saved_bytes"], base.get("saved_bytes")),
            "largest_batch_saved": ratio(out["largest_batch_saved"],
                                         base.get("largest_batch_saved")),
            "largest_batch_peak": ratio(out["largest_batch_peak"],
                                        base.get("largest_batch_peak")),
        }
    return {**cell.__dict__, "providers": results, "ratio_to_bn": ratios}


def format_provider(name: str, out: dict[str, Any], ratios: dict[str, Any]) -> str:
    if "ms" not in out:
        return f"  {name:<12} failed: {out.get('error')}"

    def rel(key: str) -> str:
        value = ratios.get(key)
        return f"({value:.2f}x)" if value is not None else ""

    parts = [f"  {name:<12} {out['ms']:9.1f} ms {rel('step_time'):>8}"]
    if out["peak_step_bytes"] is not None:
        parts.append(f"peak {out['peak_step_bytes'] / MIB:8.0f} MiB {rel('peak_step'):>8}")
    if out["saved_bytes"] is not None:
        parts.append(f"saved {out['saved_bytes'] / MIB:8.1f} MiB {rel('saved_bytes'):>8}")
    if out["largest_batch_saved"] is not None:
        parts.append(f"max batch (saved) {out['largest_batch_saved']:5d} "
                     f"{rel('largest_batch_saved'):>8}")
    if out["largest_batch_peak"] is not None:
        parts.append(f"max batch (peak) {out['largest_batch_peak']:5d} "
                     f"{rel('largest_batch_peak'):>8}")
    return "  ".join(parts)


# --- targets --------------------------------------------------------------------------------


def targets(cells: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    """The targets for every iabn provider in every cell: PASS/FAIL, never asserted."""
    cuda = device.type == "cuda"
    peak_key, batch_key = (("peak_step", "largest_batch_peak") if cuda
                           else ("saved_bytes", "largest_batch_saved"))
    found = []
    for cell in cells:
        label = Cell(*(cell[k] for k in Cell.__dataclass_fields__)).label
        for provider in IABN_PROVIDERS:
            ratios = cell["ratio_to_bn"].get(provider)
            if not ratios:
                continue
            checks = []
            if cell["mode"] == "eager":
                checks.append(("step time vs eager bn", "step_time", "<=", EAGER_TIME_TARGET))
            else:
                checks.append(("step time vs compiled bn", "step_time", "<=",
                               COMPILED_TIME_TARGET))
            if cell["model"] in MEMORY_TARGET_MODELS:
                memory = "peak memory" if cuda else "saved bytes (CPU: no allocator peak)"
                checks.append((f"{memory} vs bn", peak_key, "<=", PEAK_TARGET))
                checks.append((f"largest batch ({'peak' if cuda else 'saved bytes'} within "
                               f"budget) vs bn", batch_key, ">=", BATCH_TARGET))
            for what, key, op, limit in checks:
                value = ratios.get(key)
                if value is None:
                    continue
                passed = value <= limit if op == "<=" else value >= limit
                found.append({"cell": label, "provider": provider, "target": what,
                              "measure": key, "ratio": value, "limit": f"{op} {limit}",
                              "passed": passed})
    return found


# --- output ---------------------------------------------------------------------------------


def device_info(device: torch.device) -> dict[str, Any]:
    info = machine_info(device)
    # Other jobs on the host disturb times (CPU runs above all): the 1/5/15-minute load at start
    info["load_average"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    info["inplace_abn_version"] = None
    if original_available():
        import inplace_abn

        info["inplace_abn_version"] = getattr(inplace_abn, "__version__", "unknown")
    return info


def plot(report: dict[str, Any], path: Path) -> bool:
    """Bar charts of each provider's ratios to ``bn`` per cell (step time, memory, batch);
    False (with a note) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: plotting needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return False
    cuda = report["machine"]["device_type"] == "cuda"
    panels = [("step_time", "step time / bn", (EAGER_TIME_TARGET, COMPILED_TIME_TARGET)),
              ("peak_step" if cuda else "saved_bytes",
               "peak step memory / bn" if cuda else "saved bytes / bn (CPU: no allocator peak)",
               (PEAK_TARGET,)),
              ("largest_batch_peak" if cuda else "largest_batch_saved",
               f"largest batch in {report['settings']['budget_gib']:g} GiB / bn "
               f"({'peak' if cuda else 'saved bytes'})", (BATCH_TARGET,))]
    cells = report["cells"]
    labels = [f"{c['model']} b{c['batch']}\n{c['image_size']}px {c['dtype']}\n"
              f"{c['layout']} {c['mode']}" for c in cells]
    # bn is the black line at 1
    providers = [p for p in PROVIDERS[1:] if any(p in c["ratio_to_bn"] for c in cells)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 1.6 * len(cells) + 2), 10),
                             squeeze=False)
    width = 0.8 / max(1, len(providers))
    for ax, (key, title, lines) in zip(axes[:, 0], panels, strict=True):
        for i, provider in enumerate(providers):
            values = [c["ratio_to_bn"].get(provider, {}).get(key) for c in cells]
            xs = [j + i * width for j, v in enumerate(values) if v is not None]
            bars = ax.bar(xs, [v for v in values if v is not None], width, label=provider)
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        for line in lines:
            if line != 1.0:
                ax.axhline(line, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cells))], labels, fontsize=7)
        ax.set_xlim(-width / 2 - 0.15, len(cells) - 0.2 - width / 2 + 0.15)
        ax.set_ylabel(title, fontsize=8)
    axes[0, 0].legend(fontsize=8)
    machine = report["machine"]
    fig.suptitle(f"network_step: {machine.get('device_name')} — torch "
                 f"{machine.get('torch_version')}, triton {machine.get('triton_version')}, "
                 f"{machine.get('date_utc', '')[:10]}", fontsize=9)
    fig.tight_layout()
    partial = path.with_name(path.name + ".partial")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(partial, dpi=110, format="png")
    plt.close(fig)
    os.replace(partial, path)
    print(f"plot written to {path}")
    return True


# --- resuming --------------------------------------------------------------------------------

#: Settings a resumed file must share with this run (the cells' own keys may differ).
SHARED = ("image_size", "providers", "repeats", "warmup", "budget_gib", "max_batch",
          "peak_search", "cudnn_benchmark", "quick")


def cell_key(cell: dict[str, Any]) -> tuple:
    return tuple(cell[k] for k in Cell.__dataclass_fields__)


def resumed_cells(previous: dict[str, Any], report: dict[str, Any]) -> list[dict[str, Any]]:
    """The measured cells of ``previous`` (a report of this script from the same device and
    settings), minus those that failed; this run's settings grow to cover them."""
    if previous.get("benchmark") != "network_step":
        raise ValueError("not a network_step report")
    if previous["machine"].get("device_name") != report["machine"]["device_name"]:
        raise ValueError(f"measured on {previous['machine'].get('device_name')}, not "
                         f"{report['machine']['device_name']}")
    settings = report["settings"]
    for key in SHARED:
        if previous["settings"].get(key) != settings[key]:
            raise ValueError(f"made with {key}={previous['settings'].get(key)!r}, this run "
                             f"has {settings[key]!r}")
    kept = [c for c in previous["cells"] if "error" not in c]
    for key in ("dtypes", "layouts", "modes"):
        settings[key] = list(dict.fromkeys([*previous["settings"][key], *settings[key]]))
    settings["models"] = {**previous["settings"]["models"], **settings["models"]}
    return kept


# --- command line ---------------------------------------------------------------------------


def _csv(text: str, allowed, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UsageError(f"{what}: give at least one of {', '.join(allowed)}")
    unknown = [item for item in items if item not in allowed]
    if unknown:
        raise UsageError(f"{what}: unknown {', '.join(unknown)}; use some of "
                         f"{', '.join(allowed)}")
    return list(dict.fromkeys(items))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated, from: {', '.join(MODELS)} (default: all three)")
    parser.add_argument("--batch", type=int, default=None,
                        help="batch for every model (default: 64, 32, 16 by model)")
    parser.add_argument("--image-size", type=int, default=None, help="default 224")
    parser.add_argument("--dtypes", default=None, help="float32,bfloat16 (bf16 = autocast)")
    parser.add_argument("--layouts", default=None, help="channels_last,nchw")
    parser.add_argument("--modes", default=None,
                        help="eager,compile,reduce_overhead (default: eager,compile on CUDA, eager "
                             "on CPU)")
    parser.add_argument("--providers", default=None,
                        help=f"from {', '.join(PROVIDERS)} (default: those this device has); "
                             f"bn is always included")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps (default 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 3)")
    parser.add_argument("--budget-gib", type=float, default=16.0,
                        help="memory budget for the largest batch (default 16 GiB)")
    parser.add_argument("--max-batch", type=int, default=1024,
                        help="upper bound of the real-step batch search on CUDA")
    parser.add_argument("--no-peak-search", action="store_true",
                        help="skip the real-step batch search on CUDA (the saved-bytes one "
                             "stays)")
    parser.add_argument("--cudnn-benchmark", action="store_true",
                        help="torch.backends.cudnn.benchmark = True (default: torch's, off)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's; restored on return)")
    parser.add_argument("--quick", action="store_true",
                        help="CI smoke: resnet50, batch 2, 32x32, float32, channels-last, "
                             "eager, 2 repeats (explicit options win)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cells already in the JSON file (same device and "
                             "settings) and measure only the others: split a long run")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step per provider (kernels, device vs wall time)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None,
                        help="default: the JSON path with .png")
    args = parser.parse_args(argv)  # exits 2 itself on a malformed option
    for key, default in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else default)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device!r}: use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but CUDA is not available")
    args.device = device
    args.models = _csv(args.models, MODELS, "--models")
    args.dtypes = _csv(args.dtypes, DTYPES, "--dtypes")
    args.layouts = _csv(args.layouts, LAYOUTS, "--layouts")
    if args.modes is None:
        args.modes = "eager,compile" if device.type == "cuda" else "eager"
    args.modes = _csv(args.modes, MODES, "--modes")
    if args.providers is None:
        wanted = ["bn", "iabn", "iabn_triton", "original"]
    else:
        wanted = ["bn", *_csv(args.providers, PROVIDERS, "--providers")]
    args.notes = []
    args.providers = []
    for provider in dict.fromkeys(wanted):
        if provider == "iabn_triton" and device.type != "cuda":
            args.notes.append("iabn_triton skipped: CUDA only (on CPU Triton runs only under "
                              "its interpreter)")
        elif provider == "iabn_triton" and importlib.util.find_spec("triton") is None:
            args.notes.append("iabn_triton skipped: triton is not installed")
        elif provider == "original" and not original_available():
            args.notes.append("original skipped: the original inplace_abn package is not "
                              "installed")
        else:
            args.providers.append(provider)
    if args.batch is not None and args.batch < 2:
        raise UsageError("--batch must be >= 2 (batch norm needs more than one value per "
                         "channel)")
    if args.image_size < 32:
        raise UsageError("--image-size must be >= 32 (the models downsample 32x)")
    if args.repeats < 1 or args.warmup < 1:
        raise UsageError("--repeats and --warmup must be >= 1")
    if not args.budget_gib > 0 or not math.isfinite(args.budget_gib):
        raise UsageError("--budget-gib must be a positive number")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1")
    if args.max_batch < 2:
        raise UsageError("--max-batch must be >= 2")
    args.budget_bytes = int(args.budget_gib * GIB)
    args.json = args.json or RESULTS / f"network_step_{device.type}.json"
    args.png = args.png or args.json.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # argparse: --help (0) or a malformed option (2, its message)
        return int(exit_.code or 0)
    threads, cudnn_benchmark = torch.get_num_threads(), torch.backends.cudnn.benchmark
    set_threads(args.threads)
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = cudnn_benchmark


def run(args: argparse.Namespace) -> int:
    device = args.device

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    for note in args.notes:
        print(f"note: {note}", flush=True)
    cells = [Cell(model, args.batch or MODELS[model], args.image_size, dtype, layout, mode)
             for model in args.models for dtype in args.dtypes for layout in args.layouts
             for mode in args.modes]
    settings = {
        "models": {m: args.batch or MODELS[m] for m in args.models},
        "image_size": args.image_size, "dtypes": args.dtypes, "layouts": args.layouts,
        "modes": args.modes, "providers": args.providers, "repeats": args.repeats,
        "warmup": args.warmup, "budget_gib": args.budget_gib, "max_batch": args.max_batch,
        "peak_search": device.type == "cuda" and not args.no_peak_search,
        "cudnn_benchmark": torch.backends.cudnn.benchmark, "quick": args.quick,
        "step": "zero_grad(set_to_none) + forward + cross_entropy + backward + "
                "SGD(lr=1e-3, momentum=0.9).step(); bfloat16 = autocast",
        "memory": ("peak_step_bytes: CUDA allocator peak above the pre-step state; "
                   "saved_bytes: exact bytes saved for backward (iabn.memory), eager "
                   "cells; on CPU only saved_bytes (no allocator peak)"),
    }
    report: dict[str, Any] = {
        "benchmark": "network_step",
        "machine": device_info(device),
        "device": str(device),
        "settings": settings,
        "notes": args.notes,
        "cells": [],
        "complete": False,
    }
    if args.resume and args.json.exists():
        try:
            report["cells"] = resumed_cells(json.loads(args.json.read_text()), report)
        except (ValueError, KeyError) as error:
            print(f"error: --resume: {args.json}: {error}", file=sys.stderr)
            return 2
        done = {cell_key(c) for c in report["cells"]}
        print(f"resuming {args.json}: {len(report['cells'])} cells kept", flush=True)
        cells = [c for c in cells if cell_key(c.__dict__) not in done]
    for index, cell in enumerate(cells, 1):
        log(f"[{index}/{len(cells)}] {cell.label}")
        try:
            row = run_cell(cell, args.providers, device, args, log)
        except Exception as error:  # reported; the next cells go on (e.g. out of memory)
            row = {**cell.__dict__, "error": short_error(error), "providers": {},
                   "ratio_to_bn": {}}
            free_memory(device)
        row["date_utc"] = machine_info()["date_utc"]
        report["cells"].append(row)
        print(f"{cell.label}:" + (f" failed: {row['error']}" if "error" in row else ""),
              flush=True)
        for provider, out in row["providers"].items():
            print(format_provider(provider, out, row["ratio_to_bn"].get(provider, {})),
                  flush=True)
        write_text_atomic(args.json, json.dumps(report, indent=2) + "\n", parents=True)
    report["targets"] = targets(report["cells"], device)
    report["complete"] = True
    if report["targets"]:
        print("targets (reported, not asserted"
              + ("; CPU: times say nothing about a GPU, memory is saved bytes" if
                 device.type == "cpu" else "") + "):")
        for t in report["targets"]:
            print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['cell']}  {t['provider']}: "
                  f"{t['target']} {t['ratio']:.3f}x (target {t['limit']})", flush=True)
        passed = sum(t["passed"] for t in report["targets"])
        print(f"  {passed} of {len(report['targets'])} targets met", flush=True)
    write_json(args.json, report)
    plot(report, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
