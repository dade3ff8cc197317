"""Offloading paper Table 3 / Fig. 4 analogue, memory side, on CPU.

For each model (VGG-19, ResNet-50/101 with BN and with InPlace-ABN, MobileNetV2; batch 32 at
128x128 by default) and strategy, the activation bytes kept on the *device* at the end of
the forward pass — the part of peak training memory that the strategies change — counted
exactly with saved-tensor hooks (de-duplicated by storage, parameters and buffers excluded):

``eager``            every saved activation stays
``offload_all``      ``iabn.OffloadModel``: inputs of every conv and pooling layer go to host
``offload_half``     the same for the first half of the layers (by order in the model)
``checkpoint_k``     ``torch.utils.checkpoint`` (non-reentrant) over k segments of the body
``save_on_cpu``      ``torch.autograd.graph.save_on_cpu``: every saved tensor goes to host
                     (0 bytes kept by construction; its cost is transfer time, GPU only)
``compile_B``        ``torch.compile`` with ``activation_memory_budget=B`` (1.0 is the
                     default): the values its partitioner passes from the forward graph to
                     the backward graph (:func:`iabn.memory.compiled_saved_bytes`)

This is the memory at the end of forward. Backward adds a transient that differs by strategy
(checkpointing re-materialises one segment at a time, offloading holds the activation in use
plus ``prefetch`` more, ``save_on_cpu`` the one in use): measured as peak device memory only
in the GPU run.

On a CPU-only machine "device" and "host" are the same memory, so these are the bytes each
strategy would keep on the accelerator; the wall time of offloading on CPU says nothing about
GPU behaviour and is not reported. All timings belong to a GPU run (not yet made).

Usage::

    python benchmarks/memory_strategies.py [--batch 32] [--size 128] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import iabn
from iabn.memory import compiled_saved_bytes, saved_storages
from iabn.memory.offloading import DEFAULT_LAYERS
from iabn.models import create
from iabn.tools.bench import machine_info, results_folder, write_json

MODELS = (("vgg19", "bn"), ("resnet50", "bn"), ("resnet50", "iabn"), ("resnet101", "bn"),
          ("resnet101", "iabn"), ("mobilenet_v2", "bn"))
STRATEGIES = ("eager", "offload_all", "offload_half", "checkpoint_2", "checkpoint_4",
              "checkpoint_8", "save_on_cpu", "compile_1.0", "compile_0.5", "compile_0.1")
DEFAULT_JSON = (results_folder(Path(__file__).resolve().parent / "results")
                / "memory_strategies.json")
MIB = 2**20


def body_and_head(model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The model as a list of body modules (checkpointing splits these) and the head."""
    return model.body(), model.classifier


def run_checkpointed(blocks, head, segments: int, x: torch.Tensor,
                     segment_inputs: list[torch.Tensor]) -> torch.Tensor:
    size = -(-len(blocks) // segments)
    for start in range(0, len(blocks), size):
        part = nn.Sequential(*blocks[start:start + size])
        segment_inputs.append(x)
        x = checkpoint(part, x, use_reentrant=False)
    return head(x)


def offload_layers(model: nn.Module, strategy: str):
    """The ``layers`` argument of ``OffloadModel`` for ``offload_all`` / ``offload_half`` (the
    first half of the conv and pool layers, in the model's order)."""
    if strategy == "offload_all":
        return DEFAULT_LAYERS
    names = [n for n, m in model.named_modules() if isinstance(m, DEFAULT_LAYERS)]
    first_half = set(names[: len(names) // 2])
    return lambda name, module: name in first_half


def kept_bytes(model: nn.Module, strategy: str, x: torch.Tensor) -> int:
    if strategy == "eager":
        return sum(s.nbytes for s in saved_storages(model, x.clone()))
    if strategy == "save_on_cpu":
        # Moves every saved tensor to host memory by construction: nothing stays on the
        # device. (Not run here: on a CPU-only machine it keeps the very tensors, and a saved
        # output then forms a reference cycle that leaks the graph.)
        return 0
    if strategy.startswith("compile_"):
        budget = float(strategy.split("_")[1])
        return compiled_saved_bytes(model, x.clone(), activation_memory_budget=budget)
    if strategy.startswith("offload"):
        wrapped = iabn.OffloadModel(model, layers=offload_layers(model, strategy), min_bytes=0)
        wrapped(x.clone())
        return wrapped.stats.kept_bytes
    # Non-reentrant checkpointing keeps each segment's input itself (not through saved-tensor
    # hooks, so they are added here) and hides the segments' own saved tensors from the hooks:
    # kept = segment inputs + what the rest (the head) saves.
    segments = int(strategy.split("_")[1])
    blocks, head = body_and_head(model)
    inputs: list[torch.Tensor] = []
    head_saved = saved_storages(lambda t: run_checkpointed(blocks, head, segments, t, inputs),
                                x.clone(), exclude=[*model.parameters(), *model.buffers()])
    segment_inputs = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for t in inputs}
    return sum(segment_inputs.values()) + sum(saved.nbytes for saved in head_saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"comma-separated subset of {', '.join(STRATEGIES)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # eager is the baseline every percentage refers to
    strategies = ("eager", *(s for s in args.strategies.split(",") if s != "eager"))
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"--strategies: unknown {sorted(unknown)}; use some of {STRATEGIES}")
    rows, start = [], time.perf_counter()
    for name, layer in MODELS:
        torch.manual_seed(0)
        model = create(name, norm_act=layer)
        x = torch.randn(args.batch, 3, args.size, args.size, requires_grad=True)
        row = {"model": name, "norm_act": layer, "kept_bytes": {}}
        for strategy in strategies:
            fresh = create(name, norm_act=layer)
            fresh.load_state_dict(model.state_dict())
            row["kept_bytes"][strategy] = kept_bytes(fresh, strategy, x)
            # The offload wrapper and the model's hooks form reference cycles; collect them
            # now, or their host buffers pile up until the machine runs out of memory.
            del fresh
            gc.collect()
            print(f"[memory] {name}/{layer} {strategy}: "
                  f"{row['kept_bytes'][strategy] / MIB:.1f} MiB", file=sys.stderr, flush=True)
        rows.append(row)
    baseline = {r["model"]: r["kept_bytes"].get("eager") for r in rows if r["norm_act"] == "bn"}
    lines = [f"activation MiB kept on the device at the end of forward, batch {args.batch}, "
             f"{args.size}x{args.size}, float32 (exact; % = reduction vs the same model with BN, "
             f"eager)", "",
             f"{'model':<22}" + "".join(f"{s:>16}" for s in strategies)]
    for row in rows:
        base = baseline[row["model"]]
        cells = "".join(
            f"{row['kept_bytes'][s] / MIB:>9.1f} {100 * (1 - row['kept_bytes'][s] / base):>4.0f}%"
            + " " for s in strategies)
        lines.append(f"{row['model'] + ' ' + row['norm_act']:<22}{cells}")
    lines.append("save_on_cpu: 0 by construction (every saved tensor goes to host memory); "
                 "not run on CPU")
    print("\n".join(lines))
    report = {"benchmark": "memory_strategies", "machine": machine_info(), "args": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
        "by_construction": {"save_on_cpu": "0: every saved tensor goes to host; not run"},
        "wall_time_s": round(time.perf_counter() - start, 1)}
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
