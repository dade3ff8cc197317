"""Plot benchmarks/results/gpu_speed.json: full-step time of each provider relative to eager
``nn.BatchNorm2d`` + ``LeakyReLU`` per shape, one panel per (dtype, layout).

Needs matplotlib (``pip install matplotlib``; not a dependency of iabn).

Usage::

    python benchmarks/plot_gpu_speed.py [RESULTS.json] [--out PNG]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from iabn.tools.bench import results_folder

RESULTS = results_folder(Path(__file__).resolve().parent / "results")


def relative_full_times(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict[str, float]]]:
    """``{(dtype, layout): {provider: {shape: full-step time / eager's}}}``."""
    eager = {(r["shape"], r["dtype"], r["layout"]): r["median_ms"] for r in rows
             if r["provider"] == "eager" and r["mode"] == "full"}
    panels: dict[tuple[str, str], dict[str, dict[str, float]]] = {}
    for r in rows:
        base = eager.get((r["shape"], r["dtype"], r["layout"]))
        if r["mode"] != "full" or base is None:
            continue
        panel = panels.setdefault((r["dtype"], r["layout"]), {})
        panel.setdefault(r["provider"], {})[r["shape"]] = r["median_ms"] / base
    return panels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, nargs="?", default=RESULTS / "gpu_speed.json")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_speed.png")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plotting needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    report = json.loads(args.results.read_text())
    panels = relative_full_times(report["rows"])
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, ((dtype, layout), providers) in zip(axes[0], sorted(panels.items()), strict=True):
        shapes = list(next(iter(providers.values())))
        width = 0.8 / len(providers)
        for i, (provider, ratios) in enumerate(providers.items()):
            xs = [j + i * width for j in range(len(shapes))]
            ax.bar(xs, [ratios[s] for s in shapes], width, label=provider)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.9, color="grey", linestyle="--", linewidth=0.8)  # the target
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=30,
                      fontsize=7)
        ax.set_title(f"{dtype}, {layout}")
        ax.set_ylabel("full step time / eager BN")
    axes[0][0].legend(fontsize=8)
    machine = report["machine"]
    fig.suptitle(f"{machine.get('device_name')} — torch {machine.get('torch_version')}, "
                 f"triton {machine.get('triton_version')}, {machine.get('date_utc', '')[:10]}",
                 fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
