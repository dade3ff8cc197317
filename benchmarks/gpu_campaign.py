"""The GPU checks and measurements still outstanding, as one resumable command (the campaign).

On an H100/H200 it runs its parts ordered by value (``ORDER``), each as a subprocess of its own
(a crash or a failure of one part is recorded with its exit status and the tail of its log, and
the campaign goes on with the next). A fresh campaign's first call gives the verdict, within
``FIRST_CALL_BUDGET_S`` (480 s) by the caps of its four parts (``CAP_S``: each part is stopped
at its own cap, SIGINT first so that pytest reports what it saw):

1. ``gpu_tests``: the ``gpu``-marked tests on CUDA (the Triton kernels compiled for the device
   among them), ``-n 8 --maxfail=20``, capped at 140 s, through ``benchmarks/suite_log.py``
   (``gpu_tests_cuda.log``);
2. ``layer``: one layer, 32 x 256 x 56 x 56 channels-last, float32 and bfloat16, forward +
   backward of BN + LeakyReLU (cuDNN), iabn reference and iabn Triton, profiled
   (``benchmarks/gpu_speed.py --profile``, ``layer_cuda.json``);
3. ``net_eager_r50_bf16_cl``, ``net_eager_r50_fp32_cl``: the headline, ResNet-50 b64 at 224,
   channels-last, eager, providers bn, iabn and iabn_triton, 20 interleaved steps, allocator
   peak and a profiled step (``benchmarks/network_step.py --profile``,
   ``network_step_cuda.json``);

then, as later calls find time: the same compiled (bf16, then fp32), ResNeXt-101 and
WideResNet-38-A2 eager, the largest batch in a 12 GiB cap (``batch_*``: real steps, its own
``network_batch_cuda.json``), reduce-overhead, the whole suite with the slow tests (``suite``),
offloading VGG-19 (BN) b32 at 128 x 128 (``offload_pcie``: pinned copy bandwidth and the bytes
``OffloadModel`` transfers; ``offload_pareto``: eager, ``OffloadModel``, ``save_on_cpu`` and
``torch.compile`` with ``activation_memory_budget=0.5``), ``plan`` (``iabn.plan`` at 1/3 of
ResNet-50's activation bytes against the model as given and ``checkpoint_sequential``),
``transformers`` (timm's ViT-S/16 and ConvNeXt-T at batch 64, as given against
``iabn.convert``'s output-only layer norms and in-place GELUs and against the norms alone,
eager and compiled, bf16 and fp32: ``transformer_step_cuda.json``), ``slope_errors``, the
other network cells, ``host_overhead`` and the full ``gpu_speed`` tables.
The summary ``gpu_campaign_summary.md`` (the targets met / missed / unmeasured, read from the
parts' files only: a figure no part measured on a GPU is "unmeasured", never estimated; the
layer's and the networks' rows with their profiles) is rewritten after every part.

Everything goes to ``--out`` (default ``benchmarks/results/`` with ``IABN_COMMIT_RESULTS=1``,
else ``runs/benchmarks/campaign``): the parts' files, ``gpu_campaign_state.json`` (each part's
status, exit status, seconds, attempts, command and log tail, and each call's machine: device,
driver, torch, Triton, torchvision and timm versions, git commit and UTC date) and
``gpu_campaign_logs/<part>.log``. Every JSON file a part writes gets a ``campaign`` block with
the same machine record, and the suite log a header of it. ``--bundle PATH`` packs all of that
into one ``.tar.gz`` (members relative to ``--out``; rewritten atomically after every part), for
a device machine that returns only 8 files.

Resuming and time: ``--resume`` continues the campaign in ``--out`` (or starts it): parts
already done or failed are skipped. ``--parts`` selects parts by name, group (tests, suite,
slopes, host, gpu_speed, network, batch, offload, plan, transformers) or shell pattern
(``'net_eager_*'``); ``--rerun`` runs selected parts again even when done or failed (a
network part keeps a cell the JSON already holds without an error: network_step's own
``--resume``). With ``--budget-s`` the
campaign starts a part only when its expected time fits what is left (less ``--reserve-s`` for
the summary and the bundle), except the first part of a call, which always starts. A part still
running when the budget ends is stopped (its process group killed): started after other parts,
it is "interrupted" and runs first in the next call; started first, it had the whole budget and
is "failed" (run it alone with a larger ``--budget-s``). Expected times are the measured
durations of finished parts of the same kind (x1.25), else planning allowances
(``Part.expect_s``, or ``--expect-s PATTERN=SECONDS``; for the budget only, never reported as
measurements). The last thing printed is a short table of the parts and targets, what is left
and the command to continue. Exit status: 0 all selected parts done, 1 all ran but some failed,
3 stopped by the budget with parts left, 2 a usage error (one line on stderr, nothing written).

On the device machine (its ``python3`` has torch; the tree arrives without ``.git``, so paste
this checkout's ``git rev-parse HEAD`` after ``--commit``), as the device tool's command, with
``timeout_s`` 600::

    IABN_COMMIT_RESULTS=1 python3 benchmarks/gpu_campaign.py --resume --budget-s 540 \\
        --commit <HASH> --bundle $OUT/campaign.tar.gz

(the first call ends after the verdict in about 245 s on an H100, measured 2026-11-27, and
starts the next part only if its allowance fits what is left)

then here, from the repository root, unpack what came back into ``benchmarks/results/`` (the
state file travels with the next call's working tree, so the same command continues)::

    tar -xzf <files_at>/campaign.tar.gz -C benchmarks/results

and repeat until nothing is left; commit ``benchmarks/results/``. A campaign is tied to one
device name: on another kind of GPU use another ``--out`` (e.g. ``benchmarks/results/h200``;
unpack into that folder). ``--list`` prints the parts and their commands.

``--smoke`` rehearses the same orchestration on a CPU with each part's quickest settings (tiny
shapes, ``--quick``, ``tests/core/test_errors.py`` instead of the suite; every network part runs one
quick eager cell, measured by the first and resumed by the others, and nothing is compiled:
Inductor takes minutes on a CPU) into ``runs/benchmarks/campaign_smoke``; it never writes
under ``benchmarks/results/``. For tests, ``--part-command-override 'PATTERN=COMMAND'``
replaces the command of the parts matching PATTERN (``{python}``, ``{out}``, ``{root}`` are
filled in).

Usage::

    python benchmarks/gpu_campaign.py [--resume | --restart] [--parts P,...] [--rerun]
        [--budget-s S] [--reserve-s 20] [--expect-s PATTERN=S] [--commit HASH] [--out DIR]
        [--bundle PATH.tar.gz] [--smoke] [--list] [--part-command-override PATTERN=COMMAND]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import importlib.metadata
import io
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STATE = "gpu_campaign_state.json"
SUMMARY = "gpu_campaign_summary.md"
LOGS = "gpu_campaign_logs"
COMMITTED = ROOT / "benchmarks" / "results"
GROUPS = ("tests", "suite", "slopes", "host", "gpu_speed", "network", "batch", "offload", "plan",
          "transformers")
#: The whole-network table: model -> (short name, batch, layouts).
NETWORK = {"resnet50": ("r50", 64, ("channels_last", "nchw")),
           "resnext101": ("rx101", 32, ("channels_last",)),
           "wider_resnet38_a2": ("wrn38", 16, ("channels_last",))}
NETWORK_MODES = {"eager": "eager", "compile": "compile", "reduce_overhead": "ro"}
NETWORK_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
NETWORK_LAYOUTS = {"channels_last": "cl", "nchw": "nchw"}
NETWORK_IMAGE = 224
NETWORK_BUDGET_GIB = 12
#: Planning allowances (seconds) per part kind, for --budget-s only: not measurements.
ALLOWANCE = {"suite": 420, "slope_errors": 240, "host_overhead": 90, "gpu_speed": 300,
             "gpu_speed_plot": 30, "gpu_speed_compile": 360, "eager": 240, "compile": 360,
             "reduce_overhead": 420, "offload_pcie": 90, "offload_pareto": 300, "plan": 300,
             "batch": 300, "transformers": 420}
SMOKE_ALLOWANCE = 30
#: The parts by value: a fresh campaign's first call runs the verdict (correctness on CUDA,
#: one layer, the headline ResNet-50 step); later calls go on down this list (a part takes the
#: place of the first pattern its name matches).
ORDER = ("gpu_tests", "layer", "net_eager_r50_bf16_cl", "net_eager_r50_fp32_cl",
         "net_compile_r50_bf16_cl", "net_compile_r50_fp32_cl", "net_eager_rx101_*",
         "net_eager_wrn38_*", "batch_*", "net_ro_r50_*_cl", "suite", "offload_*", "plan",
         "transformers",
         "slope_errors", "net_ro_*", "net_compile_*", "host_overhead", "gpu_speed*", "net_*")
VERDICT = ("gpu_tests", "layer", "net_eager_r50_bf16_cl", "net_eager_r50_fp32_cl")
#: The first call must deliver the verdict within this, by the verdict parts' caps: each is
#: stopped at its own cap (SIGINT, then SIGTERM, then SIGKILL within CAP_GRACE_S), so the sum
#: below is a bound, not a guess.
FIRST_CALL_BUDGET_S = 480
CAP_S = {"gpu_tests": 140, "layer": 60, "net_eager_r50_bf16_cl": 100,
         "net_eager_r50_fp32_cl": 100}
CAP_GRACE_S = 10
#: The machine record before the first part: a child process imports torch and initialises
#: CUDA (the budget's clock starts before it).
PROBE_ALLOWANCE_S = 20
RESERVE_S = 20
#: The verdict's test selection: every test that runs real CUDA code (the ``gpu`` marker: the
#: Triton backend's parity and gradient cases compiled for the device among them), failing
#: fast; ``-vv`` (one level above suite_log's ``-q``) names each result as it comes, so a
#: capped run still says which failed.
GPU_TESTS_ARGS = ("-m", "gpu", "-n", "8", "--maxfail=20", "-vv", "-p", "no:cacheprovider")
#: The one layer of the verdict: forward + backward, channels-last, both dtypes.
LAYER_SHAPE = "32x256x56x56"
#: Timed steps of a network cell: warm-up, then interleaved repeats (the median).
NETWORK_REPEATS, NETWORK_WARMUP = 20, 3
#: The largest-batch search (real steps in a 12 GiB cap): its own file, few timed steps.
BATCH_MODELS = ("resnext101", "wider_resnet38_a2")
BATCH_MAX = 512
LEARNED_MARGIN = 1.25
#: Offloading setting (the offloading paper's Table 3, as memory_time_pareto.py).
OFFLOAD_MODEL, OFFLOAD_BATCH, OFFLOAD_SIZE = "vgg19:bn", 32, 128
OFFLOAD_STRATEGIES = ("eager", "offload_all", "save_on_cpu", "compile_0.5")
SMOKE_OFFLOAD_STRATEGIES = ("eager", "offload_all", "save_on_cpu")
#: Planning: iabn.plan's ResNet-50 at a third of its activation bytes (MONeT's setting: 9-16 %
#: more compute), its step against the model as given; the limit is the target's.
PLAN_MODEL, PLAN_BUDGET, PLAN_STEP_LIMIT = "resnet50", 0.3333, 1.10
TAIL_CHARS = 3000


class UsageError(Exception):
    """A bad command line: one line on stderr, exit status 2, nothing written."""


# --- the plan ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    group: str
    kind: str                 # parts of one kind take about as long (expected times)
    argv: tuple[str, ...]     # a script under the repository and its arguments ({out} filled)
    outputs: tuple[str, ...]  # files it writes in the output folder
    expect_s: float           # planning allowance for --budget-s (not a measurement)
    env: tuple[tuple[str, str], ...] = ()
    note: str = ""
    cap_s: float | None = None  # the part's own time limit (stopped there, recorded failed)


def files(smoke: bool) -> dict[str, str]:
    """The parts' result files, by role (names in the output folder)."""
    tag = "cpu" if smoke else "cuda"
    return {"gpu_tests": f"gpu_tests_{tag}.log", "layer": f"layer_{tag}.json",
            "layer_csv": f"layer_{tag}.csv", "batch": f"network_batch_{tag}.json",
            "batch_png": f"network_batch_{tag}.png", "suite": f"suite_{tag}.log",
            "slopes": f"slope_errors_{tag}.json",
            "host": f"host_overhead_{tag}.json", "speed": "gpu_speed.json",
            "speed_csv": "gpu_speed.csv", "speed_png": "gpu_speed.png",
            "speed_compile": "gpu_speed_compile.json",
            "speed_compile_csv": "gpu_speed_compile.csv",
            "network": f"network_step_{tag}.json", "network_png": f"network_step_{tag}.png",
            "pcie": f"offload_pcie_{tag}.json",
            "pareto": f"memory_time_pareto_vgg19_{tag}.json",
            "pareto_png": f"memory_time_pareto_vgg19_{tag}.png",
            "plan": f"plan_anchors_{tag}.json",
            "transformers": f"transformer_step_{tag}.json"}


def network_cells() -> list[tuple[str, str, str, str]]:
    """(mode, model, dtype, layout) of every network part, in the campaign's order: every
    eager cell first (they give the memory and batch figures too), then compile, then
    reduce-overhead."""
    return [(mode, model, dtype, layout) for mode in NETWORK_MODES for model in NETWORK
            for dtype in NETWORK_DTYPES for layout in NETWORK[model][2]]


def network_part_name(mode: str, model: str, dtype: str, layout: str) -> str:
    return (f"net_{NETWORK_MODES[mode]}_{NETWORK[model][0]}_{NETWORK_DTYPES[dtype]}_"
            f"{NETWORK_LAYOUTS[layout]}")


def plan(smoke: bool) -> list[Part]:
    """Every part, in the order of value (``ORDER``); ``smoke``: the same parts, in the same
    order, with their quickest CPU settings."""
    f = {role: "{out}/" + name for role, name in files(smoke).items()}
    names = files(smoke)

    def part(name, group, argv, outputs, kind=None, env=(), note="", allowance=None):
        kind = kind or name
        cap = None if smoke else CAP_S.get(name)
        if smoke:
            expect = SMOKE_ALLOWANCE
        elif cap is not None:
            expect = cap + CAP_GRACE_S
        else:
            expect = allowance or ALLOWANCE[kind]
        return Part(name, group, kind, tuple(argv), tuple(names[o] for o in outputs),
                    expect, tuple(env), note, cap)

    device = "cpu" if smoke else "cuda"
    if smoke:
        tests = ["-p", "no:cacheprovider", "tests/core/test_errors.py"]
        layer = ["--quick", "--shapes", "2x8x6x6", "--repeats", "2"]
        cell = ["--quick", "--threads", "1", "--batch", "2", "--image-size", "32",
                "--repeats", "2", "--warmup", "1"]
        batch = cell
    else:
        tests = list(GPU_TESTS_ARGS)
        layer = ["--shapes", LAYER_SHAPE, "--repeats", "30"]
        cell = ["--image-size", str(NETWORK_IMAGE), "--repeats", str(NETWORK_REPEATS),
                "--warmup", str(NETWORK_WARMUP), "--budget-gib", str(NETWORK_BUDGET_GIB),
                "--no-peak-search"]
        batch = ["--image-size", str(NETWORK_IMAGE), "--repeats", "2", "--warmup", "1",
                 "--budget-gib", str(NETWORK_BUDGET_GIB), "--max-batch", str(BATCH_MAX)]
    smoke_note = {"note": "smoke: tiny shapes"} if smoke else {}
    parts = [
        part("gpu_tests", "tests", ["benchmarks/suite_log.py", "--log", f["gpu_tests"], "--",
                                    *tests], ["gpu_tests"],
             note="smoke: tests/core/test_errors.py only" if smoke
             else "the gpu-marked tests, the Triton kernels compiled for the device among them"),
        part("layer", "gpu_speed",
             ["benchmarks/gpu_speed.py", "--device", device, *layer, "--dtypes",
              "float32,bfloat16", "--layouts", "channels_last", "--providers",
              "eager,reference,triton", "--profile", "--json", f["layer"], "--csv",
              f["layer_csv"]], ["layer", "layer_csv"],
             env=[("TRITON_INTERPRET", "1")] if smoke else (), **smoke_note),
    ]
    for mode, model, dtype, layout in network_cells():
        size = ["--batch", str(NETWORK[model][1])] if not smoke else []
        modes = "eager" if smoke else mode  # smoke: nothing compiled (Inductor takes minutes)
        parts.append(part(
            network_part_name(mode, model, dtype, layout), "network",
            ["benchmarks/network_step.py", "--device", device, "--models",
             "resnet50" if smoke else model, *size, *cell, "--dtypes", dtype, "--layouts",
             layout, "--modes", modes, "--providers", "bn,iabn,iabn_triton", "--profile",
             "--resume", "--json", f["network"], "--png", f["network_png"]],
            ["network", "network_png"], kind=f"net_{mode}_{model}", allowance=ALLOWANCE[mode],
            note="smoke: ResNet-50 b2 at 32x32, eager" if smoke else ""))
    for model in BATCH_MODELS:
        for dtype in NETWORK_DTYPES:
            size = ["--batch", str(NETWORK[model][1])] if not smoke else []
            parts.append(part(
                f"batch_{NETWORK[model][0]}_{NETWORK_DTYPES[dtype]}_cl", "batch",
                ["benchmarks/network_step.py", "--device", device, "--models",
                 "resnet50" if smoke else model, *size, *batch, "--dtypes", dtype,
                 "--layouts", "channels_last", "--modes", "eager", "--providers",
                 "bn,iabn,iabn_triton", "--resume", "--json", f["batch"], "--png",
                 f["batch_png"]], ["batch", "batch_png"], kind="batch",
                note="smoke: ResNet-50 b2 at 32x32, no search (CUDA only)" if smoke
                else f"largest batch in {NETWORK_BUDGET_GIB} GiB, real steps"))
    suite = (["-p", "no:cacheprovider", "tests/core/test_errors.py"] if smoke
             else ["-n", "8", "-m", "slow or not slow"])
    parts.append(part("suite", "suite", ["benchmarks/suite_log.py", "--log", f["suite"], "--",
                                         *suite], ["suite"],
                      note="smoke: tests/core/test_errors.py only" if smoke else ""))
    if smoke:
        parts += [
            part("slope_errors", "slopes", ["benchmarks/slope_errors.py", "--device", "cpu",
                                            "--shapes", "2x3x8x8", "--dtypes", "float32",
                                            "--layouts", "nchw", "--json", f["slopes"]],
                 ["slopes"]),
            part("host_overhead", "host", ["benchmarks/host_overhead.py", "--device", "cpu",
                                           "--quick", "--json", f["host"]], ["host"]),
            part("gpu_speed", "gpu_speed",
                 ["benchmarks/gpu_speed.py", "--device", "cpu", "--quick", "--repeats", "1",
                  "--dtypes", "float32", "--layouts", "nchw", "--providers",
                  "eager,reference,triton", "--json", f["speed"], "--csv", f["speed_csv"]],
                 ["speed", "speed_csv"], env=[("TRITON_INTERPRET", "1")]),
            part("gpu_speed_plot", "gpu_speed",
                 ["benchmarks/plot_gpu_speed.py", f["speed"], "--out", f["speed_png"]],
                 ["speed_png"]),
            part("gpu_speed_compile", "gpu_speed",
                 ["benchmarks/gpu_speed.py", "--device", "cpu", "--quick", "--repeats", "1",
                  "--dtypes", "float32", "--layouts", "nchw", "--providers", "eager",
                  "--json", f["speed_compile"], "--csv", f["speed_compile_csv"]],
                 ["speed_compile", "speed_compile_csv"],
                 note="smoke: eager only (Inductor takes minutes on a CPU)"),
            part("offload_pcie", "offload", ["benchmarks/offload_pcie.py", "--device", "cpu",
                                             "--quick", "--model", OFFLOAD_MODEL, "--json",
                                             f["pcie"]], ["pcie"]),
            part("offload_pareto", "offload",
                 ["benchmarks/memory_time_pareto.py", "--device", "cpu", "--quick", "--models",
                  OFFLOAD_MODEL, "--strategies", ",".join(SMOKE_OFFLOAD_STRATEGIES), "--json",
                  f["pareto"], "--png", f["pareto_png"]], ["pareto", "pareto_png"],
                 note="smoke: without compile_0.5 (Inductor takes minutes on a CPU)"),
            part("plan", "plan",
                 ["benchmarks/plan_anchors.py", "--device", "cpu", "--models", PLAN_MODEL,
                  "--batch", "2", "--size", "32", "--repeats", "1", "--warmup", "0",
                  "--plan-budgets", str(PLAN_BUDGET), "--compile-budgets=",
                  "--no-anchor-plans", "--json", f["plan"]], ["plan"],
                 note="smoke: batch 2 at 32x32, no plan at checkpointing's bytes"),
            part("transformers", "transformers",
                 ["benchmarks/transformer_step.py", "--device", "cpu", "--quick", "--models",
                  "vit_small", "--json", f["transformers"]], ["transformers"],
                 note="smoke: ViT-S at 32x32, depth 2, eager"),
        ]
        return by_value(parts)
    parts += [
        part("slope_errors", "slopes", ["benchmarks/slope_errors.py", "--device", "cuda",
                                        "--json", f["slopes"]], ["slopes"]),
        part("host_overhead", "host", ["benchmarks/host_overhead.py", "--device", "cuda",
                                       "--json", f["host"]], ["host"]),
        part("gpu_speed", "gpu_speed",
             ["benchmarks/gpu_speed.py", "--device", "cuda", "--providers",
              "eager,reference,triton", "--json", f["speed"], "--csv", f["speed_csv"]],
             ["speed", "speed_csv"]),
        part("gpu_speed_plot", "gpu_speed",
             ["benchmarks/plot_gpu_speed.py", f["speed"], "--out", f["speed_png"]],
             ["speed_png"]),
        part("gpu_speed_compile", "gpu_speed",
             ["benchmarks/gpu_speed.py", "--device", "cuda", "--providers", "eager,compile",
              "--json", f["speed_compile"], "--csv", f["speed_compile_csv"]],
             ["speed_compile", "speed_compile_csv"]),
        part("offload_pcie", "offload",
             ["benchmarks/offload_pcie.py", "--device", "cuda", "--model", OFFLOAD_MODEL,
              "--batch", str(OFFLOAD_BATCH), "--size", str(OFFLOAD_SIZE), "--json", f["pcie"]],
             ["pcie"]),
        part("offload_pareto", "offload",
             ["benchmarks/memory_time_pareto.py", "--device", "cuda", "--models", OFFLOAD_MODEL,
              "--batch", str(OFFLOAD_BATCH), "--size", str(OFFLOAD_SIZE), "--strategies",
              ",".join(OFFLOAD_STRATEGIES), "--json", f["pareto"], "--png", f["pareto_png"]],
             ["pareto", "pareto_png"]),
        # no compiled rows: compiling ResNet-50 and its plans takes minutes per graph
        part("plan", "plan",
             ["benchmarks/plan_anchors.py", "--device", "cuda", "--models", PLAN_MODEL,
              "--batch", str(NETWORK[PLAN_MODEL][1]), "--size", str(NETWORK_IMAGE),
              "--plan-budgets", str(PLAN_BUDGET), "--compile-budgets=", "--json", f["plan"]],
             ["plan"]),
        # ViT-S/16 and ConvNeXt-T converted (output-only layer norms, in-place GELU) against
        # the models as given, eager and compiled, both dtypes
        part("transformers", "transformers",
             ["benchmarks/transformer_step.py", "--device", "cuda", "--models",
              "vit_small,convnext_tiny", "--batch", "64", "--modes", "eager,compile",
              "--dtypes", "bfloat16,float32", "--repeats", "15", "--json",
              f["transformers"]], ["transformers"]),
    ]
    return by_value(parts)


def by_value(parts: list[Part]) -> list[Part]:
    """``parts`` in the order of ``ORDER`` (stable within one pattern)."""

    def rank(part: Part) -> int:
        return next(i for i, pattern in enumerate(ORDER)
                    if fnmatch.fnmatchcase(part.name, pattern))

    return sorted(parts, key=rank)


def first_call_seconds(parts: list[Part]) -> float:
    """The longest a fresh campaign's first call can take to deliver the verdict: the machine
    record, every verdict part to its cap (and the grace of stopping it), the reserve."""
    return PROBE_ALLOWANCE_S + sum(p.expect_s for p in parts if p.name in VERDICT) + RESERVE_S


def select(parts: list[Part], tokens: list[str] | None) -> list[Part]:
    """The parts named, grouped or matched by ``tokens`` (all when None), in plan order."""
    if not tokens:
        return parts
    chosen = set()
    for token in tokens:
        hits = {p.name for p in parts
                if token in (p.name, p.group) or fnmatch.fnmatchcase(p.name, token)}
        if not hits:
            raise UsageError(f"--parts: {token!r} names no part; use part names, groups "
                             f"({', '.join(GROUPS)}) or patterns like 'net_eager_*' (--list "
                             f"shows them)")
        chosen |= hits
    return [p for p in parts if p.name in chosen]


def apply_overrides(parts: list[Part], overrides: list[tuple[str, str]]) -> list[Part]:
    """Parts whose command an override replaces (the last matching override wins)."""
    out = []
    for part in parts:
        argv = part.argv
        for pattern, command in overrides:
            if fnmatch.fnmatchcase(part.name, pattern):
                argv = ("--override--", *shlex.split(command))
        out.append(dataclasses.replace(part, argv=argv))
    return out


def command_for(part: Part, out: Path) -> list[str]:
    fill = {"python": sys.executable, "out": str(out), "root": str(ROOT)}
    if part.argv[:1] == ("--override--",):
        return [arg.format(**fill) for arg in part.argv[1:]]
    return [sys.executable, *(arg.format(**fill) for arg in part.argv)]


# --- the machine ------------------------------------------------------------------------------


def _output(command: list[str], timeout: float = 60) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


_PROBE = """
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({"cuda_available": cuda, "torch_version": torch.__version__,
                  "torch_cuda": torch.version.cuda,
                  "device_name": torch.cuda.get_device_name(0) if cuda else None,
                  "device_count": torch.cuda.device_count() if cuda else 0}))
"""


def machine(smoke: bool, commit: str | None) -> dict[str, Any]:
    """Device, driver, versions, commit and UTC date of this call. The GPU run asks torch in a
    child process (this one keeps no CUDA context on the device the parts measure)."""
    info: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **{f"{name}_version": _version(name) for name in ("torch", "triton", "torchvision",
                                                          "timm")},
    }
    git = _output(["git", "-C", str(ROOT), "rev-parse", "HEAD"]) if (ROOT / ".git").exists() \
        else None
    if git and commit and not git.startswith(commit):
        # the device machine's copy of the tree can carry a stale .git (seen on an H100: the
        # session's first commit, with the working tree of a later one): the hash given wins
        info.update(commit=commit, commit_source="--commit", git_head=git)
    elif git:
        dirty = _output(["git", "-C", str(ROOT), "status", "--porcelain"])
        info.update(commit=git, commit_source="git", commit_dirty=bool(dirty))
    else:
        info.update(commit=commit or "unknown",
                    commit_source="--commit (no .git here)" if commit else "unknown")
    if smoke:
        info.update(device_name="cpu (smoke run: not a GPU)", driver_version=None,
                    cuda_available=None)
        return info
    probe = _output([sys.executable, "-c", _PROBE], timeout=300)
    info.update(json.loads(probe.splitlines()[-1]) if probe
                else {"cuda_available": False, "device_name": None})
    driver = _output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["driver_version"] = driver.splitlines()[0].strip() if driver else None
    return info


# --- files ------------------------------------------------------------------------------------


_UMASK = os.umask(0)
os.umask(_UMASK)


def write_atomic(path: Path, data: bytes) -> None:
    """Write through a temporary file in the same folder and a rename; on failure the
    temporary file is removed and the old file, if any, stays. (The campaign imports nothing
    of iabn, so that it records a part broken by an import error instead of dying with it:
    hence this twin of ``iabn.tools.outputs.write_atomic``.)"""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
        os.chmod(temp, 0o666 & ~_UMASK)  # mkstemp makes it private; a result file is not
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_json(path: Path, value: Any) -> None:
    write_atomic(path, (json.dumps(value, indent=2) + "\n").encode())


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tail(path: Path, chars: int = TAIL_CHARS) -> str:
    try:
        with path.open("rb") as stream:
            stream.seek(0, os.SEEK_END)
            stream.seek(max(0, stream.tell() - chars))
            return stream.read().decode(errors="replace")
    except OSError:
        return ""


def stamp(path: Path, part: Part, entry: dict[str, Any], record: dict[str, Any],
          previous: Any) -> None:
    """Mark a part's result file with the machine record of this call: a ``campaign`` block
    in a JSON file (``machine``: this call's; ``parts``: each part that wrote the file, with
    its commit, device and dates, kept across the resumed runs that rewrite the file), header
    lines above a log."""
    entry = {**entry, "commit": record.get("commit"), "device_name": record.get("device_name")}
    if path.suffix == ".json":
        report = read_json(path)
        if not isinstance(report, dict):
            return
        parts = previous.get("parts", {}) if isinstance(previous, dict) else {}
        report["campaign"] = {"machine": record, "parts": {**parts, part.name: entry}}
        write_json(path, report)
    elif path.suffix == ".log":
        header = {"part": part.name, **entry, **record}
        lines = "".join(f"# gpu_campaign {key}: {value}\n" for key, value in header.items())
        write_atomic(path, lines.encode() + path.read_bytes())


def bundle(out: Path, target: Path, names: Iterable[str]) -> list[str]:
    """Pack ``names`` (relative to ``out``; the existing ones) into ``target`` (.tar.gz),
    atomically; returns the members."""
    members = []
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in dict.fromkeys(names):
            path = out / name
            if path.is_file() and path.resolve() != target.resolve():
                tar.add(path, arcname=name)
                members.append(name)
    write_atomic(target, buffer.getvalue())
    return members


def campaign_files(out: Path, state: dict[str, Any], parts: list[Part]) -> list[str]:
    """The files of this campaign in ``out``: state, summary, logs and the parts' results."""
    names = [STATE, SUMMARY]
    names += sorted(f"{LOGS}/{p.name}" for p in (out / LOGS).glob("*.log")) \
        if (out / LOGS).is_dir() else []
    names += [name for part in parts for name in part.outputs]
    return [n for n in dict.fromkeys(names) if (out / n).is_file()]


# --- running a part ---------------------------------------------------------------------------


def part_environment(part: Part) -> dict[str, str]:
    env = dict(os.environ)
    # every part is told where to write; the campaign measures iabn's default backend and
    # names Triton explicitly where it is measured
    env.pop("IABN_COMMIT_RESULTS", None)
    env.pop("IABN_BACKEND", None)
    source = str(ROOT / "src")  # the device machine has the tree, not an installed package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(dict(part.env))
    return env


def _kill_group(process: subprocess.Popen) -> None:
    """Stop the part and every process it started (its own process group): SIGINT first, so
    that pytest reports the failures it has seen and a script ends as after Ctrl-C, then
    SIGTERM, then SIGKILL (within ``CAP_GRACE_S`` in all, but for a process that ignores
    SIGKILL's wait)."""
    for sig, wait in ((signal.SIGINT, 5), (signal.SIGTERM, 3), (signal.SIGKILL, 30)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_part(part: Part, out: Path, timeout: float | None, attempt: int,
             record: dict[str, Any]) -> dict[str, Any]:
    """Run one part as a subprocess (its output to its log); the state entry of this try. It is
    stopped at ``timeout`` (what is left of the budget: "interrupted") or at its own cap,
    whichever comes first ("failed", ``capped``)."""
    capped = part.cap_s is not None and (timeout is None or part.cap_s < timeout)
    if capped:
        timeout = part.cap_s
    command = command_for(part, out)
    log = out / LOGS / f"{part.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    previous = {name: (read_json(out / name) or {}).get("campaign")
                for name in part.outputs if name.endswith(".json")}
    started = time.time()
    start_utc = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with log.open("w" if attempt == 1 else "a") as stream:  # a new run's log replaces an old one
        stream.write(f"=== gpu_campaign part {part.name}, attempt {attempt}, {start_utc}\n"
                     f"=== command: {shlex.join(command)}\n")
        stream.flush()
        try:
            process = subprocess.Popen(command, cwd=ROOT, env=part_environment(part),
                                       stdout=stream, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        except OSError as error:
            stream.write(f"=== could not start: {error}\n")
            process = None
        status, code = "failed", None
        if process is not None:
            try:
                code = process.wait(timeout=timeout)
                status = "done" if code == 0 else "failed"
            except subprocess.TimeoutExpired:
                _kill_group(process)
                code = process.returncode
                status = "capped" if capped else "interrupted"
                stream.write(f"=== stopped by gpu_campaign at "
                             f"{'its cap' if capped else 'the budget'} after {timeout:.0f} s\n")
            except BaseException:
                _kill_group(process)
                raise
    seconds = round(time.time() - started, 1)
    reason = None
    if status == "capped":
        status, reason = "failed", (f"stopped at its own cap of {part.cap_s:.0f} s (the verdict's "
                                    f"bound); its log holds what it did")
    entry = {"status": status, "exit_status": code, "seconds": seconds, "attempts": attempt,
             "started_utc": start_utc,
             "ended_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                 timespec="seconds"),
             "command": command, "log": f"{LOGS}/{part.name}.log", "note": part.note}
    if reason:
        entry.update(capped=True, reason=reason)
    if status != "done":
        entry["log_tail"] = tail(log)
    stamped = {"status": status, "exit_status": code, "started_utc": start_utc,
               "ended_utc": entry["ended_utc"]}
    for name in part.outputs:
        path = out / name
        if path.is_file() and path.stat().st_mtime >= started - 1:
            stamp(path, part, stamped, record, previous.get(name))
    return entry


def expected_seconds(part: Part, parts: list[Part], state: dict[str, Any],
                     given: list[tuple[str, float]] = ()) -> float:
    """``--expect-s`` for the part if given, else the measured duration of finished parts of
    the same kind (with a margin), else the part's allowance; an interrupted part needs at
    least what it already ran."""
    entries = state["parts"]
    finished = [entries[p.name]["seconds"] for p in parts
                if p.kind == part.kind and entries.get(p.name, {}).get("status") == "done"]
    expect = LEARNED_MARGIN * max(finished) if finished else part.expect_s
    for pattern, seconds in given:
        if fnmatch.fnmatchcase(part.name, pattern):
            expect = seconds
    own = entries.get(part.name, {})
    if own.get("status") == "interrupted":
        expect = max(expect, own.get("seconds", 0))
    return expect


# --- the summary ------------------------------------------------------------------------------


def _on_gpu(report: Any) -> str | None:
    """The GPU a report was measured on, None for a CPU run or no report."""
    if not isinstance(report, dict):
        return None
    name = str(report.get("machine", {}).get("device_name") or "")
    return name if name and not name.lower().startswith("cpu") else None


@dataclasses.dataclass
class Target:
    what: str
    provider: str
    op: str            # "<=" or ">="
    limit: float
    unit: str          # "x" or "%"
    cells: list[tuple[str, float | None, str | None]]  # (cell, value, failure)
    note: str = ""

    def verdict(self) -> str:
        measured = [c for c in self.cells if c[1] is not None or c[2]]
        if any(c[2] or not self.meets(c[1]) for c in measured):
            return "missed"
        if measured and len(measured) == len(self.cells):
            return "met"
        return "unmeasured"

    def meets(self, value: float | None) -> bool:
        if value is None:
            return False
        return value <= self.limit if self.op == "<=" else value >= self.limit

    def fmt(self, value: float) -> str:
        if self.unit == "n":
            return f"{value:.0f}"
        return f"{value:.0%}" if self.unit == "%" else f"{value:.3f}x"

    def value_text(self) -> str:
        failed = [c for c in self.cells if c[2]]
        values = [c for c in self.cells if c[1] is not None]
        if not values and not failed:
            return "unmeasured"
        parts = []
        if values:
            worst = (max if self.op == "<=" else min)(values, key=lambda c: c[1])
            parts.append(f"worst {self.fmt(worst[1])} ({worst[0]})" if len(values) > 1
                         else self.fmt(worst[1]))
        if failed:
            parts.append(f"{len(failed)} failed")
        return ", ".join(parts)

    def cells_text(self) -> str:
        measured = [c for c in self.cells if c[1] is not None or c[2]]
        met = sum(1 for c in measured if not c[2] and self.meets(c[1]))
        return f"{len(measured)}/{len(self.cells)} measured, {met} met"


PROVIDER_NAMES = {"iabn": "iabn (default)", "iabn_triton": "iabn Triton",
                  "reference": "iabn (default)", "triton": "iabn Triton",
                  "offload_all": "OffloadModel"}


def _cells(report: Any) -> dict[tuple, dict[str, Any]]:
    """A GPU network_step report's cells at the campaign's image size, by (mode, model, dtype,
    layout, batch); none for a CPU run or no report."""
    if not _on_gpu(report):
        return {}
    return {(c["mode"], c["model"], c["dtype"], c["layout"], c["batch"]): c
            for c in report.get("cells", []) if c.get("image_size") == NETWORK_IMAGE}


def network_targets(report: Any, batch_report: Any = None) -> list[Target]:
    """The whole-network targets over the campaign's cells: step times and peaks from
    network_step's timed cells (``report``), the largest batch from its search cells
    (``batch_report``, measured in the campaign's 12 GiB)."""
    cells = _cells(report)
    budget_ok = (_on_gpu(batch_report)
                 and batch_report.get("settings", {}).get("budget_gib") == NETWORK_BUDGET_GIB)
    batch_cells = _cells(batch_report) if budget_ok else {}
    specs = [
        ("whole-network eager step vs BN", "eager", tuple(NETWORK), "step_time", "<=", 1.0,
         "goal 0.95x"),
        ("compiled step vs compiled BN", "compile", tuple(NETWORK), "step_time", "<=", 1.0, ""),
        ("reduce-overhead step vs BN (and runs)", "reduce_overhead", tuple(NETWORK),
         "step_time", "<=", 1.0, ""),
        ("peak step memory vs BN, ResNet-50", "eager", ("resnet50",), "peak_step", "<=", 0.70,
         "eager cells"),
        ("peak step memory vs BN", "eager", ("resnext101", "wider_resnet38_a2"), "peak_step",
         "<=", 0.55, "eager cells"),
        (f"largest batch in {NETWORK_BUDGET_GIB} GiB vs BN", "eager", ("resnext101",),
         "largest_batch_peak", ">=", 2.0, "real steps, allocator peak"),
    ]
    targets = []
    for what, mode, models, key, op, limit, note in specs:
        source = batch_cells if key == "largest_batch_peak" else cells
        for provider in ("iabn", "iabn_triton"):
            found = []
            for m, model, dtype, layout in network_cells():
                if m != mode or model not in models:
                    continue
                if key == "largest_batch_peak" and layout != "channels_last":
                    continue  # the search runs channels-last only
                label = network_part_name(m, model, dtype, layout).removeprefix("net_")
                cell = source.get((mode, model, dtype, layout, NETWORK[model][1]))
                if cell is None:
                    found.append((label, None, None))
                elif "error" in cell:
                    found.append((label, None, f"cell failed: {cell['error']}"))
                elif "error" in cell.get("providers", {}).get(provider, {}):
                    found.append((label, None, cell["providers"][provider]["error"]))
                elif "error" in cell.get("providers", {}).get("bn", {}):
                    found.append((label, None, None))  # no baseline: not a result for iabn
                else:
                    value = cell.get("ratio_to_bn", {}).get(provider, {}).get(key)
                    found.append((label, value, None))
            targets.append(Target(what, PROVIDER_NAMES[provider], op, limit, "x", found,
                                  note))
    return targets


def layer_rows(*reports: Any) -> list[dict[str, Any]]:
    """The rows at ``LAYER_SHAPE`` of GPU gpu_speed reports (the verdict's layer part first,
    then the full table's), one per (dtype, layout, provider, mode)."""
    rows: dict[tuple, dict[str, Any]] = {}
    for report in reports:
        for r in (report.get("rows", []) if _on_gpu(report) else []):
            if r.get("shape") == LAYER_SHAPE:
                rows.setdefault((r["dtype"], r["layout"], r["provider"], r["mode"]), r)
    return list(rows.values())


def layer_targets(*reports: Any) -> list[Target]:
    """One layer's forward + backward at LAYER_SHAPE, channels-last (the headline's layout),
    against the device copy bandwidth."""
    rows = layer_rows(*reports)
    targets = []
    for provider in ("reference", "triton"):
        found = []
        for dtype in NETWORK_DTYPES:
            value = next((r["fraction_of_copy"] for r in rows
                          if r["dtype"] == dtype and r["layout"] == "channels_last"
                          and r["provider"] == provider and r["mode"] == "full"), None)
            found.append((f"{NETWORK_DTYPES[dtype]} cl", value, None))
        targets.append(Target(f"layer fwd+bwd {LAYER_SHAPE} vs copy bandwidth",
                              PROVIDER_NAMES[provider], ">=", 0.60, "%", found))
    return targets


#: One count of pytest's result line ("3 failed, 230 passed, 12 skipped in 95.1s").
PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)")


def pytest_result_line(path: Path) -> str | None:
    """The last pytest result line of a log (None without a log or one)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.strip("= ") for line in reversed(lines)
                 if PYTEST_COUNT.search(line) and " in " in line), None)


def pytest_counts(path: Path) -> dict[str, int] | None:
    """The counts of pytest's result line in a log (passed, failed, error, skipped, ...);
    None without one."""
    line = pytest_result_line(path)
    if line is None:
        return None
    return {("error" if kind.startswith("error") else kind): int(n)
            for n, kind in PYTEST_COUNT.findall(line)}


def tests_target(path: Path, smoke: bool) -> Target:
    """The verdict's CUDA tests: met when they ran to the end with nothing failed; missed when
    any failed or errored (or they were stopped at their cap); unmeasured without a GPU log."""
    found: tuple[str, float | None, str | None] = ("gpu tests", None, None)
    counts = None if smoke else pytest_counts(path)
    text = path.read_text(errors="replace") if path.is_file() and not smoke else ""
    if counts is not None:
        bad = counts.get("failed", 0) + counts.get("error", 0)
        interrupted = "KeyboardInterrupt" in text or "interrupted (SIGINT)" in text
        if bad or interrupted:
            why = ", ".join(f"{n} {k}" for k, n in counts.items())
            found = (found[0], None, why + ("; stopped at its cap" if interrupted else ""))
        else:
            found = (found[0], float(counts.get("passed", 0)), None)
    elif text:
        found = (found[0], None, "no pytest result in the log")
    return Target("gpu-marked and Triton tests on CUDA: all pass", "pytest", ">=", 1, "n",
                  [found], "value: tests passed")


def offload_target(pareto: Any, pcie: Any) -> tuple[Target, dict[str, Any]]:
    """OffloadModel's VGG-19 step against its PCIe bound, max(eager step, copy time)."""
    found: tuple[str, float | None, str | None] = ("vgg19 b32 128px", None, None)
    facts: dict[str, Any] = {}
    row = None
    if _on_gpu(pareto) and _on_gpu(pcie) and _on_gpu(pareto) == _on_gpu(pcie):
        args = pareto.get("args", {})
        same = (args.get("batch") == pcie.get("batch") == OFFLOAD_BATCH
                and args.get("size") == pcie.get("size") == OFFLOAD_SIZE)
        row = next((r for r in pareto.get("rows", [])
                    if f"{r['model']}:{r['norm_act']}" == OFFLOAD_MODEL), None) if same else None
    if row is not None:
        results, failed = row.get("results", {}), row.get("failed", {})
        facts = {"strategies": results, "failed": failed, "copy_ms": pcie.get("copy_ms"),
                 "transferred_bytes": pcie.get("transferred_bytes"),
                 "d2h_gbps": pcie.get("d2h_gbps"), "h2d_gbps": pcie.get("h2d_gbps")}
        if "offload_all" in failed:
            found = (found[0], None, f"offload_all failed: {failed['offload_all']}")
        elif "offload_all" in results and "eager" in results and pcie.get("copy_ms"):
            bound = max(results["eager"]["ms"], pcie["copy_ms"])
            facts["bound_ms"] = bound
            found = (found[0], results["offload_all"]["ms"] / bound, None)
    return Target("offloaded step vs PCIe bound", "OffloadModel", "<=", 1.1, "x", [found],
                  "bound = max(eager step, transferred/d2h + transferred/h2d)"), facts


def plan_target(report: Any) -> tuple[Target, dict[str, Any]]:
    """iabn.plan's ResNet-50 at a third of its activation bytes: its step against the model as
    given (BatchNorm), both eager, timed side by side (plan_anchors.py); and the rows."""
    batch = NETWORK[PLAN_MODEL][1]
    found: tuple[str, float | None, str | None] = (f"{PLAN_MODEL} b{batch} {NETWORK_IMAGE}px",
                                                   None, None)
    rows: dict[str, Any] = {}
    args = report.get("args", {}) if _on_gpu(report) else {}
    if args.get("batch") == batch and args.get("size") == NETWORK_IMAGE:
        result = next((r for r in report.get("results", []) if r.get("model") == PLAN_MODEL),
                      {})
        rows = result.get("rows", {})
        row = rows.get(f"plan_{PLAN_BUDGET:g}", {})
        if row and "bytes" not in row:
            found = (found[0], None, row.get("out_of_reach") or row.get("failed") or "no plan")
        elif row.get("ratio", 0) > 1 / 3:
            found = (found[0], None, f"the plan keeps {row['ratio']:.3f} of the bytes")
        elif "step_ratio" in row:
            found = (found[0], row["step_ratio"], None)
    return Target("plan at 1/3 of BN's activations: step vs BN", "iabn.plan", "<=",
                  PLAN_STEP_LIMIT, "x", [found], "eager, median"), rows


def suite_result(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    code = next((line for line in reversed(lines) if line.startswith("exit code:")), None)
    return ("; ".join(x for x in (pytest_result_line(path), code) if x)
            or "no pytest result in the log")


def _profile_text(profile: Any) -> str:
    if not isinstance(profile, dict) or not profile.get("wall_ms"):
        return "-"
    top = profile.get("top") or [{}]
    return (f"{profile['kernels']} kernels, {profile['kernel_ms']:.2f} of "
            f"{profile['wall_ms']:.2f} ms; top: {top[0].get('name', '-')[:50]} "
            f"({top[0].get('ms', 0):.2f} ms)")


def layer_facts(rows: list[dict[str, Any]]) -> list[str]:
    """The verdict's layer, forward + backward, each provider against BN + LeakyReLU."""
    full = [r for r in rows if r["mode"] == "full"]
    if not full:
        return []
    eager = {(r["dtype"], r["layout"]): r["median_ms"] for r in full if r["provider"] == "eager"}
    md = ["", f"One layer, {LAYER_SHAPE}, forward + backward (gpu_speed.py, medians; "
              "eager = nn.BatchNorm2d + LeakyReLU on cuDNN):", "",
          "| dtype | layout | provider | ms | vs eager | of copy bandwidth | peak MiB | "
          "profile (kernels, device ms of wall ms) |", "|---|---|---|---|---|---|---|---|"]
    for r in full:
        base = eager.get((r["dtype"], r["layout"]))
        ratio = f"{r['median_ms'] / base:.2f}x" if base else "-"
        peak = f"{r['peak_step_mib']:.0f}" if r.get("peak_step_mib") is not None else "-"
        md.append(f"| {r['dtype']} | {r['layout']} | {r['provider']} | {r['median_ms']:.3f} | "
                  f"{ratio} | {r['fraction_of_copy']:.0%} | {peak} | "
                  f"{_profile_text(r.get('profile'))} |")
    return md


def network_facts(report: Any) -> list[str]:
    """Every measured network cell: each provider's step, peak and where its time goes."""
    cells = _cells(report)
    if not cells:
        return []
    md = ["", "Network steps (network_step.py, medians of interleaved steps; ratios to bn in "
              "the same run):", "",
          "| cell | provider | step ms | vs bn | peak MiB | vs bn | profile (kernels, device "
          "ms of wall ms) |", "|---|---|---|---|---|---|---|"]
    for (mode, model, dtype, layout, batch), cell in cells.items():
        label = f"{model} b{batch} {dtype} {layout} {mode}"
        for provider, out in cell.get("providers", {}).items():
            if "ms" not in out:
                md.append(f"| {label} | {provider} | failed: {out.get('error')} | | | | |")
                continue
            ratios = cell.get("ratio_to_bn", {}).get(provider, {})
            step = ratios.get("step_time")
            peak_ratio = ratios.get("peak_step")
            peak = out.get("peak_step_bytes")
            md.append(f"| {label} | {provider} | {out['ms']:.1f} | "
                      f"{f'{step:.3f}x' if step is not None else '-'} | "
                      f"{f'{peak / 2**20:.0f}' if peak is not None else '-'} | "
                      f"{f'{peak_ratio:.3f}x' if peak_ratio is not None else '-'} | "
                      f"{_profile_text(out.get('profile'))} |")
    return md


def summarize(out: Path, state: dict[str, Any], parts: list[Part]) -> tuple[str, str]:
    """(markdown of the whole summary, the short table printed last)."""
    names = files(state["smoke"])
    network = read_json(out / names["network"])
    layer_reports = (read_json(out / names["layer"]), read_json(out / names["speed"]))
    targets = [tests_target(out / names["gpu_tests"], state["smoke"]),
               *network_targets(network, read_json(out / names["batch"])),
               *layer_targets(*layer_reports)]
    offload, facts = offload_target(read_json(out / names["pareto"]),
                                    read_json(out / names["pcie"]))
    planned, plan_rows = plan_target(read_json(out / names["plan"]))
    targets += [offload, planned]
    calls = state.get("calls", [])
    last = calls[-1]["machine"] if calls else {}
    title = ("# GPU campaign: CPU SMOKE RUN (no figure here is a GPU measurement)"
             if state["smoke"] else "# GPU campaign")
    md = [title, "",
          f"Device {last.get('device_name')}, driver {last.get('driver_version')}, torch "
          f"{last.get('torch_version')} (CUDA {last.get('torch_cuda')}), Triton "
          f"{last.get('triton_version')}, torchvision {last.get('torchvision_version')}, timm "
          f"{last.get('timm_version')}.", "",
          "Calls (commit, UTC start):", ""]
    md += [f"- {c['machine'].get('commit')} ({c['machine'].get('commit_source')}), "
           f"{c['machine'].get('date_utc')}, {c.get('stopped') or 'running'}" for c in calls]
    md += ["", "Targets, from the parts' files in this folder only. 'unmeasured': no GPU "
               "measurement of every cell exists yet; nothing is estimated.", "",
           "| target | provider | limit | value | cells | verdict |",
           "|---|---|---|---|---|---|"]
    for t in targets:
        md.append(f"| {t.what}{f' ({t.note})' if t.note else ''} | {t.provider} | "
                  f"{t.op} {t.fmt(t.limit)} | {t.value_text()} | {t.cells_text()} | "
                  f"{t.verdict()} |")
    md += ["", "Parts:", "", "| part | status | exit | seconds | attempts | note |",
           "|---|---|---|---|---|---|"]
    for part in parts:
        e = state["parts"].get(part.name, {})
        md.append(f"| {part.name} | {e.get('status', 'pending')} | {e.get('exit_status', '')} "
                  f"| {e.get('seconds', '')} | {e.get('attempts', 0)} | {part.note} |")
    md += ["", f"CUDA tests (the verdict's selection): "
               f"{suite_result(out / names['gpu_tests'])}.",
           f"Suite: {suite_result(out / names['suite'])}.", "", "Cells of every target:", ""]
    for t in targets:
        cells = ", ".join(f"{label} {t.fmt(v) if v is not None else fail or 'unmeasured'}"
                          for label, v, fail in t.cells)
        md.append(f"- {t.what}, {t.provider}: {cells}")
    md += layer_facts(layer_rows(*layer_reports)) + network_facts(network)
    if facts.get("strategies"):
        eager = facts["strategies"].get("eager", {})
        md += ["", f"Offloading, VGG-19 (BN) b{OFFLOAD_BATCH} {OFFLOAD_SIZE}px "
                   f"(memory_time_pareto.py, offload_pcie.py): d2h "
                   f"{facts['d2h_gbps']:.1f} GB/s, h2d {facts['h2d_gbps']:.1f} GB/s, "
                   f"{facts['transferred_bytes'] / 2**20:.0f} MiB transferred, copies "
                   f"{facts['copy_ms']:.1f} ms", "",
               "| strategy | ms | vs eager | peak MiB | vs eager |", "|---|---|---|---|---|"]
        for name, r in facts["strategies"].items():
            peak = r.get("peak_mib")
            time_ratio = f"{r['ms'] / eager['ms']:.2f}x" if eager.get("ms") else "-"
            md.append(f"| {name} | {r['ms']:.1f} | {time_ratio} | "
                      + (f"{peak:.0f} | {peak / eager['peak_mib']:.2f}x |"
                         if peak is not None and eager.get("peak_mib") else "- | - |"))
        md += [f"| {name} | failed: {why} | | | |" for name, why in facts["failed"].items()]
    if plan_rows:
        md += ["", f"Planning, {PLAN_MODEL} b{NETWORK[PLAN_MODEL][1]} {NETWORK_IMAGE}px "
                   "(plan_anchors.py; activation bytes counted exactly, steps eager, medians):",
               "", "| strategy | activation bytes vs BN | step vs BN | predicted | "
                   "peak step MiB |", "|---|---|---|---|---|"]
        for name, r in plan_rows.items():
            if "bytes" not in r:
                md.append(f"| {name} | {r.get('out_of_reach') or r.get('failed')} | | | |")
                continue
            predicted = (f"{1 + r['predicted_overhead']:.3f}x" if "predicted_overhead" in r
                         else "-")
            step = f"{r['step_ratio']:.3f}x" if "step_ratio" in r else "-"
            peak = (f"{r['peak_step_bytes'] / 2**20:.0f}" if "peak_step_bytes" in r else "-")
            md.append(f"| {name} | {r['ratio']:.3f} | {step} | {predicted} | {peak} |")
    short = [f"{'target':<44} {'provider':<15} {'value':<34} {'cells':<22} verdict"]
    short += [f"{t.what[:44]:<44} {t.provider:<15} {t.value_text()[:34]:<34} "
              f"{t.cells_text():<22} {t.verdict()}" for t in targets]
    return "\n".join(md) + "\n", "\n".join(short)


# --- command line -----------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, as every usage error here
        raise UsageError(message)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    order = parser.add_mutually_exclusive_group()
    order.add_argument("--resume", action="store_true",
                       help="continue the campaign in --out (start one if there is none)")
    order.add_argument("--restart", action="store_true",
                       help="start over in --out, replacing its campaign state (the parts' "
                            "files are rewritten as they run; network_step keeps the cells "
                            "its JSON holds)")
    parser.add_argument("--parts", default=None,
                        help="comma-separated part names, groups or patterns (default: all)")
    parser.add_argument("--rerun", action="store_true",
                        help="run the selected parts even when done or failed")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds this call may take (stop before a part that does not fit)")
    parser.add_argument("--reserve-s", type=float, default=RESERVE_S,
                        help=f"seconds of the budget kept for the summary and bundle "
                             f"({RESERVE_S})")
    parser.add_argument("--expect-s", action="append", default=[], metavar="PATTERN=SECONDS",
                        help="expected seconds of the matching parts, for --budget-s")
    parser.add_argument("--commit", default=None,
                        help="the commit being measured, recorded when there is no .git")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--bundle", type=Path, default=None,
                        help="also pack the campaign's files into this .tar.gz")
    parser.add_argument("--smoke", action="store_true",
                        help="rehearse on a CPU with the quickest settings")
    parser.add_argument("--list", action="store_true", help="print the parts and exit")
    parser.add_argument("--part-command-override", action="append", default=[],
                        metavar="PATTERN=COMMAND",
                        help="replace the command of matching parts (tests, rehearsals)")
    args = parser.parse_args(argv)
    if args.budget_s is not None and not args.budget_s > 0:
        raise UsageError(f"--budget-s {args.budget_s:g}: give a positive number of seconds")
    if args.reserve_s < 0 or (args.budget_s is not None and args.reserve_s >= args.budget_s):
        raise UsageError(f"--reserve-s {args.reserve_s:g}: use 0 or more, less than --budget-s")
    args.expect = []
    for item in args.expect_s:
        pattern, _, seconds = item.partition("=")
        try:
            args.expect.append((pattern, float(seconds)))
        except ValueError:
            raise UsageError(f"--expect-s {item!r}: use PATTERN=SECONDS") from None
        if not pattern or not args.expect[-1][1] >= 0:
            raise UsageError(f"--expect-s {item!r}: use PATTERN=SECONDS")
    if args.commit is not None and not re.fullmatch(r"[0-9a-fA-F]{7,40}", args.commit):
        raise UsageError(f"--commit {args.commit!r}: give a git commit hash (7 to 40 hex "
                         f"digits; git rev-parse HEAD)")
    if args.bundle is not None and not args.bundle.name.endswith(".tar.gz"):
        raise UsageError(f"--bundle {args.bundle}: the bundle is a .tar.gz file")
    overrides = []
    for item in args.part_command_override:
        pattern, sep, command = item.partition("=")
        if not sep or not pattern or not command.strip():
            raise UsageError(f"--part-command-override {item!r}: use PATTERN=COMMAND")
        overrides.append((pattern, command))
    args.overrides = overrides
    if args.out is None:
        if args.smoke:
            args.out = Path("runs") / "benchmarks" / "campaign_smoke"
        elif os.environ.get("IABN_COMMIT_RESULTS") == "1":
            args.out = COMMITTED
        else:
            args.out = Path("runs") / "benchmarks" / "campaign"
    args.out = args.out.resolve()
    if args.smoke and (args.out == COMMITTED.resolve()
                       or COMMITTED.resolve() in args.out.parents):
        raise UsageError(f"--smoke --out {args.out}: a CPU rehearsal never writes under "
                         f"benchmarks/results/; give another --out")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: not a folder")
    if args.bundle is not None:
        args.bundle = args.bundle.resolve()
    return args


def load_state(args: argparse.Namespace, record: dict[str, Any]) -> dict[str, Any]:
    path = args.out / STATE
    if path.exists() and not (args.resume or args.restart):
        raise UsageError(f"{path} exists: continue that campaign with --resume, or start "
                         f"over with --restart")
    state = read_json(path) if path.exists() and args.resume else None
    if path.exists() and args.resume and not isinstance(state, dict):
        raise UsageError(f"{path}: not a campaign state file; move it away or use --restart")
    if state is None:
        return {"campaign": "gpu_campaign", "smoke": args.smoke, "parts": {}, "calls": []}
    if state.get("smoke") != args.smoke:
        kind = "a CPU smoke run" if state.get("smoke") else "a GPU campaign"
        raise UsageError(f"{path} holds {kind}: use another --out for this one")
    devices = {c["machine"].get("device_name") for c in state.get("calls", [])}
    if devices and record.get("device_name") not in devices:
        raise UsageError(f"{path} was measured on {', '.join(map(str, devices))}, this machine "
                         f"is {record.get('device_name')}: use another --out (e.g. "
                         f"benchmarks/results/<gpu>) for it")
    return state


def continue_command(argv: list[str]) -> str:
    rest = [a for a in argv if a not in ("--resume", "--restart")]
    return shlex.join(["python3", "benchmarks/gpu_campaign.py", "--resume", *rest])


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # the budget counts the machine record too
    raw = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(raw)
        parts = apply_overrides(plan(args.smoke), args.overrides)
        selected = select(parts, [t.strip() for t in args.parts.split(",") if t.strip()]
                          if args.parts else None)
        if args.list:
            for part in parts:
                cap = f"cap {part.cap_s:.0f} s" if part.cap_s is not None else ""
                print(f"{part.name:<28} {part.group:<10} ~{part.expect_s:>4.0f} s {cap:<11} "
                      f"{shlex.join(command_for(part, args.out))}")
            print(f"first call on a fresh --out: {', '.join(VERDICT)}, at most "
                  f"{first_call_seconds(parts):.0f} s by their caps")
            return 0
        record = machine(args.smoke, args.commit)
        if not args.smoke and not record.get("cuda_available"):
            raise UsageError("no CUDA device: the campaign measures a GPU (use --smoke for the "
                             "CPU rehearsal)")
        state = load_state(args, record)
    except UsageError as error:
        print(f"gpu_campaign: error: {error}", file=sys.stderr)
        return 2
    return run(args, raw, parts, selected, state, record, start)


def run(args: argparse.Namespace, raw: list[str], parts: list[Part], selected: list[Part],
        state: dict[str, Any], record: dict[str, Any], start: float) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    call = {"argv": raw, "machine": record, "budget_s": args.budget_s, "stopped": None}
    state["calls"].append(call)
    state_path = out / STATE

    def save() -> None:
        write_json(state_path, state)
        summary, _ = summarize(out, state, parts)
        write_atomic(out / SUMMARY, summary.encode())
        if args.bundle is not None:
            bundle(out, args.bundle, campaign_files(out, state, parts))

    save()
    mode = "CPU smoke run" if args.smoke else record.get("device_name")
    print(f"gpu_campaign: {len(selected)} parts selected, on {mode}; out {out}", flush=True)
    ran = 0
    for part in selected:
        entry = state["parts"].get(part.name, {})
        status = entry.get("status", "pending")
        if status in ("done", "failed") and not args.rerun:
            continue
        attempts = entry.get("attempts", 0) if status == "interrupted" else 0
        expect = expected_seconds(part, parts, state, args.expect)
        timeout = None
        if args.budget_s is not None:
            left = args.budget_s - (time.monotonic() - start) - args.reserve_s
            if left <= 0 or (ran and expect > left):
                call["stopped"] = (f"budget: {part.name} expects ~{expect:.0f} s, "
                                   f"{max(left, 0):.0f} s left")
                break
            timeout = left
        print(f"[{part.name}] started (expects ~{expect:.0f} s)", flush=True)
        result = run_part(part, out, timeout, attempts + 1, record)
        out_of_time = result["status"] == "interrupted"
        if out_of_time and not ran:
            result.update(status="failed", reason=(
                f"stopped by the budget after {result['seconds']:.0f} s as the first part of "
                f"the call: it needs more than --budget-s; run it alone with a larger one"))
        state["parts"][part.name] = result
        ran += 1
        print(f"[{part.name}] {result['status']} (exit {result['exit_status']}, "
              f"{result['seconds']:.0f} s)", flush=True)
        if result["status"] != "done":
            print("\n".join(f"    {line}" for line in
                            result.get("log_tail", "").splitlines()[-8:]), flush=True)
        save()
        if out_of_time:
            call["stopped"] = f"budget: {part.name} was stopped after {result['seconds']:.0f} s"
            break
    left = [p.name for p in selected
            if state["parts"].get(p.name, {}).get("status") not in ("done", "failed")]
    call["stopped"] = call["stopped"] or ("finished" if not left else "stopped")
    save()
    _, short = summarize(out, state, parts)
    table = [f"{'part':<28} {'status':<12} {'exit':>5} {'seconds':>8} {'tries':>5}"]
    for part in selected:
        e = state["parts"].get(part.name, {})
        table.append(f"{part.name:<28} {e.get('status', 'pending'):<12} "
                     f"{e.get('exit_status', ''):>5} {e.get('seconds', ''):>8} "
                     f"{e.get('attempts', 0):>5}")
    print("\n" + "\n".join(table) + "\n\n" + short, flush=True)
    if args.bundle is not None:
        size = args.bundle.stat().st_size
        over = "; OVER the 16 MiB a device call returns" if size > 16 * 2**20 else ""
        print(f"bundle: {args.bundle} ({len(campaign_files(out, state, parts))} files, "
              f"{size / 2**20:.1f} MiB{over})")
    print(f"summary: {out / SUMMARY}")
    if left:
        print(f"{call['stopped']}. Left: {len(left)} parts ({', '.join(left[:6])}"
              f"{', ...' if len(left) > 6 else ''}). Continue: {continue_command(raw)}")
        return 3
    failed = [p.name for p in selected if state["parts"].get(p.name, {}).get("status")
              == "failed"]
    if failed:
        print(f"finished; failed: {', '.join(failed)}")
        return 1
    print("finished: every selected part done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
