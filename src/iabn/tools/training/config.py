"""JSON run configurations: a schema of documented defaults, merged with a user's file.

A schema maps section -> key -> :class:`Option` (default, one-line documentation, type, allowed
values). A configuration is a plain ``{section: {key: value}}`` dict: the defaults with the
user's file merged over them section by section, then ``--set section.key=VALUE`` overrides.
Unknown sections or keys, wrong types and values outside the allowed ones raise
:class:`ConfigError` naming the key and what would be accepted, before anything runs.

:data:`ENGINE_SCHEMA` holds what the generic training engine reads; a task adds its own keys
(:func:`combine`), e.g. :data:`iabn.tools.training.classification.SCHEMA`.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Config = dict[str, dict[str, Any]]


class ConfigError(ValueError):
    """A configuration file, key or value that cannot be used (the message says which)."""


@dataclass(frozen=True)
class Option:
    """One configuration key: ``kind`` is ``bool``, ``int``, ``float``, ``str`` or ``list``
    (of numbers); ``None`` is accepted when ``nullable``."""

    default: Any
    doc: str
    kind: type
    choices: tuple[str, ...] = ()
    nullable: bool = False
    length: int | None = None
    minimum: float | None = None
    maximum: float | None = None


#: The largest seed: torch's generators take 64-bit seeds and the engine seeds rank ``r``
#: with ``data.seed + r``; int64 leaves room for any number of ranks.
MAX_SEED = 2**63 - 1
#: The largest image side in pixels a config may ask for (crops, resizes, canvases): a
#: 16384 x 16384 RGB image is already 3 GiB in float32.
MAX_SIDE = 2**14
#: Floats and numbers in lists are used as float32 by torch: larger magnitudes overflow.
FLOAT32_MAX = 3.4028234663852886e38
#: The largest batch (global, training or validation) and the most data-loading worker
#: processes per rank a config may ask for.
MAX_BATCH = 2**24
MAX_WORKERS = 256

Schema = dict[str, dict[str, Option]]

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "step", "multistep", "linear", "poly", "cosine")

ENGINE_SCHEMA: Schema = {
    "network": {
        "precision": Option("fp32", "autocast dtype of forward and loss (fp16 adds loss "
                            "scaling); parameters stay fp32", str, PRECISIONS),
        "channels_last": Option(False, "run the model and inputs in channels_last memory "
                                "format", bool),
        "memory_budget": Option(None, "plan the model with iabn.plan (in-place units, "
                                "recomputation, offloading on CUDA; lossless) so that the "
                                "activations it keeps for backward fit: a fraction in (0, 1] "
                                "of the built model's at one training batch per rank, or "
                                "bytes (a whole number above 1); null: as built", float,
                                nullable=True),
    },
    "optimizer": {
        "type": Option("sgd", "optimizer", str, OPTIMIZERS),
        "lr": Option(0.1, "base learning rate", float, minimum=0.0),
        "momentum": Option(0.9, "SGD momentum", float, minimum=0.0),
        "nesterov": Option(True, "SGD with Nesterov momentum (ignored when momentum is 0)",
                           bool),
        "betas": Option([0.9, 0.999], "Adam/AdamW betas", list, length=2),
        "eps": Option(1e-8, "Adam/AdamW epsilon", float, minimum=0.0),
        "weight_decay": Option(1e-4, "weight decay (L2 for SGD/Adam, decoupled for AdamW)",
                               float, minimum=0.0),
        "weight_decay_norm": Option(False, "also decay the weights and biases of "
                                    "normalisation layers", bool),
        "clip_grad_norm": Option(None, "clip the global L2 norm of the gradients to this; "
                                 "null: no clipping", float, nullable=True, minimum=0.0),
    },
    "schedule": {
        "epochs": Option(90, "training epochs", int, minimum=1),
        "max_steps_per_epoch": Option(None, "cap on steps per epoch (quick runs); null: one "
                                      "pass over the training data", int, nullable=True,
                                      minimum=1),
        "type": Option("step", "learning-rate schedule", str, SCHEDULES),
        "update": Option("epoch", "change the learning rate every epoch or every step; "
                         "epoch-valued keys below then count in steps", str, ("epoch", "step")),
        "step_size": Option(30, "step: epochs between decays", int, minimum=1),
        "milestones": Option([30, 60], "multistep: epochs at which to decay", list),
        "gamma": Option(0.1, "step/multistep: decay factor", float, minimum=0.0),
        "power": Option(0.9, "poly: exponent of (1 - progress)", float, minimum=0.0),
        "final_lr": Option(0.0, "linear/poly/cosine: learning rate at the end", float,
                           minimum=0.0),
        "warmup_epochs": Option(0.0, "linear warm-up length in epochs (may be fractional)",
                                float, minimum=0.0),
        "warmup_factor": Option(0.1, "learning-rate factor at the start of the warm-up",
                                float, minimum=0.0),
    },
    "data": {
        "batch_size": Option(256, "global training batch, split evenly over the ranks", int,
                             minimum=1, maximum=MAX_BATCH),
        "val_batch_size": Option(None, "global validation batch; null: data.batch_size", int,
                                 nullable=True, minimum=1, maximum=MAX_BATCH),
        "workers": Option(4, "data-loading worker processes per rank", int, minimum=0,
                          maximum=MAX_WORKERS),
        "seed": Option(0, "seed of weight initialisation, data order and augmentation", int,
                       minimum=0, maximum=MAX_SEED),
    },
    "logging": {
        "log_every": Option(10, "steps between log lines, progress and TensorBoard train "
                            "scalars", int, minimum=1),
        "val_every": Option(1, "epochs between validations (the last epoch always "
                            "validates)", int, minimum=1),
        "tensorboard": Option(True, "write TensorBoard scalars to LOG_DIR/tensorboard", bool),
        "progress": Option(True, "progress bar with throughput on stderr (rank 0)", bool),
    },
}


def combine(*schemas: Schema) -> Schema:
    """One schema from several (sections merged; a key defined twice is a programming error)."""
    result: Schema = {}
    for schema in schemas:
        for section, options in schema.items():
            target = result.setdefault(section, {})
            clash = set(target) & set(options)
            if clash:
                raise ValueError(f"schema keys defined twice in [{section}]: {sorted(clash)}")
            target.update(options)
    return result


def defaults(schema: Schema) -> Config:
    """The configuration with every key at its default."""
    return {section: {key: copy.deepcopy(option.default) for key, option in options.items()}
            for section, options in schema.items()}


def _unknown(kind: str, name: str, known: Sequence[str], where: str) -> ConfigError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{where}: unknown {kind} {name!r}{hint}; known: {', '.join(known)}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked(option: Option, value: Any, where: str) -> Any:
    """``value`` if it fits ``option`` (ints accepted as floats), else a ConfigError."""
    if value is None:
        if option.nullable:
            return None
        raise ConfigError(f"{where}: null is not allowed; give a {option.kind.__name__}")
    kind_ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: _is_number(value),
        str: isinstance(value, str),
        list: isinstance(value, list) and all(_is_number(item) for item in value),
    }[option.kind]
    if not kind_ok:
        wanted = "a list of numbers" if option.kind is list else f"a {option.kind.__name__}"
        raise ConfigError(f"{where}: expected {wanted}, got {json.dumps(value)}")
    numbers = value if option.kind is list else [value] if option.kind in (int, float) else []
    if not all(math.isfinite(number) for number in numbers):
        # JSON files may hold NaN and Infinity (Python's json reads them); a NaN learning
        # rate trained to the end with loss nan and exit status 0
        raise ConfigError(f"{where}: must be a finite number, got {json.dumps(value)}")
    if option.kind is not int and any(abs(number) > FLOAT32_MAX for number in numbers):
        raise ConfigError(f"{where}: must be within +-3.4e38 (torch computes it in float32), "
                          f"got {json.dumps(value)}")
    if option.choices and value not in option.choices:
        raise _unknown("value", value, option.choices, where)
    if option.length is not None and len(value) != option.length:
        raise ConfigError(f"{where}: expected {option.length} numbers, got {len(value)}")
    each = "each number " if option.kind is list else ""
    if option.minimum is not None and any(number < option.minimum for number in numbers):
        raise ConfigError(f"{where}: {each}must be at least {option.minimum}, got "
                          f"{json.dumps(value)}")
    if option.maximum is not None and any(number > option.maximum for number in numbers):
        raise ConfigError(f"{where}: {each}must be at most {option.maximum}, got "
                          f"{json.dumps(value)}")
    return float(value) if option.kind is float else value


def merge(schema: Schema, user: Any, source: str = "config") -> Config:
    """The defaults of ``schema`` with ``user`` (``{section: {key: value}}``) merged over them;
    every user value is checked. ``source`` names the file in error messages."""
    if not isinstance(user, Mapping):
        raise ConfigError(f"{source}: expected a JSON object of sections "
                          f"({', '.join(schema)}), got {type(user).__name__}")
    config = defaults(schema)
    for section, values in user.items():
        if section not in schema:
            raise _unknown("section", section, list(schema), source)
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: section {section!r} must be an object of keys")
        for key, value in values.items():
            if key not in schema[section]:
                raise _unknown("key", key, list(schema[section]), f"{source}: [{section}]")
            config[section][key] = _checked(schema[section][key], value,
                                            f"{source}: {section}.{key}")
    return config


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"section.key=VALUE"`` -> ``(section, key, value)``; VALUE is JSON when it parses
    (numbers, true/false/null, lists), else the plain string."""
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not (sep and dot and section and key):
        raise ConfigError(f"--set {text!r}: expected SECTION.KEY=VALUE, e.g. "
                          f"optimizer.lr=0.05")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return section, key, value


def read_config_file(path: str | Path, overrides: Sequence[str] = ()) -> Any:
    """The JSON in the file ``path`` with the ``--set`` overrides applied, not yet checked
    against a schema (:func:`load_config` does that); needs no torch, so the commands call it
    before importing it."""
    path = Path(path)
    try:
        user = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"config file {path} is not valid JSON: {error}") from None
    if isinstance(user, dict):
        user = copy.deepcopy(user)
        for text in overrides:
            section, key, value = parse_override(text)
            target = user.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{path}: section {section!r} must be an object of keys")
            target[key] = value
    return user


def load_config(path: str | Path, schema: Schema, overrides: Sequence[str] = ()) -> Config:
    """Read the JSON file ``path``, merge it over the defaults, apply ``--set`` overrides."""
    return merge(schema, read_config_file(path, overrides), source=str(path))


def data_root_argument(args: Any) -> str | None:
    """DATA_ROOT given as the positional argument or as ``--data-root`` (not both) in the
    command's arguments ``args``."""
    positional, option = args.data_root, getattr(args, "data_root_option", None)
    if positional is not None and option is not None and positional != option:
        raise ConfigError(f"DATA_ROOT {positional!r} and --data-root {option!r} differ: give "
                          f"the data folder once")
    return option if option is not None else positional


def check_engine_config(config: Config, source: str = "config") -> None:
    """Rules that span keys of the engine's sections (ConfigError naming the keys)."""
    budget = config["network"]["memory_budget"]
    if budget is not None and (budget <= 0 or (budget > 1 and not float(budget).is_integer())):
        raise ConfigError(f"{source}: network.memory_budget must be a fraction in (0, 1] of "
                          f"the model's activation memory or a whole number of bytes above 1, "
                          f"got {budget}")
    schedule = config["schedule"]
    milestones = schedule["milestones"]
    if any(not float(m).is_integer() or m < 1 for m in milestones) or milestones != sorted(
            set(milestones)):
        raise ConfigError(f"{source}: schedule.milestones must be increasing whole epochs "
                          f"(>= 1), got {milestones}")
    if schedule["warmup_epochs"] >= schedule["epochs"]:
        raise ConfigError(f"{source}: schedule.warmup_epochs={schedule['warmup_epochs']} must "
                          f"be less than schedule.epochs={schedule['epochs']}")
    betas = config["optimizer"]["betas"]
    if not all(0.0 <= beta < 1.0 for beta in betas):
        raise ConfigError(f"{source}: optimizer.betas must both be in [0, 1) (Adam's decay "
                          f"rates of its moment estimates), got {betas}")
    if schedule["warmup_factor"] > 1.0:
        raise ConfigError(f"{source}: schedule.warmup_factor must be at most 1 (a warm-up "
                          f"rises to the base rate), got {schedule['warmup_factor']}")


def with_defaults(config: Mapping[str, Mapping[str, Any]], schema: Schema) -> Config:
    """A copy of ``config`` with the keys of ``schema`` it lacks at their defaults: a
    snapshot written before a key was added compares as if it had the default, which is
    what that run did."""
    filled = {section: dict(values) for section, values in config.items()}
    for section, options in schema.items():
        target = filled.setdefault(section, {})
        for key, option in options.items():
            target.setdefault(key, copy.deepcopy(option.default))
    return filled


def differences(old: Config, new: Config, ignore: Sequence[str] = ()) -> list[str]:
    """``"section.key: old -> new"`` for every value that differs, skipping the sections and
    ``section.key`` names in ``ignore``."""
    lines = []
    for section in sorted(set(old) | set(new)):
        if section in ignore:
            continue
        old_values, new_values = old.get(section, {}), new.get(section, {})
        for key in sorted(set(old_values) | set(new_values)):
            name = f"{section}.{key}"
            if name in ignore:
                continue
            before, after = old_values.get(key, "<absent>"), new_values.get(key, "<absent>")
            if before != after:
                lines.append(f"{name}: {json.dumps(before)} -> {json.dumps(after)}")
    return lines


__all__ = ["ENGINE_SCHEMA", "FLOAT32_MAX", "MAX_BATCH", "MAX_SEED", "MAX_SIDE", "MAX_WORKERS",
           "OPTIMIZERS", "PRECISIONS", "SCHEDULES", "Config", "ConfigError", "Option", "Schema",
           "check_engine_config", "combine", "data_root_argument", "defaults", "differences",
           "load_config", "merge", "parse_override", "read_config_file", "with_defaults"]
