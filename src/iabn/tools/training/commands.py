"""``iabn train``, ``iabn train-seg`` and ``iabn test``: arguments from :mod:`iabn.tools.cli` to the
engine (one training command per task, the same engine and options).

Exit status: 0 done, 2 bad arguments/config/data/snapshot (reported before anything is
written), 3 training stopped early with a snapshot (``--resume`` continues it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ..data.imagefolder import DataLayoutError
from .classification import ClassificationTask
from .config import (
    ENGINE_SCHEMA,
    Config,
    ConfigError,
    check_engine_config,
    combine,
    load_config,
)
from .engine import TrainOptions, train
from .evaluate import TestOptions, run_test, write_json
from .logdir import LogDirError, check_writable
from .segmentation import SegmentationTask
from .snapshot import LAST, RESUME_LAST, SnapshotError
from .task import Task

TASK = ClassificationTask()
SEGMENTATION_TASK = SegmentationTask()
SCHEMA = combine(ENGINE_SCHEMA, TASK.schema)
#: The task each training command runs.
COMMAND_TASKS = {"train": TASK, "train-seg": SEGMENTATION_TASK}
#: What ``--resume`` without a value means.
USER_ERRORS = (ConfigError, SnapshotError, DataLayoutError, LogDirError, ImportError)


def load_run_config(path: str | Path, data_root: str | None, overrides: list[str],
                    task: Task = TASK, dataset: str | None = None) -> Config:
    """The checked configuration: defaults, the file, ``--set`` overrides, then DATA_ROOT
    and (``iabn train-seg``) ``--dataset``."""
    config = load_config(path, combine(ENGINE_SCHEMA, task.schema), overrides)
    if data_root is not None:
        config["data"]["root"] = str(data_root)
    if dataset is not None:
        config["data"]["dataset"] = dataset
    check_engine_config(config, str(path))
    task.check_config(config, str(path))
    return config


def data_root_argument(args: argparse.Namespace) -> str | None:
    """DATA_ROOT given as the positional argument or as ``--data-root`` (not both)."""
    positional, option = args.data_root, getattr(args, "data_root_option", None)
    if positional is not None and option is not None and positional != option:
        raise ConfigError(f"DATA_ROOT {positional!r} and --data-root {option!r} differ: give "
                          f"the data folder once")
    return option if option is not None else positional


def default_log_dir(config_path: str | Path) -> Path:
    """``runs/<config file name without .json>``."""
    return Path("runs") / Path(config_path).stem


def train_command(args: argparse.Namespace) -> int:
    """``iabn train`` / ``iabn train-seg CONFIG [DATA_ROOT]`` (see
    :func:`iabn.tools.cli.build_parser`); ``args.command`` picks the task."""
    command = getattr(args, "command", "train")
    task = COMMAND_TASKS[command]
    # A process-wide CPU setting, so the command (whose process this is) sets it, not the
    # engine a library user may call. Late in training, gradients underflow into denormal
    # floats, which x86 CPUs compute about 10x slower: one digits-segmentation step took 2.4 s
    # against 0.27 s flushed (project CPU VM). The validation metrics of that run's first five
    # epochs were the same to 4 significant digits with and without flushing.
    torch.set_flush_denormal(True)
    try:
        config = load_run_config(args.config, data_root_argument(args), args.set, task,
                                 getattr(args, "dataset", None))
        if args.print_config:
            print(json.dumps(config, indent=2))
            return 0
        log_dir = args.log_dir or default_log_dir(args.config)
        resume = None
        if args.resume is not None:
            resume = log_dir / LAST if args.resume == RESUME_LAST else Path(args.resume)
        options = TrainOptions(log_dir=log_dir, resume=resume, device=args.device,
                               stop_after_steps=args.stop_after_steps)
        return train(task, config, options)
    except USER_ERRORS as error:
        print(f"iabn {command}: error: {error}", file=sys.stderr)
        return 2


def test_command(args: argparse.Namespace) -> int:
    """``iabn test CONFIG CHECKPOINT [DATA_ROOT]`` (see :func:`iabn.tools.cli.build_parser`)."""
    try:
        if args.json is not None:
            check_writable(Path(args.json).parent, f"--json {args.json}: folder")
        config = load_run_config(args.config, data_root_argument(args), args.set)
        scale = args.scale or config["input"]["scale_val"]
        crop = args.crop or config["input"]["crop_val"]
        if crop > scale:
            raise ConfigError(f"--crop {crop} is larger than --scale {scale} (or the config's "
                              f"input.crop_val/scale_val): the crop must fit the resized image")
        options = TestOptions(
            checkpoint=Path(args.checkpoint), scale=args.scale, crop=args.crop,
            ten_crops=args.ten_crops, original=args.original, origin=args.origin,
            strict=not args.non_strict,
            device=args.device, batch_size=args.batch_size, workers=args.workers,
            progress=not args.quiet)
        result = run_test(config, options)
    except USER_ERRORS as error:
        print(f"iabn test: error: {error}", file=sys.stderr)
        return 2
    if args.json is not None and int(os.environ.get("RANK", "0")) == 0:
        write_json(result, args.json)
    return 0


__all__ = ["COMMAND_TASKS", "RESUME_LAST", "SCHEMA", "SEGMENTATION_TASK", "TASK",
           "data_root_argument", "default_log_dir", "load_run_config", "test_command",
           "train_command"]
