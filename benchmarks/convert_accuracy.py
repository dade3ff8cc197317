"""What ``iabn.convert(..., policy="leaky_relu")`` costs in accuracy: real handwritten digits.

The lossless policy keeps the model (ReLU stays, in ``ABN``); ``policy="leaky_relu"`` swaps
each ReLU after a norm for LeakyReLU(0.01) so the layer can go in place, which changes the
function the trained weights compute. This measures by how much, on scikit-learn's digits
(1,797 real 8x8 scans; no download), for a small ResNet built from torchvision's own
``BasicBlock`` (ReLU, one ReLU module shared inside each block, as in torchvision's ResNets):

1. train the ReLU model (``--epochs``), validation accuracy ``relu``;
2. convert losslessly: accuracy ``lossless`` (must equal ``relu``);
3. convert with ``policy="leaky_relu"``: accuracy ``leaky, no fine-tuning``;
4. fine-tune the converted model ``--finetune`` epochs at a tenth of the learning rate:
   ``leaky, fine-tuned``; the ReLU model fine-tuned the same way is the control
   (``relu, fine-tuned``), so the extra epochs are not credited to the conversion.

Repeated over ``--seeds`` seeds (weights, data order); medians and every seed are printed and
saved as JSON with the machine, versions and date.

Usage::

    python benchmarks/convert_accuracy.py [--seeds 5] [--epochs 15] [--finetune 2]
        [--json runs/benchmarks/convert_accuracy.json]
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path
from statistics import median

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock

import iabn
from iabn.tools.bench import machine_info, results_folder, set_threads, write_json
from iabn.tools.data.digits import load_digits_uint8, split_indices

RESULTS = results_folder(Path(__file__).resolve().parent / "results")


def small_resnet(seed: int) -> nn.Module:
    """conv-BN-ReLU stem and three torchvision BasicBlocks (the last one strided)."""
    torch.manual_seed(seed)
    downsample = nn.Sequential(nn.Conv2d(32, 64, 1, stride=2, bias=False), nn.BatchNorm2d(64))
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        BasicBlock(32, 32), BasicBlock(32, 32), BasicBlock(32, 64, stride=2, downsample=downsample),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    images, labels = load_digits_uint8()
    x = torch.from_numpy(images).float().div_(255).unsqueeze(1)
    y = torch.from_numpy(labels)
    train, val = split_indices(labels, seed=0)
    return x[train], y[train], x[val], y[val]


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float,
          seed: int, batch: int = 64) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * -(-len(x) // batch))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for index in torch.randperm(len(x), generator=generator).split(batch):
            if len(index) < 2:
                continue  # batch statistics need two values per channel
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
            schedule.step()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean())


def run_seed(seed: int, data, epochs: int, finetune: int, lr: float) -> dict[str, float]:
    x, y, vx, vy = data
    model = small_resnet(seed)
    train(model, x, y, epochs, lr, seed)
    result = {"relu": accuracy(model, vx, vy)}
    lossless, _ = iabn.convert(model, x[:64], verify=False)
    result["lossless"] = accuracy(lossless, vx, vy)
    leaky, report = iabn.convert(model, x[:64], policy="leaky_relu", verify=False)
    result["leaky, no fine-tuning"] = accuracy(leaky, vx, vy)
    control = copy.deepcopy(model)
    train(leaky, x, y, finetune, lr / 10, seed + 1000)
    train(control, x, y, finetune, lr / 10, seed + 1000)
    result["leaky, fine-tuned"] = accuracy(leaky, vx, vy)
    result["relu, fine-tuned"] = accuracy(control, vx, vy)
    result["saved bytes leaky/relu"] = report.saved_after / report.saved_before
    result["in place layers"] = report.counts.get("InPlaceABN", 0)
    return result


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=_positive(int), default=5, help="(default: 5)")
    parser.add_argument("--epochs", type=_positive(int), default=15,
                        help="training epochs of the ReLU model (default: 15)")
    parser.add_argument("--finetune", type=_positive(int), default=2,
                        help="fine-tuning epochs after conversion, and of the control (default: 2)")
    parser.add_argument("--lr", type=_positive(float), default=0.05,
                        help="SGD learning rate; fine-tuning uses a tenth (default: 0.05)")
    parser.add_argument("--threads", type=_positive(int), default=None)
    parser.add_argument("--json", type=Path, default=RESULTS / "convert_accuracy.json")
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    data = digits()
    started = time.perf_counter()
    seeds = []
    for seed in range(args.seeds):
        seeds.append(run_seed(seed, data, args.epochs, args.finetune, args.lr))
        print(f"seed {seed}: " + ", ".join(f"{k} {v:.4f}" for k, v in seeds[-1].items()),
              flush=True)
    medians = {key: median(s[key] for s in seeds) for key in seeds[0]}
    print(f"\nmedian over {args.seeds} seeds ({len(data[2])} validation digits):")
    for key, value in medians.items():
        print(f"  {key:24} {value:.4f}")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    write_json(args.json, {
        "benchmark": "convert_accuracy", "machine": machine_info(), "threads": threads,
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "median": medians, "seeds": seeds,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
