"""Launches, memory traffic and backward memory of the layers ``iabn.convert`` puts into
transformers, against PyTorch's, counted exactly on CPU by :mod:`iabn.measure.traffic` (its
docstring has the rules) for one ``layer(leaf.clone()).backward(grad)``:

``layer_norm``   ``nn.LayerNorm`` / ``iabn.InPlaceLayerNorm`` (output-only and in place), a
                 ViT-S token stream (batch 8, 197 tokens, 384 features; random weights in
                 [0.5, 1.5], biases of 0.1 x N(0, 1), so every feature is rebuilt)
``rms_norm``     ``nn.RMSNorm`` / ``iabn.InPlaceRMSNorm``, the same shape
``gelu``         ``nn.GELU()`` / ``iabn.InPlaceGELU()``, the MLP's hidden activation (1536)
``gelu_tanh``    ``nn.GELU(approximate="tanh")`` / ``iabn.InPlaceGELU("tanh")``
``silu``         ``nn.SiLU()`` / ``iabn.InPlaceSiLU()``

and ``iabn_triton``: the same layer on the Triton backend (``IABN_BACKEND=triton``; Triton's
CPU interpreter runs it here, ``TRITON_INTERPRET=1`` is set before Triton is imported): the
activations' backward in one launch, the output-only norms' in one launch and a ``sum`` of
its per-program partials for the weight and bias gradients (their forward is PyTorch's)

in float32 (and bfloat16 without ``--quick``). A row gives the launches (ATen operators that
compute: host dispatches, each a kernel or more on a GPU), the bytes of full-size tensors
read + written in activations (one input tensor's bytes), and the backward's peak of
full-size memory. The in-place activations' reference backward recovers their input by
Newton steps written as ATen operations (``kernels/branch.py``), the norms' rebuilds ``xhat``
as a tensor (``kernels/row_norm.py``): these counts are what an eager GPU step would launch
and move on the reference backend, which ``torch.compile`` fuses and the Triton backward does
in one launch; no GPU was used.

Usage::

    python benchmarks/transformer_traffic.py [--tokens 197] [--json PATH] [--quick]
        [--kinds layer_norm,rms_norm]

``--kinds``: only these rows (the norms' alone take a minute; the activations' Triton rows run
the interpreter over 2.4M elements each, minutes apiece).
"""

from __future__ import annotations

import os

# Triton reads this when its kernels are defined: before anything imports them.
os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn

import iabn
from iabn.kernels.backends import has_triton, use_backend
from iabn.measure import traffic
from iabn.tools.bench import machine_info, results_folder, write_json

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
BATCH, DIM, HIDDEN = 8, 384, 1536
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KINDS = ("layer_norm", "rms_norm", "gelu", "gelu_tanh", "silu")


def _norm_weights(layer: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(layer.weight.shape, generator=g) + 0.5)
        if getattr(layer, "bias", None) is not None:
            layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g))
    return layer


def providers() -> dict[str, tuple[int, dict[str, nn.Module]]]:
    """``{kind: (features, {provider: layer})}``; ``iabn_triton``: the layer's backward on the
    Triton backend (``IABN_BACKEND=triton``, run by the CPU interpreter here; the norms'
    output-only layer)."""
    kinds = {
        "layer_norm": (DIM, {
            "torch": nn.LayerNorm(DIM),
            "iabn_output_only": iabn.InPlaceLayerNorm(DIM, overwrite_input=False),
            "iabn_in_place": iabn.InPlaceLayerNorm(DIM)}),
        "rms_norm": (DIM, {
            "torch": nn.RMSNorm(DIM),
            "iabn_output_only": iabn.InPlaceRMSNorm(DIM, overwrite_input=False),
            "iabn_in_place": iabn.InPlaceRMSNorm(DIM)}),
        "gelu": (HIDDEN, {"torch": nn.GELU(), "iabn_in_place": iabn.InPlaceGELU()}),
        "gelu_tanh": (HIDDEN, {"torch": nn.GELU(approximate="tanh"),
                               "iabn_in_place": iabn.InPlaceGELU(approximate="tanh")}),
        "silu": (HIDDEN, {"torch": nn.SiLU(), "iabn_in_place": iabn.InPlaceSiLU()}),
    }
    if has_triton():
        for kind, (_, layers) in kinds.items():
            source = "iabn_output_only" if "norm" in kind else "iabn_in_place"
            layers["iabn_triton"] = copy.deepcopy(layers[source])
    return kinds


def count_row(layer: nn.Module, shape: tuple[int, ...], dtype: torch.dtype) -> dict:
    """One step counted warm: a step on one token first, uncounted, so that work done once
    per process (the Triton backend's constant tables, made on the host and cached per dtype
    and device: four ``aten._local_scalar_dense`` of host scalars in a cold count) is not
    counted as the step's."""
    torch.manual_seed(0)
    leaf = torch.randn(shape).to(dtype).requires_grad_()
    grad = torch.randn(shape).to(dtype)
    token = (slice(0, 1),) * (len(shape) - 1)
    layer(leaf[token].detach().clone().requires_grad_() * 1).backward(grad[token])
    step = traffic.count_step(layer, leaf, grad)
    activation = leaf.numel() * leaf.element_size()
    moved = step.forward.moved + step.backward.moved
    return {
        "launches_forward": len(step.forward.launches),
        "launches_backward": len(step.backward.launches),
        "launches": len(step.forward.launches) + len(step.backward.launches),
        "activations_moved": moved / activation,
        "activations_moved_backward": step.backward.moved / activation,
        "backward_peak_activations": step.backward.peak_bytes / activation,
        "backward_ops": step.backward.names(),
    }


def measure(tokens: int, quick: bool, kinds: list[str] | None = None) -> list[dict]:
    rows = []
    dtypes = {"float32": torch.float32} if quick else DTYPES
    for kind, (features, layers) in providers().items():
        if kinds is not None and kind not in kinds:
            continue
        shape = (2 if quick else BATCH, tokens, features)
        for dtype_name, dtype in dtypes.items():
            for name, layer in layers.items():
                if "norm" in kind:
                    _norm_weights(layer)
                row = {"kind": kind, "provider": name, "dtype": dtype_name,
                       "shape": list(shape)}
                with use_backend("triton" if name == "iabn_triton" else "reference"):
                    row.update(count_row(layer, shape, dtype))
                rows.append(row)
                print(f"{kind:10} {name:17} {dtype_name:9} launches {row['launches']:4} "
                      f"({row['launches_forward']} + {row['launches_backward']})  moved "
                      f"{row['activations_moved']:6.2f} act  backward peak "
                      f"{row['backward_peak_activations']:5.2f} act", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=197)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="batch 2, float32 only")
    parser.add_argument("--kinds", default=None,
                        help=f"comma-separated, of {','.join(KINDS)} (default: all)")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens {args.tokens}: must be >= 1")
    kinds = None if args.kinds is None else args.kinds.split(",")
    unknown = sorted(set(kinds or ()) - set(KINDS))
    if unknown:
        parser.error(f"--kinds {args.kinds}: unknown {unknown}; choose from {','.join(KINDS)}")
    rows = measure(args.tokens, args.quick, kinds)
    write_json(args.json or RESULTS / "transformer_traffic.json",
               {"machine": machine_info("cpu"), "tokens": args.tokens, "quick": args.quick,
                "kinds": kinds or list(KINDS), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
