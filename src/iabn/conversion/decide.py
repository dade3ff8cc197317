"""Which layer replaces each normalisation: the rules of docs/design.md, "Converting existing
models", applied to the facts :mod:`iabn.conversion.graph` read from the traced graphs."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..kernels import activations as registry
from ..kernels.activations import check_activation
from .graph import Site, is_norm_act

LOSSLESS = "lossless"
LEAKY_RELU = "leaky_relu"
POLICIES = (LOSSLESS, LEAKY_RELU)
#: Activations without a synchronised layer (ABNSync inverts from the output alone).
NOT_SYNCHRONISED = ("relu",)
#: The slope that replaces ReLU under ``policy="leaky_relu"`` (the paper's and timm's choice).
RELU_SLOPE = 0.01

IN_PLACE = "InPlaceABN"
#: The in-place layer with ``overwrite_input=False``: for an input that is needed again.
OUTPUT_ONLY = "InPlaceABN(overwrite_input=False)"
NOT_IN_PLACE = "ABN"
UNTOUCHED = "untouched"


@dataclass(frozen=True)
class Decision:
    """What becomes of one normalisation module."""

    layer: str                   # IN_PLACE, OUTPUT_ONLY, NOT_IN_PLACE or UNTOUCHED
    reason: str
    activation: str | None = None        # of the new layer
    activation_param: float = 0.0
    changes_model: bool = False          # ReLU swapped for LeakyReLU


def pattern(norm: nn.Module, site: Site | None) -> str:
    """The report's name for what was found, e.g. ``"BatchNorm2d -> ReLU"``."""
    name = type(norm).__name__
    if site is None:
        return name
    if is_norm_act(norm):
        return f"{name}({site.activation.written_as})"
    if site.activation is not None:
        return f"{name} -> {site.activation.written_as}"
    if site.next_op is not None:
        return f"{name} -> {site.next_op}"
    return f"{name} (no single consumer)" if len(site.node.users) > 1 else name


def _usable(activation: str, param: float, in_place: bool, branch: bool = False) -> bool:
    try:
        check_activation(activation, param, in_place=in_place, branch=branch)
    except ValueError:
        return False
    return True


def _small_weights(norm: nn.Module) -> bool:
    """``|weight| < eps`` somewhere: the in-place layer would clamp it (its backward divides
    by the scale), so it would not compute what the model computed."""
    weight = getattr(norm, "weight", None)
    return weight is not None and bool((weight.detach().abs() < norm.eps).any())


def decide(norm: nn.Module, sites: list[Site], policy: str,
           input_kept: str | None = None) -> Decision:
    """The decision for one normalisation module from its calls in the traced graphs (one per
    graph it appears in). ``input_kept``: why the norm's input stays in memory for backward
    without it (another operation saves it), if it does: then a layer that does not
    overwrite its input saves nothing by keeping only its output."""
    if norm._forward_hooks or norm._forward_pre_hooks or norm._backward_hooks:
        return Decision(UNTOUCHED, "it has hooks, which a new layer would not carry")
    site = sites[0]
    if any((s.activation, s.activation_node is None) != (site.activation,
           site.activation_node is None) for s in sites[1:]):
        return Decision(UNTOUCHED, "train and eval mode apply different activations after it")
    found = site.activation
    if found is not None and not found.supported:
        return Decision(UNTOUCHED, f"its activation {found.written_as} is not one iabn's layers "
                        f"compute ({', '.join(registry.ACTIVATIONS)})")
    name = found.name if found is not None else "identity"
    param = found.param if found is not None else 0.0
    changes_model = False
    if name == "relu" and policy == LEAKY_RELU:
        name, param, changes_model = "leaky_relu", RELU_SLOPE, True
    fused = found is not None
    sync = type(norm) is nn.SyncBatchNorm
    written = next((s.output_written for s in sites if s.output_written), None)
    not_fresh = next((s.input_fresh for s in sites if s.input_fresh), None)

    def fallback(why: str) -> Decision:
        # ABN keeps its input and its output, as the norm and its activation did, so it is safe
        # wherever they were; it changes nothing unless it absorbs an activation.
        if not fused:
            after = site.unfused or (f"{site.next_op} is not an activation iabn's layers compute"
                                     if site.next_op else "no activation follows")
            return Decision(UNTOUCHED, f"{why}; {after}, so ABN would be the norm itself")
        if written == why:
            return Decision(UNTOUCHED, f"{written}: InPlaceABN and ABN both keep that output "
                            f"for backward")
        if written is not None:
            return Decision(UNTOUCHED, f"{why}; and {written}, which ABN's saved output forbids")
        if not _usable(name, param, in_place=False) or (sync and name in NOT_SYNCHRONISED):
            return Decision(UNTOUCHED, f"{why}; and ABN{'Sync' * sync} cannot compute "
                            f"{found.written_as} with parameter {param}")
        return Decision(NOT_IN_PLACE, why, name, param, changes_model)

    if name == "relu":
        return fallback("relu is not invertible (policy='leaky_relu' swaps it for "
                        f"LeakyReLU({RELU_SLOPE}) and goes in place)")
    if not _usable(name, param, in_place=True, branch=True):
        return fallback(f"{found.written_as} with parameter {param} is not invertible")
    small = _small_weights(norm)
    if not_fresh is not None:
        # The output-only mode: the layer writes a new tensor and keeps only it, so the input
        # is freed once its other users are done, unless something else saves it too.
        reused = all(s.input_reused for s in sites)
        if not reused or not fused or written is not None or (small and policy == LOSSLESS):
            return fallback(not_fresh)
        if input_kept is not None:
            return fallback(f"{not_fresh}, and {input_kept}")
        reason = f"{not_fresh}: not overwritten; only its new output is kept for backward"
        if small:
            reason += f"; |weight| < eps={norm.eps} is clamped to eps"
        if changes_model:
            reason += f"; ReLU becomes LeakyReLU({RELU_SLOPE})"
        return Decision(OUTPUT_ONLY, reason, name, param, changes_model or small)
    if written is not None:
        return fallback(written)
    if small:
        if policy == LOSSLESS:
            return fallback(f"some |weight| < eps={norm.eps}, which the in-place layer clamps "
                            f"to eps")
        return Decision(IN_PLACE, f"input used once; |weight| < eps={norm.eps} is clamped to "
                        f"eps", name, param, changes_model=True)
    reason = "its input is used only by it" + (", output not written later" if fused else "")
    if site.unfused:
        reason += f"; {site.unfused}"
    if changes_model:
        reason += f"; ReLU becomes LeakyReLU({RELU_SLOPE})"
    return Decision(IN_PLACE, reason, name, param, changes_model)


__all__ = ["POLICIES", "Decision", "decide", "pattern"]
