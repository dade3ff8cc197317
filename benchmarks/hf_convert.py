"""Hugging Face models through ``iabn.convert``: the activation bytes kept for backward, plain
and after swapping the models' own norm and activation classes for PyTorch's by hand.

Hugging Face models define their own RMSNorm, GELU, SiLU and channels-first LayerNorm
classes; ``iabn.convert`` recognises them by what they compute
(:mod:`iabn.conversion.recognise`). For each family of tests/support/hf_models.py (small
configs, random weights, no download) this measures, in one run and at one batch:

- ``plain``: ``iabn.convert(model, example_kwargs=batch)``'s bytes saved for backward over
  the original's (:func:`iabn.memory.saved_tensor_bytes`, training mode, the report's
  totals);
- ``hand_swap``: the same conversion of the model after its classes are swapped for
  ``nn.RMSNorm``, ``nn.LayerNorm``, timm's ``LayerNorm2d``, ``nn.GELU`` and ``nn.SiLU``
  by hand (``tests/support/hf_models.hand_swapped``), over the same original bytes;
- how many modules each conversion replaced, and the largest output difference (verify).

Token models run twice: with a tokenizer's batch (``input_ids`` and ``attention_mask``),
where Hugging Face's masking reads the mask's values and the conversion goes part by part
(each decoder layer on its own; the first norm of each layer and the final norm stay), and
with ``input_ids`` alone, converted whole.

Bytes are exact counts (no timing), so the machine's load does not move them.

Usage::

    python benchmarks/hf_convert.py [--dtype float32] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

import iabn
from iabn.tools.bench import machine_info, results_folder, set_threads, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the models' definitions
import hf_models  # noqa: E402

RESULTS = results_folder(Path(__file__).resolve().parent / "results")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def measure(family: str, dtype: torch.dtype, mask: bool) -> dict:
    build, example = hf_models.FAMILIES[family]
    batch = example(dtype, mask) if example is hf_models.ids else example(dtype)
    model = build(dtype)
    start = time.perf_counter()
    _, plain = iabn.convert(model, example_kwargs=batch)
    seconds = time.perf_counter() - start
    swapped = hf_models.hand_swapped(copy.deepcopy(model))
    _, by_hand = iabn.convert(swapped, example_kwargs=batch)
    before = plain.saved_before
    return {
        "saved_before": before,
        "plain": plain.saved_after / before,
        "hand_swap": by_hand.saved_after / before,
        "hand_swap_own_before": by_hand.saved_after / by_hand.saved_before,
        "replaced_plain": sum(r.decision != "untouched" for r in plain.rows),
        "replaced_hand_swap": sum(r.decision != "untouched" for r in by_hand.rows),
        "max_difference_train": plain.max_difference_train,
        "convert_seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--families", nargs="*", default=list(hf_models.FAMILIES),
                        choices=list(hf_models.FAMILIES), metavar="FAMILY",
                        help=f"of {', '.join(hf_models.FAMILIES)} (default: all)")
    parser.add_argument("--json", type=Path, default=None)
    options = parser.parse_args()
    set_threads(1)
    import transformers
    rows: dict[str, dict] = {}
    print(f"{'family':<12} {'batch':<10} {'plain':>7} {'by hand':>8} {'gap':>7} "
          f"{'replaced':>9}  max diff")
    for family in options.families:
        token = hf_models.FAMILIES[family][1] is hf_models.ids
        for mask in (True, False) if token else (True,):
            batch = "ids+mask" if token and mask else "ids" if token else "pixels"
            row = measure(family, DTYPES[options.dtype], mask)
            rows.setdefault(family, {})[batch] = row
            print(f"{family:<12} {batch:<10} {row['plain']:7.3f} {row['hand_swap']:8.3f} "
                  f"{row['plain'] - row['hand_swap']:+7.3f} "
                  f"{row['replaced_plain']:>4}/{row['replaced_hand_swap']:<4}  "
                  f"{row['max_difference_train']:.3g}")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (bytes are exact counts)")
    report = {"dtype": options.dtype, "transformers": transformers.__version__,
              "families": rows, "load_average": load, "machine": machine_info()}
    suffix = "" if options.dtype == "float32" else f"_{options.dtype}"
    write_json(options.json or RESULTS / f"hf_convert{suffix}_cpu.json", report)


if __name__ == "__main__":
    main()
