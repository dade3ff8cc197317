"""What :func:`iabn.convert` replaces on its own, not fused with a neighbour: layer and RMS
norms (``nn.LayerNorm``, ``nn.RMSNorm``, timm's ``LayerNorm``, ``LayerNorm2d``, ``RmsNorm``)
and the activations no batch or group norm absorbed (modules, and the registry's function
forms where the graph is rewritten: :func:`~iabn.conversion.graph.stands_alone`), the
sites of :class:`~iabn.conversion.kinds.NormAlone` and
:class:`~iabn.conversion.kinds.ActivationAlone` (docs/design.md, "Converting existing
models").

Each keeps its input for backward as PyTorch computes it; iabn's layer keeps its output
instead (plus per-row statistics, or one bit per element), so the rules are the batch-norm
layers' without the fusion:

- nothing may write into its output later (the new layer keeps it);
- *in place* (``overwrite_input=True``) where its input is fresh: made by a convolution,
  linear layer, addition or concatenation and used by nothing else;
- *output only* (``overwrite_input=False``) where the input is computed in the graph and read
  by other operations (a transformer's residual stream, read again by the addition) or comes
  through a view, and no other operation saves it for backward: the input is then freed once
  those operations are done, where PyTorch's layer kept it to the end of backward — unless
  the call writes into its input (``nn.SiLU(inplace=True)``, ``F.silu(x, inplace=True)``):
  the operations reading that input afterwards read the activation's output, which a layer
  leaving its input as it is would change.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx, nn

from ..layers.layer_norm import InPlaceLayerNorm, InPlaceLayerNorm2d, InPlaceRMSNorm
from .decide import IN_PLACE, OUTPUT_ONLY, UNTOUCHED, Decision
from .graph import (
    Activation,
    Escape,
    input_not_fresh,
    later_write,
    node_activation,
    norm_form,
    site_key,
    writes_first_argument,
)


@dataclass(frozen=True)
class LayerSite:
    """One call replaced on its own (a module, or an activation written as a function), in
    one graph."""

    key: str                    # graph.site_key: the module's name, a function call's node's
    node: fx.Node
    input_fresh: str | None     # None when fresh (in place is safe), else why not
    output_written: str | None  # None when nothing writes the output later, else why
    input_outside: str | None   # why the input is not a tensor computed in the graph
    writes_input: bool = False  # the call writes its result into its input (inplace=True)
    activation: Activation | None = None  # what an activation site computes


def find_layer_sites(graph: fx.Graph, modules: dict[str, nn.Module],
                     escapes: dict[fx.Node, Escape], wanted) -> list[LayerSite]:
    """Every call in ``graph`` for which ``wanted(node)`` holds, with its facts."""
    sites = []
    for node in graph.nodes:
        if not wanted(node):
            continue
        source = node.args[0] if node.args else None
        outside = None
        if not isinstance(source, fx.Node):
            outside = "its input is not a traced tensor"
        elif source.op == "placeholder":
            outside = "its input is the model's input, which the caller keeps"
        elif source in escapes:
            outside = f"its input escapes: {escapes[source].how}"
        elif any(user.op == "output" for user in source.users):
            outside = "its input is also returned by the model"
        sites.append(LayerSite(site_key(node), node, input_not_fresh(node, modules, escapes),
                               later_write(node, modules, escapes), outside,
                               writes_first_argument(node, modules) is True,
                               node_activation(node, modules)))
    return sites


def decide_layer(module: nn.Module | None, sites: list[LayerSite], input_kept: str | None
                 ) -> Decision:
    """In place, output only or untouched, from the calls in the graphs (one per graph) of
    ``module`` (``None``: a function). ``input_kept``: why the input stays saved for backward
    whatever this layer keeps (another operation saves it), if it does."""
    if module is not None and (module._forward_hooks or module._forward_pre_hooks
                               or module._backward_hooks):
        return Decision(UNTOUCHED, "it has hooks, which a new layer would not carry")
    kept = "the new layer keeps its output for backward"
    written = next((s.output_written for s in sites if s.output_written), None)
    if written is not None:
        return Decision(UNTOUCHED, f"{written}, and {kept}")
    not_fresh = next((s.input_fresh for s in sites if s.input_fresh), None)
    if not_fresh is None:
        return Decision(IN_PLACE, "its input is used only by it, output not written later")
    outside = next((s.input_outside for s in sites if s.input_outside), None)
    if outside is not None:
        return Decision(UNTOUCHED, f"{outside}: keeping only the output would free nothing")
    if input_kept is not None:
        return Decision(UNTOUCHED, f"{not_fresh}, and {input_kept}")
    if any(s.writes_input for s in sites):
        # the operations reading the input after it read the output there: a layer that
        # leaves its input as it is would change what they compute
        return Decision(UNTOUCHED, f"{not_fresh}, and it writes into its input in place, "
                        f"so a layer that leaves the input as it is would change what they "
                        f"read")
    return Decision(OUTPUT_ONLY, f"{not_fresh}: not overwritten; only its output is kept "
                    f"for backward")


def new_norm(module: nn.Module, decision: Decision) -> nn.Module:
    """iabn's layer for the layer or RMS norm ``module``, holding its very parameters (an
    optimizer built on them keeps working)."""
    overwrite = decision.layer == IN_PLACE
    form = norm_form(module)
    weight = getattr(module, "weight", None)
    # a recognised module's parameters are 1-d: the features normalised
    shape = getattr(module, "normalized_shape", None) or tuple(weight.shape)
    affine = weight is not None
    if form.kind == "layer_norm":
        layer = InPlaceLayerNorm(shape, form.eps, affine, form.bias,
                                 overwrite_input=overwrite, device="meta")
    elif form.kind == "layer_norm_2d":
        (channels,) = shape
        layer = InPlaceLayerNorm2d(channels, form.eps, affine, overwrite_input=overwrite)
        if affine and not form.bias:
            layer.bias = None
    else:
        layer = InPlaceRMSNorm(shape, form.eps, affine, overwrite_input=overwrite,
                               weight_offset=form.weight_offset, upcast=form.upcast,
                               device="meta")
    for field in ("weight", "bias"):
        if getattr(layer, field, None) is not None:
            setattr(layer, field, getattr(module, field))
    layer.train(module.training)
    return layer


__all__ = ["LayerSite", "decide_layer", "find_layer_sites", "new_norm"]
