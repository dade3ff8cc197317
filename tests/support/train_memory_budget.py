"""The largest training batch that fits standard BN's activation memory, per norm-act layer.

    python tests/support/train_memory_budget.py [--size 32] [--batch 64] [ARCH ...]

For each model, measures with :func:`iabn.memory.saved_tensor_bytes` (exact bytes autograd
keeps for backward, training mode) the activation memory of ``nn.BatchNorm2d`` + ReLU at
``--batch`` images of ``--size`` pixels (the budget), then finds the largest batch each layer
trains within that budget. Saved bytes are affine in the batch (activations scale with it,
per-channel statistics do not), so two measurements give the answer and a third at that batch
(and one more image) confirms it. Prints a markdown table (the real-check figures of
docs/usage/training.md).
"""

from __future__ import annotations

import argparse

import torch

from iabn.memory import saved_tensor_bytes
from iabn.models import create

VARIANTS = (("bn", "relu"), ("bn", "leaky_relu"), ("iabn", "leaky_relu"))


def saved_bytes(arch: str, norm_act: str, activation: str, batch: int, size: int) -> int:
    torch.manual_seed(0)
    model = create(arch, num_classes=10, norm_act=norm_act, activation=activation).train()
    return saved_tensor_bytes(model, torch.randn(batch, 3, size, size))


def largest_batch(arch: str, norm_act: str, activation: str, budget: int, size: int) -> int:
    # Batches of 2 and 4: training-mode BN needs two values per channel, and the deepest
    # layers of these models are 1x1 at small sizes.
    two, four = (saved_bytes(arch, norm_act, activation, b, size) for b in (2, 4))
    per_image = (four - two) // 2
    fixed = two - 2 * per_image
    batch = (budget - fixed) // per_image
    assert saved_bytes(arch, norm_act, activation, batch, size) <= budget
    assert saved_bytes(arch, norm_act, activation, batch + 1, size) > budget
    return batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", default=["resnet18", "resnext50", "densenet121",
                                                     "mobilenet_v2"])
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    print(f"| model | budget: bn + relu, batch {args.batch} at {args.size}x{args.size} | "
          + " | ".join(f"{n} + {a}: batch in budget" for n, a in VARIANTS) + " | iabn / bn |")
    print("|---" * (len(VARIANTS) + 3) + "|")
    for arch in args.archs:
        budget = saved_bytes(arch, "bn", "relu", args.batch, args.size)
        batches = [largest_batch(arch, n, a, budget, args.size) for n, a in VARIANTS]
        print(f"| {arch} | {budget / 2**20:.1f} MiB | " + " | ".join(map(str, batches))
              + f" | {batches[-1] / batches[0]:.2f}x |")


if __name__ == "__main__":
    main()
