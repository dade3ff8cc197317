"""Offloading paper Fig. 4 / Table 3 analogue: peak memory against time of a training step.

For each model (VGG-19, ResNet-50/101 with BN and with InPlace-ABN, MobileNetV2; batch 32 at
128x128) and memory strategy — eager, ``iabn.OffloadModel`` (all / first half of the conv and
pool inputs), ``torch.utils.checkpoint`` over 2/4/8 segments,
``torch.autograd.graph.save_on_cpu(pin_memory=True)``, ``torch.compile`` with
``activation_memory_budget`` 1.0 and 0.5 — one training step (forward, loss, backward) is timed
(median of ``--repeats``, CUDA events around the whole step) and its peak device memory is
taken from ``torch.cuda.max_memory_allocated`` above what was allocated before the step
(parameters, gradients and the input stay outside). Results: a table, a JSON file and a Pareto
plot (time relative to eager vs peak memory relative to eager, per model; needs matplotlib).

Without a GPU the numbers mean nothing (``--device cpu --quick`` only checks that every
strategy runs; CPU "peak memory" is not measured and left empty). Exact activation bytes on CPU
are in ``benchmarks/memory_strategies.py``.

Usage::

    python benchmarks/memory_time_pareto.py [--repeats 10] [--json PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch
from torch import nn

from iabn.memory.offloading import OffloadModel
from iabn.models import create
from iabn.tools.bench import machine_info, results_folder, write_json
from memory_strategies import MODELS, body_and_head, offload_layers, run_checkpointed

STRATEGIES = ("eager", "offload_all", "offload_half", "checkpoint_2", "checkpoint_4",
              "checkpoint_8", "save_on_cpu", "compile_1.0", "compile_0.5")
RESULTS = results_folder(Path(__file__).resolve().parent / "results")


def forward_for(model: nn.Module, strategy: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> logits`` running ``model`` with ``strategy``."""
    if strategy == "eager":
        return model
    if strategy.startswith("offload"):
        return OffloadModel(model, layers=offload_layers(model, strategy))
    if strategy.startswith("checkpoint"):
        blocks, head = body_and_head(model)
        segments = int(strategy.split("_")[1])
        return lambda x: run_checkpointed(blocks, head, segments, x, [])
    if strategy == "save_on_cpu":
        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
                return model(x)
        return forward
    budget = float(strategy.split("_")[1])
    compiled = torch.compile(model)

    def forward_compiled(x: torch.Tensor) -> torch.Tensor:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return compiled(x)
    return forward_compiled


def measure(forward: Callable, model: nn.Module, x: torch.Tensor, target: torch.Tensor,
            repeats: int, warmup: int) -> tuple[float, float | None]:
    """(median ms of a training step, peak MiB above the memory allocated before it)."""
    cuda = x.device.type == "cuda"

    def step() -> None:
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(forward(x), target).backward()

    for _ in range(warmup):
        step()
    times, peaks = [], []
    for _ in range(repeats):
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
        else:
            begin = time.perf_counter()
            step()
            times.append((time.perf_counter() - begin) * 1e3)
    return median(times), (median(peaks) if peaks else None)


def pareto_png(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: pip install matplotlib", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for row in rows:
        eager = row["results"]["eager"]
        if eager["peak_mib"] is None:
            continue
        xs = [r["ms"] / eager["ms"] for r in row["results"].values()]
        ys = [r["peak_mib"] / eager["peak_mib"] for r in row["results"].values()]
        label = f"{row['model']} {row['norm_act']}"
        ax.scatter(xs, ys, label=label, s=18)
        for name, x_pos, y_pos in zip(row["results"], xs, ys, strict=True):
            ax.annotate(name, (x_pos, y_pos), fontsize=5)
    ax.set_xlabel("step time / eager")
    ax.set_ylabel("peak memory / eager")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default=",".join(f"{m}:{n}" for m, n in MODELS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", type=Path, default=RESULTS / "memory_time_pareto.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "memory_time_pareto.png")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures GPU time and peak memory (use "
                     "--device cpu --quick only to check that the script runs)")
    strategies = ("eager", *(s for s in args.strategies.split(",") if s != "eager"))
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"--strategies: unknown {sorted(unknown)}; use some of {STRATEGIES}")
    if args.quick:
        args.batch, args.size, args.repeats, args.warmup = 2, 32, 1, 1
    device = torch.device(args.device)
    rows = []
    for spec in args.models.split(","):
        name, norm_act = spec.split(":")
        torch.manual_seed(0)
        reference = create(name, norm_act=norm_act).state_dict()
        x = torch.randn(args.batch, 3, args.size, args.size, device=device)
        target = torch.randint(0, 1000, (args.batch,), device=device)
        row = {"model": name, "norm_act": norm_act, "results": {}}
        for strategy in strategies:
            model = create(name, norm_act=norm_act)
            model.load_state_dict(reference)
            model.to(device)
            try:
                ms, peak = measure(forward_for(model, strategy), model, x, target,
                                   args.repeats, args.warmup)
            except Exception as error:  # e.g. an Inductor failure: record it, go on
                row["failed"] = {**row.get("failed", {}), strategy: repr(error)[:300]}
                print(f"[pareto] {name}/{norm_act} {strategy}: FAILED {error!r:.200}",
                      file=sys.stderr, flush=True)
            else:
                row["results"][strategy] = {"ms": ms, "peak_mib": peak}
                peak_text = f"{peak:.0f} MiB" if peak is not None else "-"
                print(f"[pareto] {name}/{norm_act} {strategy}: {ms:.1f} ms, {peak_text}",
                      file=sys.stderr, flush=True)
            del model
            gc.collect()
            torch._dynamo.reset()
        rows.append(row)
    report = {"benchmark": "memory_time_pareto", "machine": machine_info(device),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows}
    write_json(args.json, report)
    pareto_png(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
