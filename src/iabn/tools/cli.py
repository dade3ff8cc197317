"""The ``iabn`` command line (also ``python -m iabn``).

``iabn bench`` compares the activation memory and speed of standard BatchNorm, checkpointing
and InPlace-ABN on a small stack of blocks; see :mod:`iabn.tools.bench.blocks`. ``iabn memory``
measures the activation memory of an existing torchvision/timm/own model before and after
:func:`iabn.convert` and the batch that fits the same memory; see
:mod:`iabn.tools.bench.model_memory`. ``iabn plan`` fits a model's activation memory into a
budget with :func:`iabn.plan`; see :mod:`iabn.tools.bench.model_plan`. ``iabn segment``
segments a folder of images. ``iabn train``, ``iabn train-seg`` and ``iabn test`` train and
evaluate classifiers and segmentation models; see :mod:`iabn.tools.training`.

Building the parser and checking what can be checked without torch (shapes, budgets, model
names, paths, config files: :mod:`iabn.tools.arguments`) imports no torch, so a bad argument
is one line on stderr in a fraction of a second; each command imports what it runs after that.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import __version__
from . import arguments
from .arguments import BASELINE, BenchConfig
from .outputs import OutputPathError, check_output_file, write_text_atomic

_DEFAULTS = BenchConfig()


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line on stderr naming it and the fix
    (where argparse prints its usage block first), and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def _add_output_options(group: argparse._ActionsContainer, what: str, **json_kw) -> None:
    """``--json PATH`` (``what`` is written there), ``--overwrite`` and ``--quiet``: the output
    options of every command that writes a JSON file."""
    group.add_argument("--json", default=None, metavar="PATH",
                       help=f"also write {what} as JSON to PATH (its folder must exist; "
                       "checked before the work starts)", **json_kw)
    group.add_argument("--overwrite", action="store_true",
                       help="replace an existing --json file (default: refuse it)")
    group.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def _origin(text: str) -> str:
    """``--origin``: normalised by :func:`iabn.models.checkpoints.resolve_origin` (which
    imports torch, so only when the option is given)."""
    if text.lower() == "auto":
        return "auto"
    from ..models.checkpoints import resolve_origin

    try:
        return resolve_origin(text, {})[0]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="compare activation memory and speed of BN, checkpointing and InPlace-ABN",
        description=(
            "Run the same stack of [norm -> LeakyReLU(0.01) -> conv 3x3] blocks with "
            "nn.BatchNorm2d (out-of-place and in-place activation), torch.utils.checkpoint and "
            "iabn.InPlaceABN (variants I and II) on CPU; report the activation memory autograd "
            f"saves for backward and the median forward+backward time, relative to {BASELINE}. "
            "When the 1-minute load average, read before and after the run, shows other work on "
            "the cores the run uses, a note on stderr (and machine_load in the JSON) says so."
        ),
        epilog="Exit status: 0 on success, 1 if the strategies' losses or input gradients "
        "disagree (the comparison would be meaningless), 2 for bad arguments (checked before "
        "the run) or a --json file that could not be written.",
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
    _add_output_options(output, "all results and machine info")
    bench.set_defaults(handler=_bench)


def _input_shape(text: str) -> tuple[int, ...]:
    try:
        return arguments.parse_input(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _budgets(text: str) -> list[float]:
    try:
        return arguments.parse_budgets([text])
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_memory_parser(subparsers: argparse._SubParsersAction) -> None:
    memory = subparsers.add_parser(
        "memory", help="activation memory of a model before and after iabn.convert",
        description="Build MODEL with random weights (nothing is downloaded), count the exact "
        "bytes autograd keeps for backward in one training forward at --input, convert it "
        "with iabn.convert under both policies (lossless; leaky_relu: ReLU after a norm "
        "becomes LeakyReLU(0.01) so the norm can go in place) and count again; print the "
        "largest batch the converted models fit in the memory the model as given needs. "
        "Parameters, gradients and optimiser state are not counted.",
        epilog="Exit status: 0 done, 2 bad arguments (model name, a factory that fails, an "
        "--input the model cannot take, --device, --json path), checked before the "
        "measuring, or a --json file that could not be written.",
    )
    memory.add_argument("model", metavar="MODEL",
                        help="a torchvision classification model name (e.g. resnet50), a timm "
                        "name (when timm is installed; torchvision wins where both have it) or "
                        "pkg.module:factory, called with no arguments to return an nn.Module "
                        "(e.g. timm.models:resnet50 for timm's)")
    memory.add_argument("--input", type=_input_shape, default=(8, 3, 224, 224),
                        metavar="N,C,H,W", help="input shape, batch first (default: 8,3,224,224)")
    memory.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "fp64"), default="fp32",
                        help="the model's and the input's dtype (default: fp32)")
    memory.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    memory.add_argument("--compile-budget", type=_budgets, action="append", default=[],
                        metavar="B[,B...]",
                        help="also count what torch.compile keeps for backward of the model as "
                        "given, at torch.compile's activation_memory_budget B in [0, 1] (1: "
                        "its default; lower recomputes more); repeatable. Slow: it compiles "
                        "(default: not measured)")
    memory.add_argument("--table", action="store_true",
                        help="also print the leaky_relu conversion's per-layer table")
    _add_output_options(memory, "all figures, the conversion reports, machine info, versions "
                        "and the date")
    memory.set_defaults(handler=_memory)


def _plan_budget(text: str) -> int | float:
    try:
        return arguments.parse_budget(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _plan_allow(text: str) -> tuple[str, ...]:
    try:
        return arguments.parse_allow(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan", help="fit a model's activation memory into a budget (in place, recompute, "
        "offload)",
        description="Build MODEL with random weights (nothing is downloaded) and plan its "
        "training at --input with iabn.plan: each unit (a block, a conv-norm-activation "
        "group) is kept, converted in place, recomputed in backward (alone or with its "
        "neighbours), or offloaded to host memory (CUDA only), so that the bytes autograd "
        "keeps for backward fit --budget at the least predicted extra time. Bytes are exact "
        "(counted on meta where that equals the device's count); times are predicted from "
        "the operations and the device's measured speed. Prints one row per decision.",
        epilog="Exit status: 0 done, 2 bad arguments (model name, a factory that fails, an "
        "--input the model cannot take, --device, --budget out of reach, --json path), "
        "checked before the planning where possible, or a --json file that could not be "
        "written.",
    )
    plan.add_argument("model", metavar="MODEL",
                      help="a torchvision classification model name (e.g. resnet50), a timm "
                      "name or pkg.module:factory, as for iabn memory")
    plan.add_argument("--input", type=_input_shape, default=(8, 3, 224, 224),
                      metavar="N,C,H,W", help="input shape, batch first (default: 8,3,224,224)")
    plan.add_argument("--budget", type=_plan_budget, default=0.5, metavar="B",
                      help="a fraction in (0, 1] of the activation memory of the model as "
                      "given, or bytes (an integer, or with a unit: 300MiB, 1.5GiB) "
                      "(default: 0.5)")
    plan.add_argument("--policy", choices=("lossless", "leaky_relu"), default="lossless",
                      help="iabn.convert's policy for units converted in place (leaky_relu "
                      "swaps ReLU for LeakyReLU(0.01): it changes the model) (default: "
                      "lossless)")
    plan.add_argument("--allow", type=_plan_allow, default=("inplace", "recompute", "offload"),
                      metavar="C[,C...]", help="the choices the plan may use, from inplace, "
                      "recompute, offload (default: all; offload only on CUDA)")
    plan.add_argument("--time-limit", type=_positive_seconds, default=10.0, metavar="S",
                      help="seconds for the solver; when they run out the best plan found so "
                      "far is printed, marked as such (default: 10)")
    plan.add_argument("--dtype", choices=("fp32", "bf16", "fp16", "fp64"), default="fp32",
                      help="the model's and the input's dtype (default: fp32)")
    plan.add_argument("--compiled", action="store_true",
                      help="predict the times of a model run under torch.compile, where "
                      "recomputed operations other than convolutions and matrix products "
                      "cost nothing of their own (default: eager steps)")
    plan.add_argument("--device", default="cpu",
                      help="torch device the model trains on, whose speed the time model "
                      "measures (default: cpu)")
    _add_output_options(plan, "the plan, machine info, versions and the date")
    plan.set_defaults(handler=_plan)


def _add_segment_parser(subparsers: argparse._SubParsersAction) -> None:
    from .arguments import FUSIONS, OUTPUTS, PALETTES, parse_mean, parse_scales, parse_std

    seg = subparsers.add_parser(
        "segment", help="semantic segmentation of a folder of images (DeepLabV3)",
        description="Segment every .png/.jpg/.jpeg in IN_DIR with a DeepLabV3 + WideResNet-A2 "
        "snapshot (iabn's, or the original package's Vistas file) and write the results to "
        "OUT_DIR.",
        epilog="Exit status: 0 done, 1 when an image could not be read (the others are "
        "processed), 2 for bad arguments, an IN_DIR without images or output paths that "
        "would lose data (checked before the snapshot or any image is read), or a failed "
        "write.",
    )
    seg.add_argument("snapshot", help="model snapshot (.pth / .pth.tar)")
    seg.add_argument("in_dir", help="folder of input images")
    seg.add_argument("out_dir", help="folder for the outputs (mirrors IN_DIR's layout; "
                     "created if missing, its parent must exist; not IN_DIR nor a folder "
                     "containing it; inside IN_DIR it is left out of a --recursive walk)")
    seg.add_argument("--recursive", action="store_true", help="also process subfolders")
    seg.add_argument("--long-side", type=_non_negative_int, default=None,
                     help="resize so the longer side has this many pixels; 0 keeps the size "
                     "(default: the resolution the model was trained at: a train-seg "
                     "snapshot's input.long_side_val, its canvas size for the embedded "
                     "digits, else the images' own size; 2048 for the Vistas model)")
    seg.add_argument("--scales", type=parse_scales, default=[1.0],
                     help="test-time scales, e.g. 0.7,1.0,1.2 (default: 1.0)")
    seg.add_argument("--flip", action="store_true", help="also predict on the mirrored image")
    seg.add_argument("--fusion", choices=FUSIONS, default="mean",
                     help="how to combine scales/flips (default: mean of probabilities)")
    seg.add_argument("--output", choices=OUTPUTS, default="palette",
                     help="palette PNG, raw class-index (train id) PNG, indices + confidence "
                     "PNG, or the dataset's label ids (labelids: e.g. Cityscapes labelIds for "
                     "its official evaluation) (default: palette)")
    seg.add_argument("--palette", default="auto", metavar="|".join(PALETTES) + "|VISTAS_CONFIG",
                     help="the classes' colours and label ids: auto (those a train-seg "
                     "snapshot stores, else default), default (VOC colour map), cityscapes, "
                     "voc, or a Mapillary Vistas config.json (or its dataset folder)")
    seg.add_argument("--overlay", action="store_true",
                     help="also write the image and the coloured prediction side by side")
    seg.add_argument("--overwrite", action="store_true", help="redo existing outputs")
    seg.add_argument("--mean", type=parse_mean, default=None,
                     help="input normalisation mean, RGB in [0, 1], or one value for all "
                     "channels (default: a train-seg "
                          "snapshot's own, else the Vistas model's)")
    seg.add_argument("--std", type=parse_std, default=None,
                     help="input normalisation std, positive (default: as --mean)")
    seg.add_argument("--depth", type=int, choices=(16, 20, 38), default=38,
                     help="WideResNet trunk depth of the snapshot (default: 38)")
    seg.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    seg.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    seg.set_defaults(handler=_segment)


_TRAIN_COMMANDS = {
    "train": dict(
        help="train an image classifier (ImageFolder data, or the embedded digits)",
        task="classification (see iabn.tools.training.classification)",
        data="folder with train/CLASS/* and val/CLASS/* images",
        embedded="scikit-learn's handwritten digits", example="configs/digits.json"),
    "train-seg": dict(
        help="train DeepLabV3 semantic segmentation (Cityscapes, Mapillary Vistas, Pascal VOC, "
             "image + label folders, or the embedded digits canvases)",
        task="segmentation (see iabn.tools.training.segmentation)",
        data="the dataset's folder as unpacked: Cityscapes (leftImg8bit/ + gtFine/), Mapillary "
             "Vistas v1.2 (config.json + training/, validation/), Pascal VOC 2012 (VOCdevkit/), "
             "or train/ and val/, each images/NAME.png|jpg + labels/NAME.png",
        embedded="real handwritten digits pasted on canvases", example="configs/digits_seg.json"),
}


def _add_train_parser(subparsers: argparse._SubParsersAction, command: str) -> None:
    from .arguments import RESUME_LAST

    text = _TRAIN_COMMANDS[command]
    train = subparsers.add_parser(
        command, help=text["help"],
        description=f"Train the model CONFIG describes (JSON; every key has a documented "
        f"default, see iabn.tools.training.config and the task: {text['task']}) on "
        f"DATA_ROOT/train and validate on DATA_ROOT/val after every epoch. Without "
        f"DATA_ROOT: {text['embedded']}. Run under torchrun for several processes (the batch "
        f"is split over the ranks). Writes LOG_DIR/last.pth every epoch, best.pth, "
        f"logs/rank*.log and TensorBoard scalars.",
        epilog="Exit status: 0 finished, 1 failed while training (a non-finite loss or "
        "weights, or a snapshot or log that could not be written; the snapshots on disk stay "
        "as they were), 2 bad arguments, config, data, device or snapshot (nothing written), "
        "3 stopped by SIGINT/SIGTERM with LOG_DIR/last.pth written (--resume continues it), "
        "130 interrupted (a second SIGINT: last.pth holds the last finished step; or Ctrl-C "
        "before training started). Errors are one line on stderr.",
    )
    train.add_argument("config", help=f"JSON config file (e.g. {text['example']})")
    train.add_argument("data_root", nargs="?", default=None,
                       help=f"{text['data']} (default: the config's data.root, else the "
                       f"embedded data)")
    train.add_argument("--data-root", dest="data_root_option", default=None,
                       metavar="DATA_ROOT", help="the same as the DATA_ROOT argument")
    if command == "train-seg":
        from .arguments import LAYOUTS

        train.add_argument("--dataset", choices=LAYOUTS, default=None,
                           help="the layout of DATA_ROOT (default: the config's data.dataset, "
                           "auto: told from the folders DATA_ROOT holds)")
    train.add_argument("--log-dir", type=Path, default=None,
                       help="folder for snapshots and logs (default: runs/<config name>)")
    train.add_argument("--resume", nargs="?", const=RESUME_LAST, default=None,
                       metavar="SNAPSHOT",
                       help=f"continue a run from SNAPSHOT (default: {RESUME_LAST})")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a config value (JSON or text), e.g. --set "
                       "schedule.epochs=2; repeatable")
    train.add_argument("--device", default=None,
                       help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when available)")
    train.add_argument("--print-config", action="store_true",
                       help="print the complete merged config and exit")
    # Testing only (documented in iabn.tools.training.engine): behave as if interrupted after this
    # global step, to check that --resume continues exactly.
    train.add_argument("--stop-after-steps", type=_positive_int, default=None,
                       help=argparse.SUPPRESS)
    train.set_defaults(handler=_train, command=command)


def _add_test_parser(subparsers: argparse._SubParsersAction) -> None:
    test = subparsers.add_parser(
        "test", help="top-1/top-5 of a classifier checkpoint (single or ten crops)",
        description="Evaluate CHECKPOINT (an iabn train snapshot or a state_dict) with the "
        "model CONFIG describes on DATA_ROOT/val (default: the config's data, else the "
        "embedded digits). The network may differ from the trained one where the weights "
        "fit (norm_act bn/abn/iabn/iabn_sync, activation). Run under torchrun to split the "
        "images over processes; every image is counted once.",
        epilog="Exit status: 0 done, 1 out of memory, 2 bad arguments, config, data, device, "
        "checkpoint or --json path (checked before the evaluation where possible), 130 "
        "interrupted. Errors are one line on stderr.",
    )
    test.add_argument("config", help="JSON config file the model is built from")
    test.add_argument("checkpoint", help="snapshot or state_dict file (.pth)")
    test.add_argument("data_root", nargs="?", default=None,
                      help="folder with val/CLASS/* images and train/CLASS folders (their "
                      "names give the labels) (default: as iabn train)")
    test.add_argument("--data-root", dest="data_root_option", default=None,
                      metavar="DATA_ROOT", help="the same as the DATA_ROOT argument")
    test.add_argument("--crop", type=_positive_int, default=None,
                      help="crop side (default: the config's input.crop_val)")
    test.add_argument("--scale", type=_positive_int, default=None,
                      help="shorter side before cropping (default: input.scale_val)")
    test.add_argument("--ten-crops", action="store_true",
                      help="average the softmax of the 4 corner + centre crops and of their "
                      "mirrors (10 crops) when the config trains with flips "
                      "(input.flip_train); without flips the 5 crops alone, since mirrored "
                      "images are inputs the model never saw (--set input.flip_train=true "
                      "mirrors anyway)"),
    test.add_argument("--original", action="store_true",
                      help="CHECKPOINT is from the original inplace_abn package")
    test.add_argument("--origin", default="auto", metavar="LAYER", type=_origin,
                      help="with --original: the original layer type that trained it: "
                      "InPlaceABN (also InPlaceABNSync; |gamma| + eps), ABN (standard BN, signed "
                      "weights) or auto (default: a bn_mode entry in the checkpoint, else ABN "
                      "when the file name contains 'stdbn', else InPlaceABN)")
    test.add_argument("--non-strict", action="store_true",
                      help="load the keys that fit and report the rest, instead of stopping")
    test.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a config value, e.g. --set network.activation=relu")
    test.add_argument("--batch-size", type=_positive_int, default=None,
                      help="images per global batch (default: the config's validation batch, "
                      "divided by the crops per image with --ten-crops)")
    test.add_argument("--workers", type=_non_negative_int, default=None,
                      help="data-loading workers per rank (default: data.workers)")
    test.add_argument("--device", default=None,
                      help="cpu, cuda or cuda:N (default: cuda:LOCAL_RANK when available)")
    _add_output_options(test, "the metrics and settings", type=Path)
    test.set_defaults(handler=_test)


# Each command first checks what it can without torch (arguments, paths, files), so a mistake
# costs a fraction of a second, then imports what it runs, which checks the rest.


def _config_problem(args: argparse.Namespace) -> str | None:
    """A config file that cannot be read as JSON, a malformed ``--set``, DATA_ROOT given twice
    (``iabn train``, ``train-seg``, ``test``); its values are checked once torch is loaded."""
    from .training.config import ConfigError, data_root_argument, read_config_file

    try:
        data_root_argument(args)
        read_config_file(args.config, args.set)
    except ConfigError as error:
        return str(error)
    return None


def _train(args: argparse.Namespace) -> int:
    from .training.logdir import LogDirError, check_writable, default_log_dir

    problem = _config_problem(args)
    if problem is None and not args.print_config:
        try:
            check_writable(args.log_dir or default_log_dir(args.config))
        except LogDirError as error:
            problem = str(error)
    if problem is not None:
        return _fail(args.command, problem)
    from .training.commands import train_command

    return train_command(args)


def _test(args: argparse.Namespace) -> int:
    from .training.config import MAX_BATCH, MAX_SIDE, MAX_WORKERS

    try:
        _json_path(args)
    except OutputPathError as error:
        return _fail("test", str(error))
    problem = _config_problem(args)
    for flag, value, most in (("--crop", args.crop, MAX_SIDE), ("--scale", args.scale, MAX_SIDE),
                              ("--batch-size", args.batch_size, MAX_BATCH),
                              ("--workers", args.workers, MAX_WORKERS)):
        if problem is None and value is not None and value > most:
            problem = f"{flag} must be at most {most}, got {value}"
    # the checkpoint is checked after --device (which needs torch), as before
    if problem is not None:
        return _fail("test", problem)
    from .training.commands import test_command

    return test_command(args)


def _segment(args: argparse.Namespace) -> int:
    from .outputs import check_output_folder

    in_dir = Path(args.in_dir)
    if not in_dir.is_dir():
        return _fail("segment", f"IN_DIR {in_dir} is not a folder")
    try:
        check_output_folder(args.out_dir, "OUT_DIR")
    except OutputPathError as error:
        return _fail("segment", str(error))
    problem = arguments.not_a_file(Path(args.snapshot), "snapshot")
    if problem is not None:
        return _fail("segment", problem)
    from .segment import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``iabn`` argument parser (one subcommand per tool)."""
    parser = _Parser(
        prog="iabn",
        description="In-Place Activated BatchNorm: tools to train CNNs with less memory.",
    )
    parser.add_argument("--version", action="version", version=f"iabn {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_bench_parser(subparsers)
    _add_memory_parser(subparsers)
    _add_plan_parser(subparsers)
    _add_segment_parser(subparsers)
    _add_train_parser(subparsers, "train")
    _add_train_parser(subparsers, "train-seg")
    _add_test_parser(subparsers)
    return parser


def _fail(command: str, text: str) -> int:
    """A user error: one line on stderr, exit status 2."""
    print(f"iabn {command}: error: {text}", file=sys.stderr)
    return 2


def _json_path(args: argparse.Namespace) -> Path | None:
    """``--json`` checked before any work (:func:`check_output_file`); None when not given.
    Raises :class:`OutputPathError`."""
    if args.json is None:
        return None
    return check_output_file(args.json, "--json", overwrite=args.overwrite)


def _write_json(command: str, path: Path, report: dict) -> int:
    """Write ``report`` to ``path`` atomically; 0, or 2 with one line when the disk refuses
    (full, permissions changed during the run): the temporary file is gone either way."""
    try:
        write_text_atomic(path, json.dumps(report, indent=2) + "\n")
    except OSError as error:
        return _fail(command, f"cannot write --json {path}: {error.strerror or error} (the "
                     f"results above were not saved)")
    print(f"results written to {path}")
    return 0


def _out_of_memory(error: BaseException) -> bool:
    """An allocation the machine cannot make (an input too large for it), as opposed to a
    bug, whose traceback stays."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


def _arguments(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items() if k != "handler"}


def _bench(args: argparse.Namespace) -> int:
    if args.batch * args.size * args.size < 2:
        # Batch statistics need two values per channel; say so before building anything.
        return _fail("bench", "--batch x --size^2 must be at least 2")
    try:  # before importing torch and the minute of measuring, not after
        json_path = _json_path(args)
    except OutputPathError as error:
        return _fail("bench", str(error))
    from .bench import MachineLoad, load_average, set_threads
    from .bench.blocks import format_table, run_bench, to_json

    threads = set_threads(args.threads)
    config = BenchConfig(
        batch=args.batch, channels=args.channels, size=args.size, blocks=args.blocks,
        repeats=args.repeats, iters=args.iters, warmup=args.warmup, seed=args.seed,
    )
    load_before = load_average()
    start = time.perf_counter()
    try:
        result = run_bench(config, progress=not args.quiet)
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not _out_of_memory(error):
            raise
        return _fail("bench", f"out of memory for input {args.batch}x{args.channels}x"
                     f"{args.size}x{args.size}: use a smaller --batch, --channels or --size")
    seconds = time.perf_counter() - start
    load = MachineLoad(load_before, load_average(), seconds, threads, os.cpu_count() or 1)
    print(format_table(result))
    # the run's own wall time: it depends on the machine and its load far more than on iabn
    print(f"wall time {seconds:.1f} s ({threads} threads)")
    note = load.note()
    if note is not None:  # said even with --quiet: it qualifies every time above
        print(f"iabn bench: note: {note}", file=sys.stderr, flush=True)
    if json_path is not None:
        report = to_json(result, args=_arguments(args))
        report["machine_load"] = load.to_json()
        report["wall_time_s"] = round(time.perf_counter() - start, 2)
        if _write_json("bench", json_path, report):
            return 2
    # A benchmark whose strategies disagree measured something broken: fail loudly.
    return 0 if result.check.passed else 1


def _memory(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:  # before importing torch and the minutes of measuring, not after
        json_path = _json_path(args)
        arguments.check_image_input(args.model, arguments.model_source(args.model),
                                    args.input)
    except (OutputPathError, arguments.UnknownModel, ValueError) as error:
        return _fail("memory", str(error))
    import torch

    from .bench import model_memory as mm

    def say(text: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - start:6.1f} s] {text}", file=sys.stderr, flush=True)

    try:
        device = mm.resolve_device(args.device)
        say(f"building {args.model}")
        model, source = mm.build_model(args.model)
        say(f"checking that {args.model} takes --input "
            f"{','.join(map(str, args.input))}")
        mm.check_input(model, args.model, args.input, args.dtype, device)
    except mm.ModelMemoryError as error:
        return _fail("memory", str(error))
    budgets = [b for group in args.compile_budget for b in group]
    try:
        result = mm.measure(model, args.model, source, args.input, args.dtype, device,
                            budgets=list(dict.fromkeys(budgets)), progress=say)
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not _out_of_memory(error):
            raise
        return _fail("memory", f"out of {device} memory at --input "
                     f"{','.join(map(str, args.input))}: use a smaller batch or image")
    print(mm.format_result(result))
    if args.table:
        print()
        print(result.converted["leaky_relu"].report.table())
    # the whole command's time, building the model included; it depends on the machine
    result.wall_time_s = round(time.perf_counter() - start, 2)
    print(f"wall time {result.wall_time_s:.1f} s ({torch.get_num_threads()} threads)")
    if json_path is not None:
        return _write_json("memory", json_path, mm.to_json(result, _arguments(args)))
    return 0


def _plan(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    try:  # before importing torch and the planning, not after
        json_path = _json_path(args)
        arguments.check_image_input(args.model, arguments.model_source(args.model),
                                    args.input)
    except (OutputPathError, arguments.UnknownModel, ValueError) as error:
        return _fail("plan", str(error))
    import torch

    from .bench import model_memory as mm
    from .bench import model_plan as mp

    def say(text: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - start:6.1f} s] {text}", file=sys.stderr, flush=True)

    shape_text = ",".join(map(str, args.input))
    try:
        device = mp.resolve_plan_device(args.device)
        say(f"building {args.model}")
        model, source = mm.build_model(args.model)
        say(f"checking that {args.model} takes --input {shape_text}")
        mm.check_input(model, args.model, args.input, args.dtype, device)
    except mm.ModelMemoryError as error:
        return _fail("plan", str(error))
    try:
        result = mp.run_plan(model, args.model, source, list(args.input), args.dtype, device,
                             args.budget, args.policy, args.allow, args.time_limit,
                             progress=say, compiled=args.compiled)
    except ValueError as error:  # a budget out of reach, a time limit too short
        return _fail("plan", f"--budget {args.budget}: {error}" if "budget" in str(error)
                     else str(error))
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not _out_of_memory(error):
            raise
        return _fail("plan", f"out of {device} memory at --input {shape_text}: use a smaller "
                     f"batch or image")
    print(mp.format_result(result))
    result.wall_time_s = round(time.perf_counter() - start, 2)
    print(f"wall time {result.wall_time_s:.1f} s ({torch.get_num_threads()} threads)")
    if json_path is not None:
        return _write_json("plan", json_path, mp.to_json(result, _arguments(args)))
    return 0


#: Exit status when the reader of standard output went away (``iabn memory ... | head``): what
#: a shell reports for a process that SIGPIPE ended (128 + 13).
EXIT_BROKEN_PIPE = 141


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``iabn`` command; returns the process exit code."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, where a closed pipe can still be handled
    except BrokenPipeError:
        # Python ignores SIGPIPE, so a write to a closed pipe raises: stop quietly, as a
        # command that SIGPIPE ends does, and send what is left to devnull so that Python's own
        # flush at exit does not fail again
        with contextlib.suppress(OSError, ValueError):  # (a stdout without a descriptor)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    command = "iabn"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not hasattr(args, "handler"):
            parser.print_help()
            return 0
        command = f"iabn {getattr(args, 'command', None) or args.handler.__name__.strip('_')}"
        return args.handler(args)
    except KeyboardInterrupt:
        # Ctrl-C where a command has no handler of its own (start-up, loading): one line and
        # the shell's status for SIGINT, not a traceback
        print(f"{command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
