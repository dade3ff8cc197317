"""The ``iabn`` commands' arguments, parsed and checked without importing torch.

Importing torch (and torchvision or timm) takes seconds; a typo in an argument should be
reported at once. So everything here reads only the arguments and the file system: the
argparse types (shapes, budgets, scales), the model names torchvision and timm register
(read from their installed sources, which are not imported) and the option values the
parsers list. The modules that run the commands take these definitions from here.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------- iabn bench

#: The strategy ``iabn bench`` gives its figures relative to.
BASELINE = "bn_inplace"


@dataclass(frozen=True)
class BenchConfig:
    """What ``iabn bench`` runs: input ``(batch, channels, size, size)`` float32 through
    ``blocks`` blocks (:mod:`iabn.tools.bench.blocks`); the defaults are the command's."""

    batch: int = 8
    channels: int = 64
    size: int = 32
    blocks: int = 4
    repeats: int = 21
    iters: int = 3
    warmup: int = 2
    seed: int = 0

    @property
    def input_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.channels, self.size, self.size)


# ---------------------------------------------------------------- model names

#: ``@register_model`` (torchvision, timm) and the ``def NAME`` it decorates, past any other
#: decorators; the function's name is the registered one in both libraries.
_REGISTERED = re.compile(r"^@register_model\b.*?^def[ \t]+(\w+)", re.M | re.S)


def _registered(package: str, folder: str, recursive: bool) -> list[str] | None:
    """The model names ``package`` registers in ``package/folder``, read from its sources;
    None when the package is not installed. Imports nothing but ``importlib.util``."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    root = Path(spec.origin).parent / folder
    files = sorted(root.rglob("*.py") if recursive else root.glob("*.py"))
    names: dict[str, None] = {}
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if "@register_model" in text:
            names.update(dict.fromkeys(_REGISTERED.findall(text)))
    return list(names)


def torchvision_names() -> list[str] | None:
    """torchvision's classification model names (``list_models(module=torchvision.models)``:
    the files directly in ``torchvision/models``, not detection, video...); None when
    torchvision is not installed. When its sources show none (a layout this reader does not
    know), torchvision itself is asked."""
    names = _registered("torchvision", "models", recursive=False)
    if names == []:
        import torchvision

        names = torchvision.models.list_models(module=torchvision.models)
    return names


def timm_names() -> list[str] | None:
    """timm's model names (``timm.list_models()``), or None when timm is not installed; as
    :func:`torchvision_names`, from its sources when they show them."""
    names = _registered("timm", "models", recursive=True)
    if names == []:
        import timm

        names = timm.list_models()
    return names


class UnknownModel(ValueError):
    """A model name neither torchvision nor timm has, or a ``pkg.module:factory`` whose
    package cannot be found: the text names it, the close matches and the fix."""


def model_source(spec: str) -> str:
    """Where ``spec`` comes from: ``"factory"`` (``pkg.module:factory``; only its syntax and
    top-level package are checked here), ``"torchvision"`` (which wins where both have the
    name) or ``"timm"``. Raises :class:`UnknownModel`."""
    if ":" in spec:
        module, _, attribute = spec.partition(":")
        if not module or not attribute:
            raise UnknownModel(f"model {spec!r}: expected pkg.module:factory, e.g. "
                               f"torchvision.models:resnet50")
        top = module.split(".")[0]
        try:
            found = importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UnknownModel(f"model {spec!r}: cannot import {module!r} (No module named "
                               f"{top!r}); is it installed or on PYTHONPATH?")
        return "factory"
    torchvision = torchvision_names()
    if torchvision is not None and spec in torchvision:
        return "torchvision"
    timm = timm_names()
    if timm is not None and spec in timm:
        return "timm"
    missing = [p for p, names in (("torchvision", torchvision), ("timm", timm)) if names is None]
    if len(missing) == 2:
        raise UnknownModel(
            f"model {spec!r}: model names are looked up in torchvision and timm, and neither "
            f"is installed; pip install torchvision (or timm), or give pkg.module:factory")
    # one entry per name: torchvision and timm share many (resnet50, ...)
    known = list(dict.fromkeys([*(torchvision or []), *(timm or [])]))
    close = difflib.get_close_matches(spec, known, n=5, cutoff=0.6)
    text = f"unknown model {spec!r}"
    if close:
        text += f"; close matches: {', '.join(close)}"
    if missing:
        text += (f". {missing[0]} is not installed, so its names were not searched "
                 f"(pip install {missing[0]})")
    text += ". A model of your own: pkg.module:factory (called with no arguments)"
    raise UnknownModel(text)


# ---------------------------------------------------------------- iabn memory, iabn plan


def parse_input(text: str) -> tuple[int, ...]:
    """``--input``: ``N,C,H,W`` (or another rank >= 2, batch first), positive integers."""
    parts = [p.strip() for p in text.split(",")]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected positive integers N,C,H,W such as 8,3,224,224, "
                         f"got {text!r}") from None
    if len(shape) < 2 or any(n <= 0 for n in shape):
        raise ValueError(f"expected positive integers N,C,H,W such as 8,3,224,224 (batch "
                         f"first, at least two of them), got {text!r}")
    return shape


def check_image_input(spec: str, source: str, shape: tuple[int, ...]) -> None:
    """torchvision's and timm's classifiers take images, 4 numbers N,C,H,W: refuse another
    count before the model is built (torch would report a channel mismatch of its own
    reading, ``expected input[1, 8, 3, 224] to have 3 channels``, seconds later)."""
    if source in ("torchvision", "timm") and len(shape) != 4:
        raise ValueError(f"--input {','.join(map(str, shape))} has {len(shape)} numbers: "
                         f"{spec} ({source}) takes images, 4 numbers N,C,H,W such as "
                         f"8,3,224,224")


def parse_budgets(texts: list[str] | tuple[str, ...]) -> list[float]:
    """``--compile-budget``: values in [0, 1], repeated or comma-separated, in given order."""
    budgets: list[float] = []
    for text in texts:
        for part in text.split(","):
            try:
                value = float(part)
            except ValueError:
                raise ValueError(f"expected numbers in [0, 1] such as 1,0.5, got {text!r}") \
                    from None
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{value} is outside [0, 1] (1.0 is torch.compile's default)")
            if value not in budgets:
                budgets.append(value)
    return budgets


_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6,
          "gb": 10**9}
_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_budget(text: str) -> int | float:
    """``--budget``: a fraction in (0, 1] of the model's activation memory (``0.5``, ``1``),
    or bytes: an integer above 1 or a size with a unit (``300MiB``, ``1.5GiB``, ``2GB``)."""
    text = text.strip()
    match = _BYTES.match(text)
    if match is not None:
        number, unit = match.groups()
        if unit.lower() not in _UNITS:
            raise ValueError(f"unknown unit {unit!r} in {text!r}: use B, KiB, MiB, GiB (or kB, "
                             f"MB, GB)")
        value = int(float(number) * _UNITS[unit.lower()])
        if value < 1:
            raise ValueError(f"{text!r} is less than one byte")
        return value
    try:
        number = float(text)
    except ValueError:
        raise ValueError(f"expected a fraction in (0, 1] such as 0.5, or bytes such as "
                         f"300MiB, got {text!r}") from None
    if number > 1 and number.is_integer() and text.isdigit():
        return int(text)
    if not 0 < number <= 1:
        raise ValueError(f"a fraction must be in (0, 1] (give bytes with a unit, e.g. "
                         f"300MiB), got {text!r}")
    return number


#: The choices ``iabn.plan`` can make (``iabn.planning.ALLOWED``, which imports torch;
#: tests/tools/test_cli_startup.py checks that the two agree).
PLAN_CHOICES = ("inplace", "recompute", "offload")


def parse_allow(text: str) -> tuple[str, ...]:
    """``--allow``: a comma-separated subset of inplace, recompute, offload."""
    chosen = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in chosen if p not in PLAN_CHOICES]
    if unknown or not chosen:
        raise ValueError(f"expected a comma-separated list of {', '.join(PLAN_CHOICES)}, got "
                         f"{text!r}")
    return chosen


# ---------------------------------------------------------------- iabn segment

FUSIONS = ("mean", "voting", "max")
OUTPUTS = ("palette", "raw", "prob", "labelids")
#: ``--palette`` names (or a Mapillary Vistas config.json).
PALETTES = ("auto", "default", "cityscapes", "voc")


def parse_floats(text: str) -> list[float]:
    """Comma-separated finite numbers (an argparse ``type``)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}"
                                         ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {text!r}")
    if not all(math.isfinite(value) for value in values):
        raise argparse.ArgumentTypeError(f"expected finite numbers, got {text!r}")
    return values


def parse_scales(text: str) -> list[float]:
    """``--scales``: positive numbers."""
    values = parse_floats(text)
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"scales must be positive, got {text!r}")
    return values


def parse_mean(text: str) -> list[float]:
    """``--mean``: three numbers (RGB), or one for all channels."""
    values = parse_floats(text)
    if len(values) not in (1, 3):
        raise argparse.ArgumentTypeError(f"expected 3 numbers (R,G,B) or one for all, got "
                                         f"{len(values)} in {text!r}")
    return values * 3 if len(values) == 1 else values


def parse_std(text: str) -> list[float]:
    """``--std``: as ``--mean``, positive (the input is divided by it)."""
    values = parse_mean(text)
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"std must be positive (the input is divided by "
                                         f"it), got {text!r}")
    return values


# ---------------------------------------------------------------- iabn train, train-seg

#: ``data.dataset`` / ``--dataset`` values: ``auto`` picks one from the folder
#: (:func:`iabn.tools.data.seg_datasets.detect_layout`), ``digits`` is the embedded set (no
#: folder), ``folder`` the ``train|val/images`` + ``labels`` layout.
LAYOUTS = ("auto", "digits", "folder", "cityscapes", "vistas", "voc")
#: The snapshot every epoch overwrites, and what ``--resume`` without a value means.
LAST = "last.pth"
RESUME_LAST = f"LOG_DIR/{LAST}"


# ---------------------------------------------------------------- input files


def not_a_file(path: Path, what: str) -> str | None:
    """Why ``path`` cannot be read as a ``what`` file, or None when it is a regular file."""
    if path.is_file():
        return None
    if path.is_dir():
        return f"{what} {path} is a folder, not a file"
    if path.exists():
        return f"{what} {path} is not a regular file"
    return f"{what} {path} does not exist"


__all__ = [
    "BASELINE",
    "FUSIONS",
    "LAST",
    "LAYOUTS",
    "OUTPUTS",
    "PALETTES",
    "PLAN_CHOICES",
    "RESUME_LAST",
    "BenchConfig",
    "UnknownModel",
    "model_source",
    "not_a_file",
    "parse_allow",
    "parse_budget",
    "parse_budgets",
    "parse_floats",
    "parse_input",
    "parse_mean",
    "parse_scales",
    "parse_std",
    "timm_names",
    "torchvision_names",
]
