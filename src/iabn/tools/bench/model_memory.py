"""``iabn memory``: the activation memory of an existing classifier before and after
:func:`iabn.convert`, and the batch that fits the same memory after conversion.

The model is a torchvision classification model name, a timm name or ``pkg.module:factory``;
it is built with random weights (nothing is downloaded). All figures are exact bytes of the
distinct storages autograd keeps for backward in one training forward at the given input
(:func:`iabn.memory.saved_tensor_bytes`; parameters and buffers excluded). They are not peak
memory: weights, gradients, optimiser state and the backward's transients come on top.

The batch that fits: the largest ``N'`` whose converted model's saved bytes at
``(N', C, H, W)`` are at most the original's at ``(N, C, H, W)``. The search counts on the
``meta`` device (shapes without data, so large batches cost no memory and little time) when
the converted model's meta count at ``N`` equals its real count at ``N``; otherwise it runs on
the model's own device. (They differ for ``nn.BatchNorm2d`` in bfloat16 or float16: PyTorch's
meta kernel saves float32 statistics where its CPU kernel saves them in the input's dtype.)
"""

from __future__ import annotations

import copy
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime, timezone
from typing import Any

import torch
from torch import nn

from ...memory import compiled_saved_bytes, saved_tensor_bytes
from .. import arguments
from ..arguments import parse_budgets, parse_input
from . import machine_info
from .module_trace import trace_modules
from .pixels import largest_fitting

#: ``--dtype`` choices.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}
#: The two policies of :func:`iabn.convert`, both measured.
POLICIES = ("lossless", "leaky_relu")


class ModelMemoryError(ValueError):
    """A user error (model name, input shape, device): the command exits 2 with the text."""


# ---------------------------------------------------------------- building the model
# (--input and --compile-budget are parsed by parse_input and parse_budgets, from
# iabn.tools.arguments, where the command checks them before importing torch)


def build_model(spec: str) -> tuple[nn.Module, str]:
    """The model ``spec`` names, with random weights (the same every call; the caller's
    random state is left alone), and where it came from (``"torchvision"``, ``"timm"`` or
    ``"factory"``). Raises :class:`ModelMemoryError`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _build_model(spec)


def _build_model(spec: str) -> tuple[nn.Module, str]:
    try:
        source = arguments.model_source(spec)
    except arguments.UnknownModel as error:
        raise ModelMemoryError(str(error)) from None
    if source == "factory":
        return _from_factory(spec), "factory"
    if source == "torchvision":
        import torchvision

        return torchvision.models.get_model(spec, weights=None), "torchvision"
    import timm

    return timm.create_model(spec, pretrained=False), "timm"


def _from_factory(spec: str) -> nn.Module:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ModelMemoryError(f"model {spec!r}: expected pkg.module:factory, e.g. "
                               f"torchvision.models:resnet50")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelMemoryError(f"model {spec!r}: cannot import {module_name!r} ({error}); "
                               f"is it installed or on PYTHONPATH?") from None
    except (Exception, SystemExit) as error:  # the user's module failed (or exit()ed) on import
        raise ModelMemoryError(f"model {spec!r}: importing {module_name} raised "
                               f"{_describe(error)}") from None
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ModelMemoryError(f"model {spec!r}: {module_name} has no {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ModelMemoryError(f"model {spec!r}: {attribute} is a {type(factory).__name__}, "
                               f"not a function or class to call")
    try:
        model = factory()
    except (Exception, SystemExit) as error:  # the user's code: report it, no traceback;
        # an exit() in it is an error too, not the command's own exit status
        raise ModelMemoryError(f"model {spec!r}: calling {attribute}() raised "
                               f"{_describe(error)}") from None
    if not isinstance(model, nn.Module):
        raise ModelMemoryError(f"model {spec!r}: {attribute}() returned a "
                               f"{type(model).__name__}, not a torch.nn.Module")
    return model


def _describe(error: BaseException) -> str:
    """``SystemExit(0)``, ``RuntimeError: text``: what user code raised, in one line."""
    if isinstance(error, SystemExit):
        return f"SystemExit({error.code!r}) (it called exit())"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def resolve_device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError as error:
        raise ModelMemoryError(f"--device {text!r}: {error}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelMemoryError(f"--device {text!r}: CUDA is not available here; use cpu")
    if device.type == "meta":
        raise ModelMemoryError("--device meta: the conversion compares real outputs; use cpu "
                               "(the batch search uses meta by itself where it can)")
    try:  # cuda:7 on a machine with one GPU, a backend this build lacks
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:
        raise ModelMemoryError(f"--device {text!r}: not usable here ({_describe(error)}); "
                               f"use cpu") from None
    return device


# ---------------------------------------------------------------- checking the input


def _expects(module: nn.Module) -> str | None:
    """The input shape a first layer takes, as ``N,3,H,W``; None if it does not say."""
    if isinstance(module, nn.modules.conv._ConvNd) and module.in_channels:
        spatial = ("L", "H,W", "D,H,W")[len(module.kernel_size) - 1]
        return f"N,{module.in_channels},{spatial}"
    if isinstance(module, nn.Linear) and module.in_features:
        return f"N,{module.in_features}"
    return None


def _try_forward(model: nn.Module, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> tuple[BaseException, str, str | None] | None:
    """Run one training forward of ``model`` (a copy the caller may spoil) at ``shape``
    without autograd; None if it runs, else the error, where it happened (the innermost
    module running and what the first layer takes) and what the first layer takes
    (``N,3,H,W``, None when unknown)."""
    with trace_modules(model) as trace:
        try:
            x = torch.empty(*shape, dtype=dtype, device=device) if device.type == "meta" else \
                torch.randn(*shape, dtype=dtype, device=device)
            with torch.no_grad():
                model.train()(x)
            return None
        except (Exception, SystemExit) as error:  # the model's own code: any error is possible
            failed = error
    running = [name or "the model" for name, _ in trace.running]
    first = next((name or "the model" for name, m in trace.entered if _expects(m)), None)
    modules = dict(model.named_modules())
    modules["the model"] = model

    def layer(name: str) -> str:
        return f"{name} ({type(modules[name]).__name__})"

    parts = []
    if running and running[-1] != first:
        parts.append(f"in {layer(running[-1])}")
    if first is not None:
        inside = bool(running) and running[-1] == first
        parts.append(f"{'in ' if inside else ''}its first layer, {layer(first)}, "
                     f"{'which ' if inside else ''}takes {_expects(modules[first])}")
    return failed, "; ".join(parts), _expects(modules[first]) if first is not None else None


def check_input(model: nn.Module, name: str, shape: Sequence[int], dtype_name: str,
                device: torch.device) -> None:
    """Raise :class:`ModelMemoryError` unless ``model`` runs a training forward at ``shape``
    (wrong rank, channel count, a batch norm that would see one value per channel), saying
    what went wrong, where, and what the first layer takes. Checked on a copy moved to the
    ``meta`` device (shapes only: no data, no memory, a fraction of a second); where the
    model does not run there, on a copy on ``device`` without autograd. The model's own
    weights and running statistics are left alone."""
    dtype = DTYPES[dtype_name]
    failed = _try_forward(copy.deepcopy(model).to(device="meta", dtype=dtype), shape, dtype,
                          torch.device("meta"))
    if failed is None:
        return
    failed = _try_forward(copy.deepcopy(model).to(device=device, dtype=dtype), shape, dtype,
                          device)
    if failed is None:  # only the meta device could not run it
        return
    error, where, expects = failed
    shape_text = ",".join(map(str, shape))
    if expects is not None and len(expects.split(",")) != len(shape):
        raise ModelMemoryError(f"--input {shape_text} has {len(shape)} numbers: {name} takes "
                               f"{len(expects.split(','))}, {expects} ({where})")
    if isinstance(error, SystemExit):  # the model's code, not the input, ended the run
        raise ModelMemoryError(f"model {name!r}: its forward raised {_describe(error)} at "
                               f"--input {shape_text}" + (f" ({where})" if where else ""))
    text = f"--input {shape_text} does not fit {name}: {_describe(error)}"
    if where:
        text += f" ({where})"
    if "more than 1 value per channel" in str(error):
        text += ("; batch norm in training needs more than one value per channel (batch x "
                 "height x width > 1 at every norm): use a batch of 2 or more, or a larger image")
    raise ModelMemoryError(text)


# ---------------------------------------------------------------- measuring


@dataclass
class Converted:
    """One policy's conversion: whole-model bytes and the report's summary."""

    policy: str
    saved_bytes: int
    norm_saved_before: int
    norm_saved_after: int
    counts: dict[str, int]
    result: str
    fitting_batch: int | None = None  # None: the search found no batch that fits
    counted_on: str = ""               # the device the batch search counted on
    search_note: str = ""              # why not on meta, where it did not
    report: Any = field(default=None, repr=False)  # the iabn.ConversionReport


@dataclass
class MemoryResult:
    model: str
    source: str
    input_shape: list[int]
    dtype: str
    device: str
    saved_bytes: int                       # the model as given
    converted: dict[str, Converted]
    compiled: dict[float, int]             # activation_memory_budget -> bytes
    wall_time_s: float = 0.0

    def ratio(self, value: int) -> float:
        return value / self.saved_bytes if self.saved_bytes else float("nan")


def _count(model: nn.Module, shape: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> int:
    x = torch.randn(*shape, dtype=dtype, device=device) if device.type != "meta" else \
        torch.empty(*shape, dtype=dtype, device=device)
    return saved_tensor_bytes(model.train(), x)


def _batch_counter(converted: nn.Module, shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device, at_n: int) -> tuple[Callable[[int], int], str, str]:
    """A function batch -> the converted model's saved bytes, counted on ``meta`` when that
    gives the real count at ``shape`` (``at_n``), else on ``device``; and where, and why."""
    try:
        on_meta = copy.deepcopy(converted).to("meta")
        if _count(on_meta, shape, dtype, torch.device("meta")) == at_n:
            return (lambda n: _count(on_meta, (n, *shape[1:]), dtype, torch.device("meta")),
                    "meta", "")
        note = "the meta count differs from the real count at the given batch"
    except Exception as error:  # a layer without a meta implementation
        note = f"the model does not run on meta ({type(error).__name__})"
    return (lambda n: _count(converted, (n, *shape[1:]), dtype, device), str(device), note)


def measure(model: nn.Module, name: str, source: str, shape: Sequence[int], dtype_name: str,
            device: torch.device, budgets: Sequence[float] = (),
            progress: Callable[[str], None] | None = None) -> MemoryResult:
    """All figures of ``iabn memory`` for ``model`` (cast and moved in place; it runs only
    as copies) at an input of ``shape``."""
    import iabn

    say = progress or (lambda _text: None)
    start = time.perf_counter()
    dtype = DTYPES[dtype_name]
    model = model.to(device=device, dtype=dtype)
    x = torch.randn(*shape, dtype=dtype, device=device)
    say("counting the bytes the model as given saves for backward")
    # a copy: running statistics of the model that convert() and compile start from stay
    # those of its construction
    before = saved_tensor_bytes(copy.deepcopy(model).train(), x)
    converted, counters = {}, {}
    for policy in POLICIES:
        model2, report = iabn.convert(model, x, policy=policy, verify=False,
                                      progress=lambda text, p=policy: say(f"{p}: {text}"))
        converted[policy] = Converted(
            policy, report.saved_after, report.norm_saved_before, report.norm_saved_after,
            report.counts, report.result, report=report)
        if report.saved_before != before:  # both count the same model: a bug if they differ
            say(f"warning: convert() counted {report.saved_before} bytes for the original, "
                f"this tool {before}")
        counters[policy] = (model2, report.saved_after)
    say("searching the batch that fits the same memory")
    for policy, (model2, after) in counters.items():
        count, where, note = _batch_counter(model2, shape, dtype, device, after)
        converted[policy].fitting_batch = _fitting_batch(count, shape[0], before, after)
        converted[policy].counted_on, converted[policy].search_note = where, note
    compiled = {}
    for budget in budgets:
        say(f"compiling with activation_memory_budget={budget:g} (slow)")
        compiled[budget] = compiled_saved_bytes(copy.deepcopy(model).train(), x,
                                                activation_memory_budget=budget)
    return MemoryResult(name, source, list(shape), str(dtype).removeprefix("torch."),
                        str(device), before, converted, compiled,
                        round(time.perf_counter() - start, 2))


def _fitting_batch(count: Callable[[int], int], batch: int, budget: int,
                   at_batch: int) -> int | None:
    if at_batch == 0:  # nothing saved at all: any batch fits; there is no largest
        return None
    try:
        return largest_fitting(lambda n: count(n) <= budget, max(1, batch * budget // at_batch))
    except ValueError:  # not even one sample fits
        return None


# ---------------------------------------------------------------- output


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {d}" for d, n in sorted(counts.items()))


def format_result(result: MemoryResult) -> str:
    shape = "x".join(map(str, result.input_shape))
    lines = [f"iabn memory: {result.model} ({result.source}), input {shape} {result.dtype} on "
             f"{result.device}; activation bytes saved for backward in one training forward"]
    rows = [("", "bytes", "MiB", "ratio", "norm + activation part", "layers")]
    rows.append(("as given", str(result.saved_bytes), _mib(result.saved_bytes), "1.000", "",
                 ""))
    for c in result.converted.values():
        part = (f"{_mib(c.norm_saved_before)} -> {_mib(c.norm_saved_after)}"
                + (f" ({c.norm_saved_after / c.norm_saved_before:.3f}x)"
                   if c.norm_saved_before else ""))
        rows.append((f"convert, {c.policy}", str(c.saved_bytes), _mib(c.saved_bytes),
                     f"{result.ratio(c.saved_bytes):.3f}", part, _counts(c.counts)))
    for budget, n in result.compiled.items():
        rows.append((f"torch.compile, budget {budget:g}", str(n), _mib(n),
                     f"{result.ratio(n):.3f}", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 2, 3}
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    lines.append(_fitting_line(result))
    lines.extend(_relu_note(result))
    lines.extend(_outside_notes(result))
    return "\n".join(lines)


def _relu_note(result: MemoryResult) -> list[str]:
    """Why the lossless conversion saves (almost) nothing where ReLU follows the norms, and
    what the other policy saves: one line, or none."""
    lossless, leaky = result.converted.get("lossless"), result.converted.get("leaky_relu")
    if lossless is None or lossless.report is None:
        return []
    relu = sum("relu is not invertible" in row.reason for row in lossless.report.rows)
    if not relu or result.ratio(lossless.saved_bytes) < 0.99:
        return []
    other = (f"; policy leaky_relu (ReLU -> LeakyReLU(0.01), which changes the model: "
             f"fine-tune after) keeps {result.ratio(leaky.saved_bytes):.3f}x"
             if leaky is not None else "")
    return [f"note: lossless saves little here: {relu} norms are followed by ReLU, which "
            f"cannot be inverted (they became ABN, exact, keeping what BN + ReLU kept){other}"]


def _outside_notes(result: MemoryResult) -> list[str]:
    """A note for each conversion whose total moved by more than its norm + activation part.
    The part counts the storages the norms and their activations save first; a storage a
    later layer also saves is counted once, where it is saved first. So where a later layer
    saves a norm's output (TResNet's squeeze-excitation multiply does), a norm that is not in
    place leaves that output to the later layer, outside the part, while an in-place norm's
    output is the storage the norm keeps anyway: the total drops, the part does not."""
    notes = []
    for c in result.converted.values():
        change = (c.saved_bytes - c.norm_saved_after) - (result.saved_bytes
                                                         - c.norm_saved_before)
        if change == 0:
            continue
        text = (f"note: outside the norm + activation part, convert, {c.policy} keeps "
                f"{abs(change)} bytes ({_mib(abs(change))}) {'less' if change < 0 else 'more'} "
                f"than the model as given")
        if change < 0 and c.counts.get("InPlaceABN", 0):
            text += (": later layers save some norms' outputs, and an in-place norm's output "
                     "is the storage the norm keeps anyway, counted once in its part")
        notes.append(text)
    return notes


def _fitting_line(result: MemoryResult) -> str:
    n = result.input_shape[0]
    parts = []
    for c in result.converted.values():
        where = f"counted on {c.counted_on}" + (f": {c.search_note}" if c.search_note else "")
        found = ("none" if c.fitting_batch is None
                 else f"{c.fitting_batch} ({c.fitting_batch / n:.2f}x)")
        parts.append(f"{c.policy} {found} [{where}]")
    return f"batch that fits the memory of batch {n} as given: " + ", ".join(parts)


def versions() -> dict[str, str | None]:
    import iabn

    found: dict[str, str | None] = {"iabn": iabn.__version__, "torch": torch.__version__}
    for package in ("torchvision", "timm"):
        module = sys.modules.get(package)
        if module is None:
            try:
                module = importlib.import_module(package)
            except ImportError:
                module = None
        found[package] = getattr(module, "__version__", None)
    return found


def to_json(result: MemoryResult, arguments: dict[str, Any]) -> dict[str, Any]:
    data = {f.name: getattr(result, f.name) for f in fields(result)}
    data["compiled"] = [{"activation_memory_budget": b, "saved_bytes": n,
                         "ratio": result.ratio(n)} for b, n in result.compiled.items()]
    data["converted"] = {}
    for policy, c in result.converted.items():
        entry = {f.name: getattr(c, f.name) for f in fields(c) if f.name != "report"}
        entry["ratio"] = result.ratio(c.saved_bytes)
        entry["fitting_batch_ratio"] = (c.fitting_batch / result.input_shape[0]
                                        if c.fitting_batch else None)
        entry["report"] = c.report.to_dict()
        data["converted"][policy] = entry
    data.update(arguments=arguments, machine=machine_info(), versions=versions(),
                date=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return data


__all__ = ["DTYPES", "POLICIES", "MemoryResult", "ModelMemoryError", "build_model", "check_input",
           "format_result", "measure", "parse_budgets", "parse_input", "to_json"]
