"""``iabn bench``: activation memory and speed of norm → act → conv blocks, side by side.

The model is a stack of ``blocks`` identical blocks ``norm → LeakyReLU(0.01) → conv 3x3``
(``C -> C`` channels, stride 1, no bias), the pre-activation pattern of ResNeXt-style networks,
mapping ``(N, C, H, W) -> (N, C, H, W)``. Five strategies run the same weights on the same data:

``bn``          ``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=False)`` + conv
``bn_inplace``  ``nn.BatchNorm2d`` + ``nn.LeakyReLU(inplace=True)`` + conv (the baseline)
``checkpoint``  ``bn_inplace`` with each whole block (norm, act *and* conv) wrapped in
                ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: PyTorch's own way
                to keep one tensor per block, paid for by recomputing the block in backward
``iabn_I``      ``iabn.InPlaceABN(variant=1)`` + conv
``iabn_II``     ``iabn.InPlaceABN(variant=2)`` + conv

A training step is ``out = model(leaf.clone()); out.backward(grad)``: the clone gives every
strategy the same non-leaf input (the in-place layer may not overwrite a leaf), and the same
fixed upstream gradient ``grad`` stands for ``d loss / d out`` of ``loss = sum(out * grad)``.
"""

from __future__ import annotations

import math
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from statistics import median, quantiles
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ... import InPlaceABN
from ...memory import saved_storages
from ..arguments import BASELINE, BenchConfig
from . import machine_info, progress_printer, time_interleaved, train_step, training_step

STRATEGIES = ("bn", "bn_inplace", "checkpoint", "iabn_I", "iabn_II")
#: The reference the correctness check compares every strategy with.
REFERENCE = "bn"
NEGATIVE_SLOPE = 0.01
#: Largest relative error tolerated by the check (float32 sums over ~1e5-1e6 terms, through
#: several blocks and two different backward formulas, stay orders of magnitude below it).
CHECK_TOLERANCE = 1e-4
MIB = 2**20

FOOTNOTES = (
    "(1) saved bytes / bytes of one block input (per-channel statistics add a tiny fraction).",
    "(2) each whole block (norm, act and conv) wrapped in torch.utils.checkpoint.checkpoint("
    "use_reentrant=False); backward recomputes it, so BN running statistics are updated twice "
    "per step (harmless for timing and memory, wrong for training).",
    "(3) step time over the baseline's in the same repeat (they run next to each other): the "
    "median of these paired ratios, and in brackets their interquartile range over the "
    "repeats, the spread a rerun on the same machine would show.",
)
TABLE_WIDTH = 100


@dataclass
class StrategyResult:
    """One strategy's figures: saved storages (shape, dtype, bytes) and step times in ms."""

    saved_storages: list[dict[str, Any]]
    times_ms: list[float] = field(default_factory=list)

    @property
    def saved_bytes(self) -> int:
        return sum(s["nbytes"] for s in self.saved_storages)

    @property
    def median_ms(self) -> float:
        return median(self.times_ms)

    def paired_ratios(self, baseline: StrategyResult) -> list[float]:
        """This strategy's time over the baseline's, repeat by repeat (the two ran next to
        each other, under the same load)."""
        return [t / b for t, b in zip(self.times_ms, baseline.times_ms, strict=True) if b]


@dataclass(frozen=True)
class Spread:
    """The median of the paired time ratios and their interquartile range."""

    median: float
    low: float    # first quartile
    high: float   # third quartile

    @property
    def within_noise(self) -> bool:
        """The middle half of the repeats has the strategy both faster and slower."""
        return self.low < 1.0 < self.high

    @classmethod
    def of(cls, ratios: list[float]) -> Spread:
        if len(ratios) < 2:
            value = ratios[0] if ratios else math.nan
            return cls(value, value, value)
        low, middle, high = quantiles(ratios, n=4, method="inclusive")
        return cls(middle, low, high)


@dataclass
class CheckResult:
    """Largest relative differences to the reference strategy (see :func:`check_agreement`)."""

    loss_error: dict[str, float]
    grad_error: dict[str, float]
    tolerance: float = CHECK_TOLERANCE

    @property
    def passed(self) -> bool:
        errors = (*self.loss_error.values(), *self.grad_error.values())
        return all(e <= self.tolerance for e in errors)


@dataclass
class BenchResult:
    """A whole run: its config, threads used, bytes of one block input, per-strategy figures."""

    config: BenchConfig
    threads: int
    activation_bytes: int
    strategies: dict[str, StrategyResult]
    check: CheckResult


class Block(nn.Module):
    """``norm → act → conv 3x3``, ``(N, C, H, W) -> (N, C, H, W)``.

    Every strategy uses the attribute names ``norm`` and ``conv``, so all models share one
    ``state_dict`` layout (``nn.LeakyReLU`` and ``nn.Identity`` hold no state).
    """

    def __init__(self, norm: nn.Module, act: nn.Module, channels: int, checkpointed: bool):
        super().__init__()
        self.norm = norm
        self.act = act
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.checkpointed = checkpointed

    def _body(self, x: Tensor) -> Tensor:
        return self.conv(self.act(self.norm(x)))

    def forward(self, x: Tensor) -> Tensor:
        if self.checkpointed and torch.is_grad_enabled():
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


def build_block(strategy: str, channels: int) -> Block:
    """One block of ``strategy`` (one of :data:`STRATEGIES`) with fresh parameters."""
    if strategy in ("iabn_I", "iabn_II"):
        variant = 1 if strategy == "iabn_I" else 2
        norm = InPlaceABN(channels, activation_param=NEGATIVE_SLOPE, variant=variant)
        return Block(norm, nn.Identity(), channels, checkpointed=False)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    act = nn.LeakyReLU(NEGATIVE_SLOPE, inplace=strategy != "bn")
    return Block(nn.BatchNorm2d(channels), act, channels, checkpointed=strategy == "checkpoint")


def build_models(config: BenchConfig) -> dict[str, nn.Sequential]:
    """One model per strategy, all holding the reference model's exact weights."""
    torch.manual_seed(config.seed)
    models = {
        s: nn.Sequential(*(build_block(s, config.channels) for _ in range(config.blocks)))
        for s in STRATEGIES
    }
    reference = models[REFERENCE]
    with torch.no_grad():
        # Trained-looking affine parameters: with gamma = 1 and beta = 0 the scale and shift
        # that InPlace-ABN undoes in backward would drop out of the check.
        for block in reference:
            block.norm.weight.uniform_(0.5, 1.5)
            block.norm.bias.normal_(0.0, 0.2)
    state = reference.state_dict()
    for model in models.values():
        # InPlaceABN loads nn.BatchNorm2d state_dicts unchanged (same keys, signed gamma).
        model.load_state_dict(state)
        model.train()
    return models


def measure_saved(model: nn.Module, leaf: Tensor) -> list[dict[str, Any]]:
    """Distinct storages the forward saves for backward (parameters and buffers excluded)."""
    return [
        {"shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."), "nbytes": s.nbytes}
        for s in saved_storages(model, leaf.clone())
    ]


def _relative_error(value: Tensor, reference: Tensor, scale: Tensor) -> float:
    return float((value.double() - reference.double()).abs().max() / scale.clamp(min=1e-30))


def check_agreement(
    models: dict[str, nn.Module], leaf: Tensor, grad: Tensor
) -> CheckResult:
    """Compare every strategy's loss and input gradient with :data:`REFERENCE`'s.

    ``loss = sum(out * grad)``; its error is divided by ``sum(|out * grad|)``, the natural
    scale of a sum's rounding error (the loss itself may be close to zero). The gradient's
    error is its largest absolute difference divided by the reference's largest magnitude.
    """
    outs: dict[str, Tensor] = {}
    grads: dict[str, Tensor] = {}
    for name, model in models.items():
        outs[name] = train_step(model, leaf, grad).detach().double()
        grads[name] = leaf.grad.detach().clone()
    terms = {name: out * grad.double() for name, out in outs.items()}
    loss_scale = terms[REFERENCE].abs().sum()
    losses = {name: t.sum() for name, t in terms.items()}
    grad_scale = grads[REFERENCE].double().abs().max()
    return CheckResult(
        loss_error={n: _relative_error(losses[n], losses[REFERENCE], loss_scale) for n in models},
        grad_error={n: _relative_error(grads[n], grads[REFERENCE], grad_scale) for n in models},
    )


def _status(message: str) -> None:
    print(f"[iabn bench] {message}", file=sys.stderr, flush=True)


def run_bench(config: BenchConfig, progress: bool = True) -> BenchResult:
    """Build the models, check they agree, count saved activations, then time them."""
    models = build_models(config)
    generator = torch.Generator().manual_seed(config.seed + 1)
    leaf = torch.randn(config.input_shape, generator=generator).requires_grad_()
    grad = torch.randn(config.input_shape, generator=generator)
    activation_bytes = leaf.numel() * leaf.element_size()

    if progress:
        _status(f"{len(models)} strategies: checking loss and input gradient agree")
    check = check_agreement(models, leaf, grad)
    if progress:
        _status("counting saved activations")
    results = {name: StrategyResult(measure_saved(m, leaf)) for name, m in models.items()}

    if progress:
        _status(f"timing forward+backward: {config.warmup} warm-up steps, then "
                f"{config.repeats} interleaved repeats of {config.iters} steps")
    steps = {name: training_step(m, leaf, grad) for name, m in models.items()}
    callback = progress_printer("[iabn bench] ", config.repeats) if progress else None
    samples = time_interleaved(
        steps, config.repeats, iters=config.iters, warmup=config.warmup, on_repeat=callback
    )
    for name, times in samples.items():
        results[name].times_ms = times
    return BenchResult(config, torch.get_num_threads(), activation_bytes, results, check)


def _ratio(value: float, baseline: float) -> float:
    return value / baseline if baseline else math.nan


def format_table(result: BenchResult) -> str:
    """The human-readable report: header, one row per strategy, check line, footnotes."""
    cfg = result.config
    shape = "x".join(map(str, cfg.input_shape))
    base = result.strategies[BASELINE]
    lines = [
        f"iabn bench: {cfg.blocks} blocks of [norm -> LeakyReLU({NEGATIVE_SLOPE}) -> conv 3x3], "
        f"input {shape} float32 ({result.activation_bytes / MIB:.2f} MiB)",
        f"torch {torch.__version__}, {result.threads} threads; step ms = forward + backward, "
        f"median of {cfg.repeats} interleaved",
        f"repeats (mean of {cfg.iters} steps each) after {cfg.warmup} warm-up steps",
        "",
        f"{'strategy':<14}{'saved MiB':>11}{'activations(1)':>16}{'vs ' + BASELINE:>15}"
        f"{'step ms':>10}  {'vs ' + BASELINE + ' (3)'}",
    ]
    noisy = []
    for name, r in result.strategies.items():
        label = f"{name}(2)" if name == "checkpoint" else name
        spread = Spread.of(r.paired_ratios(base))
        time_text = "" if name == BASELINE else (
            f"{spread.median:.2f}x ({spread.low:.2f}-{spread.high:.2f})"
            + (" within noise" if spread.within_noise else ""))
        if name != BASELINE and spread.within_noise:
            noisy.append(name)
        lines.append(
            f"{label:<14}{r.saved_bytes / MIB:>11.2f}"
            f"{r.saved_bytes / result.activation_bytes:>16.2f}"
            f"{_ratio(r.saved_bytes, base.saved_bytes):>14.2f}x"
            f"{r.median_ms:>10.1f}  {time_text}".rstrip()
        )
    lines += ["", *_wrap(format_check(result.check)), *(w for f in FOOTNOTES for w in _wrap(f))]
    if noisy:
        lines += _wrap(f"Within noise: {', '.join(noisy)} ran both faster and slower than "
                       f"{BASELINE} in the middle half of the repeats; their time ratio is "
                       f"not a measured difference on this machine.")
    return "\n".join(lines)


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, TABLE_WIDTH, subsequent_indent="    ")


def format_check(check: CheckResult) -> str:
    """One line: whether all strategies match the reference, with the worst errors."""
    worst_loss = max(check.loss_error.values())
    worst_grad = max(check.grad_error.values())
    errors = f"max rel. error: loss {worst_loss:.1e}, input grad {worst_grad:.1e}"
    if check.passed:
        return (f"check: OK, all strategies give {REFERENCE}'s loss and input gradient "
                f"({errors}; tolerance {check.tolerance:.0e})")
    bad = sorted(
        n for n in check.loss_error
        if max(check.loss_error[n], check.grad_error[n]) > check.tolerance
    )
    return (f"check: MISMATCH, {', '.join(bad)} differ from {REFERENCE} beyond "
            f"{check.tolerance:.0e} ({errors})")


def _strategy_json(r: StrategyResult, base: StrategyResult,
                   activation_bytes: int) -> dict[str, Any]:
    spread = Spread.of(r.paired_ratios(base))
    return {
        "saved_bytes": r.saved_bytes,
        "saved_activations": r.saved_bytes / activation_bytes,
        "saved_vs_baseline": _ratio(r.saved_bytes, base.saved_bytes),
        "saved_storages": r.saved_storages,
        "time_ms_median": r.median_ms,
        # the median of the paired (same-repeat) ratios, their quartiles, and whether those
        # lie on both sides of 1
        "time_vs_baseline": spread.median,
        "time_vs_baseline_quartiles": [spread.low, spread.high],
        "time_within_noise": spread.within_noise,
        "time_ms_samples": r.times_ms,
    }


def to_json(result: BenchResult, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything measured, plus machine info and the arguments, as a JSON-ready dict."""
    base = result.strategies[BASELINE]
    return {
        "benchmark": "iabn bench",
        "machine": machine_info(),
        "args": args if args is not None else asdict(result.config),
        "config": asdict(result.config),
        "model": f"{result.config.blocks} x [norm -> LeakyReLU({NEGATIVE_SLOPE}) -> conv 3x3]",
        "input_shape": list(result.config.input_shape),
        "dtype": "float32",
        "activation_bytes": result.activation_bytes,
        "baseline": BASELINE,
        "checkpoint_scope": "whole block (norm, act, conv); use_reentrant=False",
        "strategies": {name: _strategy_json(r, base, result.activation_bytes)
                       for name, r in result.strategies.items()},
        "check": {
            "reference": REFERENCE,
            "passed": result.check.passed,
            "tolerance": result.check.tolerance,
            "loss_relative_error": result.check.loss_error,
            "input_grad_relative_error": result.check.grad_error,
        },
    }


__all__ = [
    "BASELINE",
    "STRATEGIES",
    "BenchConfig",
    "BenchResult",
    "build_models",
    "check_agreement",
    "format_table",
    "run_bench",
    "to_json",
]
