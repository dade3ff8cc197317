"""The ``iabn`` command line (also ``python -m iabn``).

``iabn bench`` compares the activation memory and speed of standard BatchNorm, checkpointing
and InPlace-ABN on a small stack of blocks; see :mod:`iabn.bench.blocks`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__
from .bench import set_threads
from .bench.blocks import BASELINE, BenchConfig, format_table, run_bench, to_json

_DEFAULTS = BenchConfig()


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type`` accepting integers ``>= minimum`` with a readable error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _add_int(
    group: argparse._ArgumentGroup, flag: str, default: int, text: str,
    kind: Callable[[str], int] = _positive_int,
) -> None:
    group.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="compare activation memory and speed of BN, checkpointing and InPlace-ABN",
        description=(
            "Run the same stack of [norm -> LeakyReLU(0.01) -> conv 3x3] blocks with "
            "nn.BatchNorm2d (out-of-place and in-place activation), torch.utils.checkpoint and "
            "iabn.InPlaceABN (variants I and II) on CPU; report the activation memory autograd "
            f"saves for backward and the median forward+backward time, relative to {BASELINE}."
        ),
        epilog="Exit status: 0 on success, 1 if the strategies' losses or input gradients "
        "disagree (the comparison would be meaningless), 2 for bad arguments.",
    )
    size = bench.add_argument_group("model and input")
    _add_int(size, "--batch", _DEFAULTS.batch, "N")
    _add_int(size, "--channels", _DEFAULTS.channels, "C")
    _add_int(size, "--size", _DEFAULTS.size, "H = W")
    _add_int(size, "--blocks", _DEFAULTS.blocks, "norm -> act -> conv blocks")
    _add_int(size, "--seed", _DEFAULTS.seed, "weights and data seed", kind=int)
    timing = bench.add_argument_group("timing")
    _add_int(timing, "--repeats", _DEFAULTS.repeats,
             "timed repeats, round-robin over strategies; the median is shown")
    _add_int(timing, "--iters", _DEFAULTS.iters, "steps per repeat; a repeat's time is their mean")
    _add_int(timing, "--warmup", _DEFAULTS.warmup, "untimed steps per strategy before timing",
             kind=_non_negative_int)
    timing.add_argument("--threads", type=_positive_int, default=None,
                        help="torch intra-op threads (default: torch's own choice)")
    output = bench.add_argument_group("output")
    output.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write all results and machine info as JSON to PATH")
    output.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.set_defaults(handler=_bench)


def _add_segment_parser(subparsers: argparse._SubParsersAction) -> None:
    from .segment import FUSIONS, OUTPUTS, VISTAS_MEAN, VISTAS_STD, parse_floats

    seg = subparsers.add_parser(
        "segment", help="semantic segmentation of a folder of images (DeepLabV3)",
        description="Segment every .png/.jpg/.jpeg in IN_DIR with a DeepLabV3 + WideResNet-A2 "
        "snapshot (iabn's, or the original package's Vistas file) and write the results to "
        "OUT_DIR. Exit status 1 when an image could not be read (the others are processed).",
    )
    seg.add_argument("snapshot", help="model snapshot (.pth / .pth.tar)")
    seg.add_argument("in_dir", help="folder of input images")
    seg.add_argument("out_dir", help="folder for the outputs (mirrors IN_DIR's layout)")
    seg.add_argument("--recursive", action="store_true", help="also process subfolders")
    seg.add_argument("--long-side", type=_non_negative_int, default=2048,
                     help="resize so the longer side has this many pixels; 0 keeps the size "
                     "(default: 2048)")
    seg.add_argument("--scales", type=parse_floats, default=[1.0],
                     help="test-time scales, e.g. 0.7,1.0,1.2 (default: 1.0)")
    seg.add_argument("--flip", action="store_true", help="also predict on the mirrored image")
    seg.add_argument("--fusion", choices=FUSIONS, default="mean",
                     help="how to combine scales/flips (default: mean of probabilities)")
    seg.add_argument("--output", choices=OUTPUTS, default="palette",
                     help="palette PNG, raw class-index PNG, or indices + confidence PNG")
    seg.add_argument("--overlay", action="store_true",
                     help="also write the image and the coloured prediction side by side")
    seg.add_argument("--overwrite", action="store_true", help="redo existing outputs")
    seg.add_argument("--mean", type=parse_floats, default=list(VISTAS_MEAN),
                     help="input normalisation mean, RGB in [0, 1] (default: Vistas model's)")
    seg.add_argument("--std", type=parse_floats, default=list(VISTAS_STD),
                     help="input normalisation std (default: Vistas model's)")
    seg.add_argument("--depth", type=int, choices=(16, 20, 38), default=38,
                     help="WideResNet trunk depth of the snapshot (default: 38)")
    seg.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    seg.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    seg.set_defaults(handler=_segment)


def _segment(args: argparse.Namespace) -> int:
    from .segment import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``iabn`` argument parser (one subcommand per tool)."""
    parser = argparse.ArgumentParser(
        prog="iabn",
        description="In-Place Activated BatchNorm: tools to train CNNs with less memory.",
    )
    parser.add_argument("--version", action="version", version=f"iabn {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_bench_parser(subparsers)
    _add_segment_parser(subparsers)
    return parser


def _bench(args: argparse.Namespace) -> int:
    if args.batch * args.size * args.size < 2:
        # Batch statistics need two values per channel; say so before building anything.
        print("iabn bench: error: --batch x --size^2 must be at least 2", file=sys.stderr)
        return 2
    set_threads(args.threads)
    config = BenchConfig(
        batch=args.batch, channels=args.channels, size=args.size, blocks=args.blocks,
        repeats=args.repeats, iters=args.iters, warmup=args.warmup, seed=args.seed,
    )
    start = time.perf_counter()
    result = run_bench(config, progress=not args.quiet)
    print(format_table(result))
    if args.json is not None:
        arguments = {k: str(v) if isinstance(v, Path) else v
                     for k, v in vars(args).items() if k != "handler"}
        report = to_json(result, args=arguments)
        report["wall_time_s"] = round(time.perf_counter() - start, 2)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results written to {args.json}")
    # A benchmark whose strategies disagree measured something broken: fail loudly.
    return 0 if result.check.passed else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``iabn`` command; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return 0
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
