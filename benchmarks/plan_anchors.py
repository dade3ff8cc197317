"""iabn.plan against the usual ways to trade activation memory for time, on a CPU or a GPU.

For each model (torchvision ResNet-50 and iabn's VGG-19-BN layout with ReLU, batch 4 at 64x64
by default, float32, training mode) and strategy:

``eager``             the model as given
``checkpoint_sqrt``   ``torch.utils.checkpoint.checkpoint_sequential`` (non-reentrant) over
                      round(sqrt(n)) segments of the body's n modules (torch runs the last
                      segment without checkpointing; batch norm in a checkpointed segment
                      updates its running statistics twice)
``plan_B``            ``iabn.plan(model, x, B)`` (lossless; in place where exact, recompute;
                      offload is not a candidate on CPU)
``compile_B``         ``torch.compile`` with ``activation_memory_budget=B``
``plan_compiled_at_compile_B``  ``torch.compile`` of a plan (``--compiled-plan``, on by default
                      with compile budgets): like against like with ``compile_B``, both over
                      ``compile_1``. The compiled graphs save what AOTAutograd's partitioner
                      chooses, not what the eager plan saves, so the plan is made at
                      ``compile_B``'s bytes and again at budgets scaled by the ratio of
                      those to its compiled bytes, up or down (at most 6 plans): the
                      fullest whose compiled bytes do not exceed ``compile_B``'s is timed

Activation bytes are exact (:func:`iabn.memory.saved_tensor_bytes`; for ``compile_B`` and
the compiled plans :func:`iabn.memory.compiled_saved_bytes`, which compiles with
``fullgraph=True``: a compiled plan measured there has no graph break). The timed compiled
rows use ``fullgraph=False``; ``first_step_s`` is their compilation and first step, ``graphs``
and ``graph_breaks`` what Dynamo counted while it ran. A training
step (forward, cross-entropy, backward) of every strategy of one model is timed side by side,
round-robin over the strategies: the median of ``--repeats`` and, since other jobs on a
shared machine only ever add time, the fastest (:func:`iabn.tools.bench.time_interleaved`);
the plan's predicted overhead (its cost model) is reported next to the measured one.
``--no-anchor-plans`` leaves out the eager plans made at the anchors' bytes (``plan_at_*``).
``--control`` also times ``compile_B_again``, a second model compiled exactly as
``compile_B``: what two identical compiled models differ by in the same run, the noise any
comparison with ``compile_B`` has to beat.

``--device cuda`` runs the same on a GPU (the GPU campaign's ``plan`` part: ResNet-50 b64 at
224 x 224, the plan at 1/3 of the model's activation memory, no compiled rows); offload is a
candidate there, and every row also gets ``peak_step_bytes``, the allocator's peak during one
training step above what was allocated before it (model, input, gradients of the previous step).

Usage::

    python benchmarks/plan_anchors.py [--device cpu] [--batch 4] [--size 64] [--repeats 15]
        [--json PATH] [--no-compiled-plan] [--no-anchor-plans] [--control]
        [--compile-backend inductor]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Inductor compiles in this process: its pool of compile workers exited uncleanly in the middle
# of a run on the 2-core VM (2026-11-24), and every later compilation then raised "Attempting to
# use a closed pool". Compilation is not timed here, so one thread costs no figure.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

import iabn
from iabn.memory import compiled_saved_bytes, saved_tensor_bytes
from iabn.models import create
from iabn.tools.bench import machine_info, results_folder, time_interleaved, write_json

MODELS = ("resnet50", "vgg19_bn")
PLAN_BUDGETS = (1.0, 0.75, 0.5, 0.25)
COMPILE_BUDGETS = (1.0, 0.5, 0.25)
RESULTS = results_folder(Path(__file__).resolve().parent / "results")
MIB = 2**20
PLANS_PER_ANCHOR = 6


def build(name: str) -> nn.Module:
    """The model, random weights (the same every call)."""
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(num_classes=10)
    return create("vgg19", num_classes=10, norm_act="bn", activation="relu")


def parts(name: str, model: nn.Module) -> tuple[nn.Sequential, nn.Module]:
    """The model as its body (one nn.Sequential of its modules in order) and its head."""
    if name == "resnet50":
        body = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool,
                             *model.layer1, *model.layer2, *model.layer3, *model.layer4)
        return body, nn.Sequential(model.avgpool, nn.Flatten(), model.fc)
    return model.features, model.classifier


class Trainable:
    """A forward function with the ``zero_grad()`` of the model it runs."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], model: nn.Module) -> None:
        self.fn, self.model = fn, model

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)


def saved(model: nn.Module, x: torch.Tensor) -> int:
    model = copy.deepcopy(model).train()
    return saved_tensor_bytes(model, x)


def checkpointed(name: str, model: nn.Module) -> tuple[Trainable, int, int]:
    """checkpoint_sequential over round(sqrt(n)) segments of the body; (forward, segments,
    n)."""
    body, head = parts(name, model)
    segments = max(1, round(math.sqrt(len(body))))
    return (Trainable(lambda x: head(checkpoint_sequential(body, segments, x,
                                                           use_reentrant=False)), model),
            segments, len(body))


def own_backend(name: str, budget: float = 1.0) -> Callable:
    """``torch.compile``'s backend ``name`` as a new function, partitioning under ``budget``.
    New, so that each compiled model compiles its own graphs: Dynamo reuses a graph compiled
    for another instance of the same class when the backend is the same (with
    ``backend="inductor"`` the ResNet-50 of ``compile_0.5`` and ``compile_0.25`` ran
    ``compile_1``'s graphs, 0.3 s for their first step); and here, where AOTAutograd's
    partitioner runs, the budget is what decides."""
    from torch._functorch import config as functorch_config

    backend = torch._dynamo.lookup_backend(name)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with functorch_config.patch(activation_memory_budget=budget):
            return backend(gm, example_inputs)
    return compile_graph


def compiled(model: nn.Module, budget: float, backend: str = "inductor") -> Trainable:
    from torch._functorch import config as functorch_config

    compiled_model = torch.compile(model, backend=own_backend(backend, budget))

    def forward(x: torch.Tensor) -> torch.Tensor:
        with functorch_config.patch(activation_memory_budget=budget):
            return compiled_model(x)
    return Trainable(forward, model)


def run_model(name: str, args: argparse.Namespace, say: Callable[[str], None]) -> dict:
    device = torch.device(args.device)
    model = build(name).to(device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    target = torch.arange(args.batch, device=device) % 10
    as_given = saved(model, x)
    rows: dict[str, dict] = {"eager": {"bytes": as_given}}
    forwards: dict[str, Callable] = {"eager": copy.deepcopy(model).train()}
    say(f"{name}: as given {as_given / MIB:.2f} MiB")
    ckpt_model = copy.deepcopy(model).train()
    forward, segments, modules = checkpointed(name, ckpt_model)
    rows["checkpoint_sqrt"] = {
        "bytes": saved_tensor_bytes(forward, x, exclude=[*ckpt_model.parameters(),
                                                         *ckpt_model.buffers()]),
        "segments": segments, "modules": modules}
    forwards["checkpoint_sqrt"] = forward
    for budget in args.compile_budgets:
        say(f"{name}: compile {budget:g} (slow)")
        try:
            rows[f"compile_{budget:g}"] = {"bytes": compiled_saved_bytes(
                copy.deepcopy(model).train(), x, activation_memory_budget=budget)}
            forwards[f"compile_{budget:g}"] = compiled(copy.deepcopy(model).train(), budget,
                                                       args.compile_backend)
        except Exception as error:  # no C++ compiler, an unsupported operation
            rows[f"compile_{budget:g}"] = {"failed": f"{type(error).__name__}: {error}"[:300]}
            continue
        if args.control:
            rows[f"compile_{budget:g}_again"] = {"bytes": rows[f"compile_{budget:g}"]["bytes"]}
            forwards[f"compile_{budget:g}_again"] = compiled(copy.deepcopy(model).train(),
                                                             budget, args.compile_backend)
    # the plans: at the fixed fractions, and at each anchor's bytes (the same memory)
    budgets: dict[str, int | float] = {f"plan_{b:g}": b for b in args.plan_budgets}
    if args.anchor_plans:
        budgets["plan_at_checkpoint_sqrt"] = rows["checkpoint_sqrt"]["bytes"]
        for key, row in list(rows.items()):
            if _is_anchor(key, row, as_given):
                budgets[f"plan_at_{key}"] = row["bytes"]
    for key, budget in budgets.items():
        start = time.perf_counter()
        try:
            planned, report = iabn.plan(model, x, budget, allow=args.allow,
                                        time_limit=args.time_limit)
        except ValueError as error:
            rows[key] = {"out_of_reach": str(error)}
            say(f"{name}: {key}: {error}")
            continue
        seconds = time.perf_counter() - start
        rows[key] = {
            "budget": budget,
            "bytes": saved(planned, x), "predicted_bytes": report.predicted,
            "predicted_overhead": report.overhead,
            "predicted_overhead_ms": report.predicted_overhead_ms,
            "predicted_step_ms": report.predicted_step_ms, "counts": report.counts,
            "solver": report.solver_status, "planning_s": round(seconds, 1),
            "segments": [[r.segment, r.choice] for r in report.rows if r.choice != "keep"]}
        forwards[key] = planned
        say(f"{name}: {key}: {report.measured / MIB:.2f} MiB, predicted +"
            f"{100 * report.overhead:.1f} % ({seconds:.0f} s)")
    if args.compiled_plan:
        for key, row in list(rows.items()):
            if _is_anchor(key, row, as_given):
                say(f"{name}: plan_compiled_at_{key} (slow)")
                rows[f"plan_compiled_at_{key}"], forward = compiled_plan(
                    model, x, row["bytes"], args, say)
                if forward is not None:
                    forwards[f"plan_compiled_at_{key}"] = forward
    steps = {key: _step(forward, x, target) for key, forward in forwards.items()}
    for key in steps:  # the compilation, untimed but reported
        if key.startswith(("compile_", "plan_compiled_")):
            from torch._dynamo.utils import counters

            counters.clear()
            start = time.perf_counter()
            steps[key]()
            rows[key]["first_step_s"] = round(time.perf_counter() - start, 1)
            # what this compilation made: Dynamo's graphs and its graph breaks (a graph break
            # runs the code between two graphs in Python)
            rows[key]["graphs"] = counters["stats"]["unique_graphs"]
            rows[key]["graph_breaks"] = sum(counters["graph_break"].values())
            say(f"{name}: {key}: compiled, first step {rows[key]['first_step_s']} s, "
                f"{rows[key]['graphs']} graph(s), {rows[key]['graph_breaks']} graph break(s)")
    say(f"{name}: timing {len(steps)} strategies, {args.repeats} repeats")
    times = time_interleaved(steps, repeats=args.repeats, iters=1, warmup=args.warmup,
                             device=device)
    if device.type == "cuda":
        for key, step in steps.items():
            rows[key]["peak_step_bytes"] = peak_step_bytes(step, device)
    eager_ms, eager_min = statistics.median(times["eager"]), min(times["eager"])
    for key, samples in times.items():
        ms = statistics.median(samples)
        rows[key].update(step_ms=round(ms, 2), step_ratio=round(ms / eager_ms, 3),
                         step_ms_min=round(min(samples), 2),
                         step_ratio_min=round(min(samples) / eager_min, 3),
                         step_ms_samples=[round(t, 2) for t in samples])
    for row in rows.values():
        if "bytes" in row:
            row["ratio"] = round(row["bytes"] / as_given, 4)
    return {"model": name, "as_given_bytes": as_given, "rows": rows,
            "at_the_same_bytes": same_bytes(rows)}


def peak_step_bytes(step: Callable[[], None], device: torch.device) -> int:
    """The allocator's peak during one ``step`` above what was allocated before it."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _is_anchor(key: str, row: dict, as_given: int) -> bool:
    """Whether ``key`` is a compile budget that saves less than the model as given (not its
    control twin): a plan is made at its bytes."""
    return (key.startswith("compile_") and not key.endswith("_again") and "bytes" in row
            and row["bytes"] < as_given)


def compiled_plan(model: nn.Module, x: torch.Tensor, anchor_bytes: int,
                  args: argparse.Namespace, say: Callable[[str], None]
                  ) -> tuple[dict, Trainable | None]:
    """The plan whose compiled graphs save the most bytes up to ``anchor_bytes``, and its
    compiled forward (``None`` if out of reach or if it does not compile).

    The compiled graphs save what the partitioner chooses, not what the eager plan saves: it
    may recompute a recomputed run's output where the eager plan keeps it as the next run's
    input (VGG-19-BN, 2026-11-24: a plan made at compile_0.25's bytes saved 19 % less once
    compiled, for a convolution more recomputed). So the plan is made at ``anchor_bytes``,
    then at a budget scaled by the ratio of the anchor to its compiled bytes, up or down,
    always below the eager bytes of a plan found too large (at most ``PLANS_PER_ANCHOR``
    plans); the fullest plan under the anchor is kept."""
    budget, tried, best, too_large = anchor_bytes, [], None, None
    for _ in range(PLANS_PER_ANCHOR):
        start = time.perf_counter()
        try:
            planned, report = iabn.plan(model, x, budget, allow=args.allow,
                                        time_limit=args.time_limit, compiled=True)
        except ValueError as error:
            if best is None:
                return {"out_of_reach": str(error), "tried": tried}, None
            break
        planning_s = time.perf_counter() - start
        try:
            # fullgraph=True: it raises where the plan has a graph break
            got = compiled_saved_bytes(copy.deepcopy(planned).train(), x)
        except Exception as error:
            if best is None:
                return {"failed": f"{type(error).__name__}: {error}"[:300], "tried": tried}, None
            break
        tried.append({"budget": budget, "eager_bytes": saved(planned, x), "bytes": got,
                      "counts": report.counts, "planning_s": round(planning_s, 1)})
        say(f"  plan at {budget / MIB:.2f} MiB: eager {tried[-1]['eager_bytes'] / MIB:.2f} "
            f"MiB, compiled {got / MIB:.2f} MiB")
        if got <= anchor_bytes:
            if best is None or got > best[2]["bytes"]:
                best = (planned, report, tried[-1])
            if got == anchor_bytes:
                break
            scaled = int(budget * anchor_bytes / got)
            if too_large is not None:
                scaled = min(scaled, too_large - 1)
            if scaled <= budget:
                break
        else:
            # any budget from this plan's eager bytes up gives this plan again
            too_large = tried[-1]["eager_bytes"]
            scaled = min(too_large - 1, int(budget * anchor_bytes / got))
            if best is not None and scaled <= best[2]["budget"]:
                break
        budget = scaled
    if best is None:
        return {"out_of_reach": f"compiled bytes above {anchor_bytes} after "
                                f"{PLANS_PER_ANCHOR} plans",
                "tried": tried}, None
    planned, report, chosen = best
    row = {**chosen, "predicted_bytes": report.predicted,
           "predicted_overhead": report.overhead, "solver": report.solver_status,
           "tried": [t for t in tried if t is not chosen],
           "segments": [[r.segment, r.choice] for r in report.rows if r.choice != "keep"]}
    return row, Trainable(torch.compile(planned, backend=own_backend(args.compile_backend)),
                          planned)


def same_bytes(rows: dict[str, dict]) -> list[dict]:
    """Each anchor against the plans made at its bytes: extra step time over each one's own
    baseline (the eager model for checkpointing and the eager plan, ``compile_1`` for a
    compiled budget, its control twin and the compiled plan), median and fastest of the
    repeats."""
    found = []
    for key, row in rows.items():
        plan = rows.get(f"plan_at_{key}", {})
        compiled_at = rows.get(f"plan_compiled_at_{key}", {})
        base = rows["compile_1"] if key.startswith("compile_") else rows["eager"]
        if ("step_ms" not in row or "step_ms" not in base
                or not ("step_ms" in plan or "step_ms" in compiled_at)):
            continue
        entry = {"anchor": key, "anchor_bytes": row["bytes"],
                 "anchor_baseline": "compile_1" if key.startswith("compile_") else "eager"}
        for stat, suffix in (("step_ms", ""), ("step_ms_min", "_min")):
            entry[f"anchor_overhead{suffix}"] = round(row[stat] / base[stat] - 1, 4)
        control = rows.get(f"{key}_again", {})
        if "step_ms" in control:
            for stat, suffix in (("step_ms", ""), ("step_ms_min", "_min")):
                entry[f"control_overhead{suffix}"] = round(control[stat] / base[stat] - 1, 4)
        if "step_ms" in plan:
            entry.update(plan_bytes=plan["bytes"],
                         plan_predicted_overhead=round(plan["predicted_overhead"], 4))
            for stat, suffix in (("step_ms", ""), ("step_ms_min", "_min")):
                entry[f"plan_overhead{suffix}"] = round(plan[stat] / rows["eager"][stat] - 1, 4)
            entry["plan_no_slower"] = entry["plan_overhead"] <= entry["anchor_overhead"]
        if "step_ms" in compiled_at:
            entry["compiled_plan_bytes"] = compiled_at["bytes"]
            entry["compiled_plan_eager_bytes"] = compiled_at["eager_bytes"]
            for stat, suffix in (("step_ms", ""), ("step_ms_min", "_min")):
                entry[f"compiled_plan_overhead{suffix}"] = round(
                    compiled_at[stat] / base[stat] - 1, 4)
            entry["compiled_plan_no_slower"] = (entry["compiled_plan_overhead"]
                                                <= entry["anchor_overhead"])
        found.append(entry)
    return found


def _step(forward: Callable, x: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        forward.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(forward(x), target).backward()
    return step


def table(results: list[dict]) -> str:
    lines = []
    for result in results:
        lines.append(f"{result['model']}: activation memory as given "
                     f"{result['as_given_bytes'] / MIB:.2f} MiB")
        lines.append(f"  {'strategy':<30}{'MiB':>9}{'ratio':>8}{'median ms':>11}{'x eager':>9}"
                     f"{'min ms':>9}{'x eager':>9}{'predicted':>11}")
        for key, row in result["rows"].items():
            if "bytes" not in row:
                lines.append(f"  {key:<30}  {row.get('out_of_reach') or row.get('failed')}")
                continue
            predicted = (f"{1 + row['predicted_overhead']:.3f}" if "predicted_overhead" in row
                         else "")
            step = (f"{row['step_ms']:>11.1f}{row['step_ratio']:>9.3f}"
                    f"{row['step_ms_min']:>9.1f}{row['step_ratio_min']:>9.3f}"
                    if "step_ms" in row else f"{'':>38}")
            lines.append(f"  {key:<30}{row['bytes'] / MIB:>9.2f}{row['ratio']:>8.3f}{step}"
                         f"{predicted:>11}")
        for entry in result.get("at_the_same_bytes", []):
            if "plan_overhead" in entry:
                lines.append(
                    f"  at the bytes of {entry['anchor']}: {entry['anchor']} "
                    f"{100 * entry['anchor_overhead']:+.1f} % over {entry['anchor_baseline']}, "
                    f"the plan {100 * entry['plan_overhead']:+.1f} % over eager (predicted "
                    f"{100 * entry['plan_predicted_overhead']:+.1f} %; fastest of the repeats: "
                    f"{100 * entry['anchor_overhead_min']:+.1f} % and "
                    f"{100 * entry['plan_overhead_min']:+.1f} %)")
            if "control_overhead" in entry:
                lines.append(
                    f"    control: {entry['anchor']} compiled again "
                    f"{100 * entry['control_overhead']:+.1f} % over compile_1 (fastest: "
                    f"{100 * entry['control_overhead_min']:+.1f} %)")
            if "compiled_plan_overhead" in entry:
                lines.append(
                    f"    compiled, both over compile_1: {entry['anchor']} "
                    f"{100 * entry['anchor_overhead']:+.1f} %, the compiled plan "
                    f"({entry['compiled_plan_bytes'] / MIB:.2f} MiB) "
                    f"{100 * entry['compiled_plan_overhead']:+.1f} % (fastest: "
                    f"{100 * entry['anchor_overhead_min']:+.1f} % and "
                    f"{100 * entry['compiled_plan_overhead_min']:+.1f} %)")
    return "\n".join(lines)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated subset of {', '.join(MODELS)}")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=30.0)
    parser.add_argument("--allow", type=lambda text: tuple(text.split(",")),
                        default=("inplace", "recompute", "offload"),
                        help="iabn.plan's choices (default: all; offload only on CUDA)")
    parser.add_argument("--plan-budgets", type=_floats, default=PLAN_BUDGETS)
    parser.add_argument("--compile-budgets", type=_floats, default=COMPILE_BUDGETS,
                        help="torch.compile activation_memory_budget values ('' for none)")
    parser.add_argument("--compiled-plan", action=argparse.BooleanOptionalAction, default=True,
                        help="also compile the plan at each compile budget's bytes")
    parser.add_argument("--anchor-plans", action=argparse.BooleanOptionalAction, default=True,
                        help="also plan (eager) at the bytes of checkpoint_sqrt and each "
                             "compile budget")
    parser.add_argument("--control", action="store_true",
                        help="also time each compile budget compiled a second time "
                             "(compile_B_again): the noise between identical models")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the timed compiled rows (aot_eager: "
                             "no code generation, for a quick check of the script)")
    parser.add_argument("--json", type=Path, default=None,
                        help="default benchmarks/results/plan_anchors_<device type>.json")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: {args.device!r} is not a device; use cpu or cuda")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: {args.device!r}; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device; use --device cpu")
    args.json = args.json or RESULTS / f"plan_anchors_{device.type}.json"
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"--models: unknown {sorted(unknown)}; use some of {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - start:7.1f} s] {text}", file=sys.stderr, flush=True)

    results = [run_model(name, args, say) for name in args.models]
    print(table(results))
    report = {"benchmark": "plan_anchors", "machine": machine_info(device),
              "command": " ".join(["python", "benchmarks/plan_anchors.py",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "results": results, "wall_time_s": round(time.perf_counter() - start, 1)}
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
