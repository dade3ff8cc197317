"""``iabn train``, ``iabn train-seg`` and ``iabn test``: arguments from :mod:`iabn.tools.cli` to the
engine (one training command per task, the same engine and options).

Exit status: 0 done, 1 training failed (diverged, or a snapshot or log could not be written;
the snapshots on disk stay as they were), 2 bad arguments/config/data/snapshot/device
(reported before anything is written), 3 training stopped early with a snapshot (``--resume``
continues it), 130 interrupted (a second SIGINT: the snapshot of the last finished step).
Every error is one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ..data.imagefolder import DataLayoutError
from ..outputs import OutputPathError, check_output_file
from .classification import ClassificationTask
from .config import (
    ENGINE_SCHEMA,
    Config,
    ConfigError,
    check_engine_config,
    combine,
    data_root_argument,
    load_config,
)
from .engine import EXIT_FAILED, TrainingFailed, TrainOptions, out_of_memory, train
from .evaluate import TestOptions, run_test, write_json
from .logdir import LogDirError, default_log_dir
from .ranks import DeviceError
from .segmentation import SegmentationTask
from .snapshot import LAST, RESUME_LAST, SnapshotError, one_line
from .task import Task

TASK = ClassificationTask()
SEGMENTATION_TASK = SegmentationTask()
SCHEMA = combine(ENGINE_SCHEMA, TASK.schema)
#: The task each training command runs.
COMMAND_TASKS = {"train": TASK, "train-seg": SEGMENTATION_TASK}
#: What ``--resume`` without a value means.
USER_ERRORS = (ConfigError, SnapshotError, DataLayoutError, LogDirError, DeviceError, ImportError,
               OutputPathError)
#: The command that trains each task's configs, for a config given to another command.
TRAINED_BY = {"classification": "iabn train", "segmentation": "iabn train-seg"}
#: How a segmentation model is evaluated, for a segmentation config given to ``iabn test``.
SEGMENTATION_EVALUATION = (
    "iabn test evaluates classifiers only: a train-seg run's validation mIoU is in its log "
    "and in its snapshot's val_metrics, and iabn segment SNAPSHOT IN_DIR OUT_DIR predicts "
    "images (--output labelids for the datasets' own scoring scripts)")


def _other_task(path: str | Path, task: Task) -> Task | None:
    """The task whose schema ``path`` fits, when it is not ``task``'s (None otherwise)."""
    for other in (TASK, SEGMENTATION_TASK):
        if other.name == task.name:
            continue
        try:
            load_config(path, combine(ENGINE_SCHEMA, other.schema))
        except ConfigError:
            continue
        return other
    return None


def load_run_config(path: str | Path, data_root: str | None, overrides: list[str],
                    task: Task = TASK, dataset: str | None = None,
                    command: str = "train") -> Config:
    """The checked configuration: defaults, the file, ``--set`` overrides, then DATA_ROOT
    and (``iabn train-seg``) ``--dataset``. A file of another task's config is refused
    naming that task and its command (``command``: the one that was run)."""
    try:
        config = load_config(path, combine(ENGINE_SCHEMA, task.schema), overrides)
    except ConfigError as error:
        other = _other_task(path, task) if "unknown" in str(error) else None
        if other is None:
            raise
        hint = (f"; {SEGMENTATION_EVALUATION}" if command == "test"
                and other.name == SEGMENTATION_TASK.name else "")
        raise ConfigError(f"{path} is a {other.name} config: it is trained with "
                          f"{TRAINED_BY[other.name]}{hint}") from None
    if data_root is not None:
        config["data"]["root"] = str(data_root)
    if dataset is not None:
        config["data"]["dataset"] = dataset
    check_engine_config(config, str(path))
    task.check_config(config, str(path))
    return config


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
        return _fail(command, error, 2)
    except TrainingFailed as error:
        return _fail(command, error, EXIT_FAILED)


def _fail(command: str, error: object, status: int) -> int:
    """The error as one line on stderr (some messages quote multi-line ones); ``status``."""
    print(f"iabn {command}: error: {one_line(str(error))}", file=sys.stderr)
    return status


def test_command(args: argparse.Namespace) -> int:
    """``iabn test CONFIG CHECKPOINT [DATA_ROOT]`` (see :func:`iabn.tools.cli.build_parser`)."""
    try:
        if args.json is not None:
            check_output_file(args.json, "--json", overwrite=args.overwrite)
        config = load_run_config(args.config, data_root_argument(args), args.set,
                                 command="test")
        # --crop, --scale, --batch-size and --workers are checked against their bounds by
        # iabn.tools.cli before torch is imported
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
        try:
            result = run_test(config, options)
        except RuntimeError as error:  # torch.OutOfMemoryError is one
            if not out_of_memory(error):
                raise
            return _fail("test", f"out of memory ({one_line(str(error))[:200]}); lower "
                         f"--batch-size or --scale", EXIT_FAILED)
        if args.json is not None and int(os.environ.get("RANK", "0")) == 0:
            try:
                write_json(result, Path(args.json))
            except OSError as error:
                raise LogDirError(f"cannot write --json {args.json}: "
                                  f"{error.strerror or error}") from None
    except USER_ERRORS as error:
        return _fail("test", error, 2)
    return 0


__all__ = ["COMMAND_TASKS", "RESUME_LAST", "SCHEMA", "SEGMENTATION_TASK", "TASK",
           "data_root_argument", "default_log_dir", "load_run_config",
           "test_command", "train_command"]
