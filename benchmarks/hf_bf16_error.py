"""Hugging Face models converted by ``iabn.convert`` in bfloat16: how far their outputs and
gradients are from a float64 copy, against the original's, over several seeds.

For each family of tests/support/hf_models.py (small configs, random weights, no download) and
each seed (the weights, the ``input_ids`` / ``pixel_values`` batch and the output's cotangent):

- ``original``: the model in bfloat16 (built in float32, cast);
- ``norms``: ``iabn.convert(model, example_kwargs=batch, activations=False)``: the layer and
  RMS norms replaced (output-only layers, which rebuild ``xhat`` from their bfloat16 output);
- ``activations``: the GELU/SiLU modules replaced (in-place layers, which recover their input
  from their bfloat16 output): the full conversion with its norms put back;
- ``both``: ``iabn.convert(model, example_kwargs=batch)``.

The reference is the *original* model in float64 with the bfloat16 model's own weights
(``original.double()``), run on the same batch and cotangent (the bfloat16 ones, widened),
so every error is the arithmetic's, not the weights' rounding. Metrics per model:

- ``output``: the largest ``|y - y64|`` of the main output (logits or last hidden state);
- per parameter, ``max |g - g64| / max |g64|`` (the parameter's gradient error over its largest
  gradient); ``grad_max`` and ``grad_median`` are its largest and median value over the
  model's parameters (a parameter whose float64 gradient is below 1e-6 of the model's largest,
  zero in exact arithmetic, is left out: the attention key biases, which softmax ignores);
- ``saved_bytes``: the bytes the norms' and the full conversion keep for backward over the
  original's (bfloat16, the report's totals at seed 0's batch);
- ``rms_median``, ``rms_worst``: per parameter, the root-mean-square error of the conversion's
  gradient over the original's (steadier than the largest error, which one element sets);
  their median and largest value over the parameters (the latter: the parameter the
  conversion moves most).

Each conversion's figures are divided by the original's of the same seed; the report gives per
family and conversion the median and the range (min, max) of these ratios over the seeds.
Converted once per family (seed 0); the other seeds load their weights into the same modules
(the conversion keeps the state_dict keys). Error figures are deterministic (one thread), so
the machine's load does not move them; the load average is recorded with the run time.

``--layers`` adds the cause, one layer at a time: each of the families' norms and activations
alone in bfloat16 (``ROWS x D`` = 2048 x 768, input ``2 randn + 0.5``, weight ``1 + 0.3 randn``,
bias ``0.3 randn``, ``randn`` output gradient; 7 seeds), iabn's layer against the original
module (PyTorch's or Hugging Face's), both against the original in float64: the largest error
of the input, weight and bias gradients over the largest float64 value, and their
root-mean-square error, as ratios. For the
in-place GELU and SiLU also the least largest error that any layer keeping only the bfloat16
output and the branch bit can guarantee: every input whose output rounds to the same value
on the same branch is stored alike, so for the worst of them the slope is off by at least half
the slope's range over that set (computed by bisection in float64).

Usage::

    python benchmarks/hf_bf16_error.py [--seeds 5] [--families llama gpt2] [--layers]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import iabn
from iabn.tools.bench import machine_info, results_folder, set_threads, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the models' definitions
import hf_models  # noqa: E402

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
CONVERSIONS = ("norms", "activations", "both")
METRICS = ("output", "grad_max", "grad_median", "rms_median", "rms_worst")
#: a float64 gradient below this fraction of the model's largest is zero in exact arithmetic
ZERO_GRADIENT = 1e-6
#: iabn's norm classes, which the ``activations`` conversion puts back to the original's
NORMS = ("InPlaceLayerNorm", "InPlaceLayerNorm2d", "InPlaceRMSNorm")


def batch_of(family: str, seed: int) -> dict:
    example = hf_models.FAMILIES[family][1]
    if example is hf_models.ids:
        return example(torch.bfloat16, False, seed=seed)
    return example(torch.bfloat16, seed=seed)


def main_output(output) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output.last_hidden_state


def convert(model: nn.Module, batch: dict, activations: bool) -> tuple[nn.Module, float]:
    """The converted model and the bytes it keeps for backward over the original's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config notes
        converted, report = iabn.convert(model, example_kwargs=batch, verify=False,
                                         activations=activations)
    if report.result != "modules swapped":
        raise RuntimeError(f"expected swapped modules, got {report.result}")
    return converted, report.saved_after / report.saved_before


def norms_put_back(both: nn.Module, original: nn.Module) -> nn.Module:
    """``both`` with each of iabn's norms replaced by a copy of the original's module."""
    model = copy.deepcopy(both)
    for name, module in list(model.named_modules()):
        if type(module).__name__ in NORMS:
            model.set_submodule(name, copy.deepcopy(original.get_submodule(name)))
    return model


def outputs_and_grads(model: nn.Module, batch: dict, cotangent: torch.Tensor
                      ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.eval()  # no dropout: the same function for every model
    model.zero_grad()
    y = main_output(model(**batch))
    (y * cotangent.to(y.dtype)).sum().backward()
    return y.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()
                                 if p.grad is not None}


def errors(model: nn.Module, batch: dict, cotangent: torch.Tensor,
           truth: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> dict:
    """The output's largest error and each parameter's relative gradient error; parameters
    whose float64 gradient is below :data:`ZERO_GRADIENT` of the model's largest (zero in
    exact arithmetic: the attention key biases, which softmax ignores) are left out."""
    y, grads = outputs_and_grads(model, batch, cotangent)
    y64, grads64 = truth
    largest = max(float(g.abs().max()) for g in grads64.values())
    relative, rms = {}, {}
    for name, g64 in grads64.items():
        scale = float(g64.abs().max())
        if scale > ZERO_GRADIENT * largest:
            relative[name] = float((grads[name] - g64).abs().max()) / scale
            rms[name] = float((grads[name] - g64).square().mean().sqrt())
    return {"output": float((y - y64).abs().max()), "grad_max": max(relative.values()),
            "grad_median": statistics.median(relative.values()), "per_parameter_rms": rms}


def measure(family: str, seeds: int) -> dict:
    build = hf_models.FAMILIES[family][0]
    model = build(torch.float32, seed=0).to(torch.bfloat16)
    batch = batch_of(family, 0)
    (norms, norms_bytes), (both, both_bytes) = (convert(model, batch, activations=False),
                                                convert(model, batch, activations=True))
    converted = {"norms": norms, "both": both, "activations": norms_put_back(both, model)}
    per_seed = []
    for seed in range(seeds):
        state = build(torch.float32, seed=seed).to(torch.bfloat16).state_dict()
        batch = batch_of(family, seed)
        wide = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
        original = copy.deepcopy(model)
        original.load_state_dict(state)
        reference = copy.deepcopy(original).double()
        probe = main_output(reference.eval()(**wide))
        g = torch.Generator().manual_seed(1000 + seed)
        cotangent = torch.randn(probe.shape, generator=g).to(torch.bfloat16)
        truth = outputs_and_grads(reference, wide, cotangent.double())
        row = {"original": errors(original, batch, cotangent, truth)}
        for name in CONVERSIONS:
            converted[name].load_state_dict(state)
            row[name] = errors(converted[name], batch, cotangent, truth)
            own = row["original"]["per_parameter_rms"]
            ratios = [error / own[p] for p, error in row[name]["per_parameter_rms"].items()]
            row[name]["rms_median"] = statistics.median(ratios)
            row[name]["rms_worst"] = max(ratios)
        per_seed.append(row)
    summary = {}
    for name in CONVERSIONS:
        summary[name] = {}
        for metric in METRICS:
            ratios = [row[name][metric] / row["original"].get(metric, 1.0)
                      for row in per_seed]
            summary[name][metric] = {"median": statistics.median(ratios),
                                     "min": min(ratios), "max": max(ratios)}
    return {"summary": summary, "saved_bytes": {"norms": norms_bytes, "both": both_bytes},
            "seeds": per_seed}


# ------------------------------------------------------------------ one layer at a time

ROWS, D, LAYER_SEEDS = 2048, 768, 7


def _layer_pair(kind: str, g: torch.Generator) -> tuple[nn.Module, nn.Module]:
    """``(original, iabn's layer)`` of one kind, with the same random parameters."""
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.t5.modeling_t5 import T5LayerNorm
    if kind in ("gelu", "gelu_tanh", "silu"):
        original = {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"),
                    "silu": nn.SiLU()}[kind]
        layer = {"gelu": iabn.InPlaceGELU(), "gelu_tanh": iabn.InPlaceGELU(approximate="tanh"),
                 "silu": iabn.InPlaceSiLU()}[kind]
        return original, layer
    if kind == "LayerNorm":
        original = nn.LayerNorm(D)
        layer = iabn.InPlaceLayerNorm(D, overwrite_input=False)
    elif kind == "RMSNorm":
        original = nn.RMSNorm(D, eps=1e-6)
        layer = iabn.InPlaceRMSNorm(D, eps=1e-6, overwrite_input=False)
    else:
        cls, offset, upcast = {"LlamaRMSNorm": (LlamaRMSNorm, 0.0, "normalise"),
                               "GemmaRMSNorm": (GemmaRMSNorm, 1.0, "scale"),
                               "T5LayerNorm": (T5LayerNorm, 0.0, "statistics")}[kind]
        original = cls(D, eps=1e-6)
        layer = iabn.InPlaceRMSNorm(D, eps=1e-6, overwrite_input=False, weight_offset=offset,
                                    upcast=upcast)
    with torch.no_grad():
        centre = 0.0 if kind == "GemmaRMSNorm" else 1.0
        original.weight.copy_(centre + 0.3 * torch.randn(D, generator=g))
        if getattr(original, "bias", None) is not None:
            original.bias.copy_(0.3 * torch.randn(D, generator=g))
    layer.load_state_dict(original.state_dict())
    return original, layer


def _layer_grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = module(x * 1)  # a non-leaf: the in-place layers may overwrite it
    y.backward(dy.to(y.dtype))
    grads = [x.grad] + [p.grad for p in module.parameters()]
    return [g.double() for g in grads]


def layer_errors(kind: str) -> dict:
    """Per gradient (input, weight, bias): iabn's largest error / the original's, and the same
    of the root-mean-square errors (``"input rms"``...), over the seeds."""
    ratios: list[list[float]] = []
    for seed in range(LAYER_SEEDS):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(ROWS, D, generator=g) * 2 + 0.5).to(torch.bfloat16)
        dy = torch.randn(ROWS, D, generator=g).to(torch.bfloat16)
        original, layer = _layer_pair(kind, g)
        truth = _layer_grads(copy.deepcopy(original).double(), x.double(), dy.double())
        theirs = _layer_grads(original.to(torch.bfloat16), x, dy)
        ours = _layer_grads(layer.to(torch.bfloat16), x, dy)
        ratios.append([float(norm(o - t)) / float(norm(e - t))
                       for norm in (lambda d: d.abs().max(), lambda d: d.square().mean().sqrt())
                       for o, e, t in zip(ours, theirs, truth, strict=True)])
    names = ("input", "weight", "bias")[:len(ratios[0]) // 2]
    names = [*names, *(f"{name} rms" for name in names)]
    return {name: {"median": statistics.median(r[i] for r in ratios),
                   "min": min(r[i] for r in ratios), "max": max(r[i] for r in ratios)}
            for i, name in enumerate(names)}


def _inverse(phi, z: torch.Tensor, left: torch.Tensor, y_star: float) -> torch.Tensor:
    """``phi``'s inverse of ``z`` (float64, clamped to the minimum) on each element's branch,
    by bisection."""
    low = torch.where(left, -40.0, y_star).to(z.dtype)
    high = torch.where(left, y_star, 40.0).to(z.dtype)
    for _ in range(80):
        middle = (low + high) / 2
        rising = torch.where(left, phi(middle) > z, phi(middle) < z)  # go right
        low, high = torch.where(rising, middle, low), torch.where(rising, high, middle)
    return (low + high) / 2


def activation_bound(kind: str) -> dict:
    """The largest input-gradient error (over the largest float64 value) of PyTorch's module,
    iabn's layer, and the least that a layer keeping only the output and the bit can
    guarantee (module docstring); one seed of ``ROWS x D``."""
    import torch.nn.functional as F

    from iabn.kernels.activations import ACTIVATIONS
    phi = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
           "silu": F.silu}[kind]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(ROWS, D, generator=g) * 2 + 0.5).to(torch.bfloat16)
    dy = torch.randn(ROWS, D, generator=g).to(torch.bfloat16)
    original, layer = _layer_pair(kind, g)
    (truth,) = _layer_grads(original.double(), x.double(), dy.double())
    (theirs,) = _layer_grads(original, x, dy)
    (ours,) = _layer_grads(layer, x, dy)
    minimum = ACTIVATIONS[kind].minimum
    z = phi(x)  # bfloat16, rounded once
    bits = z.view(torch.int16)
    # the rounding interval's ends, halfway to the neighbouring bfloat16 values
    ends = [((bits + step).view(torch.bfloat16).double() + z.double()) / 2 for step in (-1, 1)]
    left = x.double() < minimum.y_star
    slopes = []
    for end in ends:
        y = _inverse(phi, end.clamp_min(minimum.z_star), left, minimum.y_star)
        y.requires_grad_()
        (slope,) = torch.autograd.grad(phi(y).sum(), y)
        slopes.append(slope)
    bound = dy.double().abs() * (slopes[0] - slopes[1]).abs() / 2
    scale = float(truth.abs().max())
    return {"pytorch": float((theirs - truth).abs().max()) / scale,
            "iabn": float((ours - truth).abs().max()) / scale,
            "any_output_only_layer_at_least": float(bound.max()) / scale}


LAYER_KINDS = ("LayerNorm", "RMSNorm", "LlamaRMSNorm", "GemmaRMSNorm", "T5LayerNorm", "gelu",
               "gelu_tanh", "silu")


def layers_report() -> dict:
    print(f"\none layer, {ROWS}x{D} bfloat16: iabn's largest (and root-mean-square) gradient "
          f"error / the original's, median over {LAYER_SEEDS} seeds [min, max]")
    rows = {}
    for kind in LAYER_KINDS:
        rows[kind] = {"ratios": layer_errors(kind)}
        print(f"{kind:<13} " + "  ".join(
            f"{name} {c['median']:5.2f} [{c['min']:4.2f}, {c['max']:4.2f}]"
            for name, c in rows[kind]["ratios"].items()))
    print("activations: largest input-gradient error over the largest gradient (seed 0)")
    for kind in ("gelu", "gelu_tanh", "silu"):
        bound = activation_bound(kind)
        rows[kind]["bound"] = bound
        print(f"{kind:<13} PyTorch {bound['pytorch']:.2e}  iabn {bound['iabn']:.2e}  any "
              f"output-only layer >= {bound['any_output_only_layer_at_least']:.2e} "
              f"({bound['any_output_only_layer_at_least'] / bound['pytorch']:.2f}x PyTorch's)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--families", nargs="*", default=list(hf_models.FAMILIES),
                        choices=list(hf_models.FAMILIES), metavar="FAMILY",
                        help=f"of {', '.join(hf_models.FAMILIES)} (default: all)")
    parser.add_argument("--layers", action="store_true",
                        help="also each norm and activation alone (the cause)")
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()
    set_threads(1)
    import transformers
    start = time.perf_counter()
    rows = {}
    print(f"ratio to the original's error, median over {options.seeds} seeds [min, max]")
    print(f"{'family':<11} {'conversion':<12} " + " ".join(f"{m:>20}" for m in METRICS))
    for family in options.families:
        rows[family] = measure(family, options.seeds)
        for name in CONVERSIONS:
            cells = [rows[family]["summary"][name][m] for m in METRICS]
            kept = rows[family]["saved_bytes"].get(name)
            print(f"{family:<11} {name:<12} " + " ".join(
                f"{c['median']:5.2f} [{c['min']:4.2f}, {c['max']:4.2f}]" for c in cells)
                + ("" if kept is None else f"  bytes {kept:.3f}"))
    layers = layers_report() if options.layers else None
    seconds = time.perf_counter() - start
    load = os.getloadavg()
    print(f"{seconds:.0f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"(error figures are deterministic; the load moves only the time)")
    report = {"transformers": transformers.__version__, "seeds": options.seeds,
              "families": rows, "layers": layers, "seconds": seconds, "load_average": load,
              "machine": machine_info()}
    write_json(options.json or RESULTS / "hf_bf16_error_cpu.json", report)


if __name__ == "__main__":
    main()
