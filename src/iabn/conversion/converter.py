"""``iabn.convert``: replace the normalisation layers of an existing model by iabn's."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, fx, nn
from torch.utils._pytree import tree_leaves, tree_map

from ..layers.batch_norm import ABN
from ..layers.group_norm import GroupNormAct
from ..measure.trial_runs import preserved, same_randomness
from ..memory import attributing_saves, saved_tensor_bytes, state_keys, storage_key
from .decide import IN_PLACE, LOSSLESS, NOT_IN_PLACE, POLICIES, UNTOUCHED
from .graph import (
    OWN_LAYERS,
    Traced,
    add_escape,
    is_convertible_norm,
    is_layer_site,
    is_site_module,
    is_site_node,
    node_activation,
    site_key,
    trace,
)
from .kinds import Context, Plan, plan
from .recording import record
from .report import ConversionReport, LayerRow
from .rewrite import as_graph_module, removal_obstacle, swap, swap_obstacle


class ConversionWarning(UserWarning):
    """The model's forward reads tensor values where torch.fx cannot trace it; it was
    converted part by part."""


def convert(
    model: nn.Module,
    example_input: Tensor | tuple[Any, ...] | None = None,
    policy: str = LOSSLESS,
    *,
    example_kwargs: dict[str, Any] | None = None,
    verify: bool = True,
    progress: Callable[[str], None] | None = None,
    activations: bool = True,
) -> tuple[nn.Module, ConversionReport]:
    """Replace each batch norm (and the activation that follows it), group, layer and RMS norm,
    and GELU/SiLU/Mish by iabn's layers where that is provably safe; return ``(converted
    model, report)``. ``model`` is not modified.

    Every ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and timm ``BatchNormAct2d`` becomes:

    - :class:`iabn.InPlaceABN` (``InPlaceABNSync``) where its input is produced by a
      convolution, linear layer, addition or concatenation and used by nothing else (nor
      kept outside the graph: a module attribute, a hook), nothing writes into its output
      later (also through an operation that may return its input, such as ``dropout`` in eval
      mode), its activation (LeakyReLU, ELU, Identity, none) is invertible, and, under the
      lossless policy, no ``|weight| < eps`` would be clamped;
    - the same layer with ``overwrite_input=False`` (the output-only mode: a new output,
      only it kept for backward) where the conditions hold except that the input is also read
      by other operations of the graph, and no operation other than normalisations saves that
      input for backward (a residual stream that an addition reads again): the layer no
      longer keeps its input, which is freed once those operations are done;
    - :class:`iabn.ABN` (``ABNSync``) where it is followed by an activation that an in-place
      layer may not absorb there (ReLU under the lossless policy, an input kept outside the
      graph or saved by another operation...);
    - untouched otherwise; the report gives the reason for each layer.

    ``nn.GroupNorm`` follows the same rules, becoming :class:`iabn.InPlaceGroupNormAct` for
    ``InPlaceABN`` (and its output-only mode) and :class:`iabn.GroupNormAct` for ``ABN``.

    Layer and RMS norms (``nn.LayerNorm``, ``nn.RMSNorm``, timm's ``LayerNorm``,
    ``LayerNorm2d``, ``RmsNorm``, torchvision's ConvNeXt ``LayerNorm2d``) and the GELU, SiLU
    and Mish modules no norm absorbed (a transformer's MLP) become iabn's layers of the same
    computation, which keep their output instead of their input
    (:class:`iabn.InPlaceLayerNorm`, :class:`iabn.InPlaceLayerNorm2d`,
    :class:`iabn.InPlaceRMSNorm`, :class:`iabn.InPlaceGELU`, :class:`iabn.InPlaceSiLU`,
    :class:`iabn.InPlaceMish`): in place under the rules above, output-only where their input
    is computed in the graph and saved by no other operation (a residual stream), untouched
    otherwise (:mod:`iabn.conversion.layers`). The activation layers are those of
    :func:`iabn.layers.activation.activation_layer` for the registry's records; an
    activation with one minimum that has no such layer stays, with that reason. Modules of
    classes iabn does not know (Hugging Face's ``LlamaRMSNorm``, ``T5LayerNorm``, Gemma's
    RMSNorm, ``GELUActivation``, ``NewGELUActivation``, ``SiLUActivation``, ConvNeXt's
    channels-first layer norm) are recognised by what they compute, verified numerically
    in float64, float32 and bfloat16 (:mod:`iabn.conversion.recognise`); one that matches
    no form stays, and its row says why. Activations
    written as functions (``F.gelu(x)``, ``F.silu``, ``F.mish``) become calls of these layers
    by the same rules where the result is a generated module anyway; where it is the model's
    own class they stay, and a note of the report names them.

    The rules are checked on ``torch.fx`` graphs of the forward in training and in eval mode.
    Where every decision can be expressed by swapping modules, the result is ``model``'s own
    class with modules swapped (fused activation modules become ``nn.Identity``); otherwise
    (an activation module shared by several calls, ``F.relu`` in forward) it is a
    :class:`~iabn.conversion.rewrite.TrainEvalGraphModule` generated from the graphs, with
    the same ``state_dict`` keys, unless forward keeps values outside the graph (which only
    the model's own forward does): then such activations stay separate.

    A model ``torch.fx`` cannot trace (loops over module lists routed by stored indices,
    a size check in forward) is analysed from a recorded run of its forward on
    ``example_input`` in both modes (:mod:`iabn.conversion.recording`), by the same rules,
    for that input's shape; the result then only swaps modules, so activations written as
    functions or shared modules stay separate. One whose forward reads tensor values into
    Python (``bool``, ``.item()``) may take other paths for other inputs: it is converted part
    by part (the largest submodules whose forward reads no values, each with the input it got,
    its outputs treated as written by the code around it; the norms outside stay), with a
    :class:`ConversionWarning` naming where.

    Args:
        model: the network, on any device; its weights and buffers are carried over.
        example_input: a tensor (or a tuple of ``forward``'s arguments) on the model's device;
            used to measure the saved bytes and to compare outputs, never to train; for a
            model fx cannot trace, also to record the run the decisions are read from.
            ``None``: no positional arguments (give ``example_kwargs``).
        example_kwargs: ``forward``'s keyword arguments (a Hugging Face model's batch,
            ``{"input_ids": ..., "attention_mask": ...}``): the model is called as
            ``model(*example_input, **example_kwargs)`` by every step (the analysis, the
            byte counts, ``verify``).
        policy: ``"lossless"`` (default): outputs equal the original's to floating-point
            rounding, in train and eval mode. ``"leaky_relu"``: ReLU after a norm becomes
            LeakyReLU(0.01) so that the layer can go in place; this changes the model (plan
            to fine-tune), and ``|weight| < eps`` is clamped.
        verify: run the original and the converted model on ``example_input`` in eval and in
            train mode (on copies: the returned model's running statistics are untouched),
            run a backward pass through the converted one in each mode (an error if it
            fails where the original's runs), and put the largest output differences in the
            report.
        progress: called with a line of text at each stage (e.g. ``print``).
        activations: also replace the GELU, SiLU and Mish modules and function calls that
            no norm absorbed (``False``: they stay, with that reason). Their backward
            works from the output and a bit (fitted slopes, on a CPU one Numba loop; Newton
            steps in float64): forward and backward take 0.9-2x PyTorch's on a CPU, 2-5x
            where Numba is missing (docs/limits.md); the norms' replacements cost little
            time.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r}: use one of {', '.join(map(repr, POLICIES))} "
                         f"('lossless' keeps the outputs, 'leaky_relu' swaps ReLU for "
                         f"LeakyReLU(0.01) to go in place)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args, kwargs = _example(model, example_input, example_kwargs)
    if not isinstance(activations, bool):
        raise TypeError(f"activations={activations!r}: must be True (replace GELU/SiLU/Mish "
                        f"modules too) or False (only norms)")
    return _convert(model, args, policy, verify, progress or (lambda _text: None),
                    activations=activations, kwargs=kwargs)


def _example(model: nn.Module, example_input: Any, example_kwargs: Any
             ) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of the calls ``model(*args, **kwargs)``: the keyword arguments that
    name a positional parameter of ``forward`` become positional ones (with the defaults of
    those before them), which fx's graphs take; the others (keyword-only, ``**kwargs``) stay
    keywords. Errors name the argument, before anything runs."""
    if example_kwargs is not None and not (
            isinstance(example_kwargs, dict) and all(isinstance(k, str) for k in example_kwargs)):
        raise TypeError(f"example_kwargs must be a dict of forward's keyword arguments by name, "
                        f"e.g. {{'input_ids': ids, 'attention_mask': mask}}, got "
                        f"{type(example_kwargs).__name__}")
    kwargs = dict(example_kwargs or {})
    if example_input is None:
        args: tuple = ()
    else:
        args = example_input if isinstance(example_input, tuple) else (example_input,)
    if not any(isinstance(a, Tensor) for a in tree_leaves((args, kwargs))):
        raise TypeError("example_input must be a tensor or a tuple of forward's arguments "
                        "with at least one tensor (in lists and dicts too: a detector's list "
                        "of images), e.g. torch.randn(8, 3, 224, 224), or example_kwargs a "
                        "dict of keyword arguments with one (a Hugging Face batch)")
    if not kwargs:
        return args, kwargs
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # no signature to read: call as given
        return args, kwargs
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"example_input and example_kwargs do not fit "
                        f"{type(model).__name__}.forward{signature}: {error}; give the "
                        f"arguments forward takes") from None
    positional, rest = [], {}
    names = [name for name, p in signature.parameters.items()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    last = max((i for i, name in enumerate(names) if name in bound.arguments), default=-1)
    for name in names[:last + 1]:
        if name in bound.arguments:
            positional.append(bound.arguments[name])
        elif signature.parameters[name].default is not inspect.Parameter.empty:
            positional.append(signature.parameters[name].default)
        else:  # bind would have refused
            raise TypeError(f"example_kwargs: forward's argument {name!r} is missing")
    for name, value in bound.arguments.items():
        parameter = signature.parameters[name]
        if parameter.kind == parameter.VAR_POSITIONAL:
            positional.extend(value)
        elif parameter.kind == parameter.VAR_KEYWORD:
            rest.update(value)
        elif parameter.kind == parameter.KEYWORD_ONLY:
            rest[name] = value
    return tuple(positional), rest


def _convert(model: nn.Module, args: tuple, policy: str, verify: bool,
             say: Callable[[str], None], enclosed: bool = False, activations: bool = True,
             kwargs: dict[str, Any] | None = None) -> tuple[nn.Module, ConversionReport]:
    """:func:`convert` after its argument checks. ``enclosed``: ``model`` is a submodule of
    a model being converted part by part, so the code around it may write into its outputs.
    ``kwargs``: keyword arguments of every call that fit no positional parameter."""
    kwargs = kwargs or {}
    # ``original`` is traced (the tracer adds its constants to it) and is the reference of
    # the comparisons; ``work`` becomes the result. ``model`` itself is never run.
    original = _deepcopy(model)
    work = _deepcopy(model)
    say("tracing the model in train and eval mode")
    analysis = _analyse(original, args, say, kwargs)
    reads = list(dict.fromkeys(r for t in analysis.traced.values() for r in t.value_reads))
    if reads:
        why = (f"{analysis.not_traced}, and its forward reads tensor values into Python "
               f"({_listed(reads)}), so other inputs may take paths this run did not")
        return _convert_by_parts(original, work, args, policy, verify, why, say,
                                 analysis.traced, activations, kwargs)
    if enclosed:
        _outputs_escape(analysis.traced)
    say("counting the bytes the original model saves for backward")
    before = _bytes_before(original, analysis, args)
    decided = plan(_context(original, analysis, policy, activations, before[2]), work)
    say(f"replacing {len(decided.layers) + len(decided.calls)} of {len(decided.rows)} layers; "
        f"counting the bytes the converted model saves")
    converted, result, why, after = _put_in(work, original, analysis, decided, args, kwargs)
    report = _report(decided, policy, (args, kwargs), before, after, result, why)
    if verify:
        say("comparing outputs with the original in eval and train mode")
        report.max_difference_eval, report.max_difference_train = _differences(
            original, converted, args, kwargs)
    return converted, report


class _Analysis(NamedTuple):
    """The model's graphs in both modes, and how they were made."""

    traced: dict[bool, Traced]
    #: of a recorded run: the saves and norm inputs it counted (``None``: fx's trace)
    recorded_saves: tuple | None = None
    #: why fx could not trace the model, for the report (``None``: it could)
    not_traced: str | None = None
    #: of fx's graphs: :func:`_bytes_per_node` of the training-mode graph
    counted: tuple | None = None


def _analyse(original: nn.Module, args: tuple, say: Callable[[str], None],
             kwargs: dict[str, Any]) -> _Analysis:
    """fx's graphs of ``original`` in train and eval mode, else recorded runs' graphs (also
    where forward takes keyword-only arguments, which fx's graph has no inputs for)."""
    if kwargs:
        say("keyword-only arguments: recording a run in train and eval mode")
        traced, recorded_saves = _record_both(original, args, kwargs)
        return _Analysis(traced, recorded_saves,
                         f"{type(original).__name__} takes keyword-only arguments "
                         f"({', '.join(kwargs)}), which torch.fx's graph has no inputs for")
    try:
        traced = {mode: trace(original, mode) for mode in (True, False)}
    except Exception as error:  # fx raises many kinds for untraceable code
        say(f"torch.fx cannot trace it ({type(error).__name__}); recording a run in train "
            f"and eval mode instead")
        recorded = _record_both(original, args, kwargs)
        return _Analysis(*recorded, _fx_failure(original, error))
    try:
        # fx traced forward on proxies: an argument given as None (a Hugging Face layer's
        # token_type_ids) took the branch of a tensor, so the graph may not run on the example
        counted = _bytes_per_node(original, traced[True].graph, args)
    except Exception as error:
        say(f"torch.fx's graph fails on the example ({type(error).__name__}); recording a run "
            f"in train and eval mode instead")
        recorded = _record_both(original, args, kwargs)
        return _Analysis(*recorded, f"torch.fx's graph of {type(original).__name__} fails on "
                         f"the example ({_first_line(error, 120)})")
    return _Analysis(traced, counted=counted)


def _bytes_before(original: nn.Module, analysis: _Analysis, args: tuple
                  ) -> tuple[dict[str, int], int, dict[str, set[fx.Node]]]:
    """:func:`_bytes_per_node` of the original model (a recorded run counted them)."""
    if analysis.recorded_saves is None:
        return analysis.counted
    return _bytes_by_norm(analysis.traced[True].graph, dict(original.named_modules()),
                          *analysis.recorded_saves)


def _outputs_escape(traced: dict[bool, Traced]) -> None:
    """Count a part's outputs as written by the code around the part."""
    for t in traced.values():
        output = next(n for n in t.graph.nodes if n.op == "output")
        add_escape(t.escapes, output.all_input_nodes, "returned to the code around this "
                   "part of the model, which may write into it", may_write=True,
                   needs_class=False)


def _context(original: nn.Module, analysis: _Analysis, policy: str, activations: bool,
             input_savers: dict[str, set[fx.Node]]) -> Context:
    """What the kinds read: the graphs, and which activations the result can remove."""
    graphs = [t.graph for t in analysis.traced.values()]
    # Values that forward keeps outside its graph (a module attribute, a list on self, a hook
    # of a traced module) exist only when the model's own forward runs: then the model must
    # keep its class, so activations that a module swap cannot remove stay separate; and a
    # recorded graph is not code to run.
    kept = next((e.how for t in analysis.traced.values() for e in t.escapes.values()
                 if e.needs_class), None)
    only_modules = (f"{analysis.not_traced}, so only modules can be swapped"
                    if analysis.recorded_saves is not None else
                    f"the model must keep its class: forward keeps a value outside the graph, "
                    f"{kept}" if kept is not None else None)
    unfusable = None
    if only_modules is not None:
        obstacle = removal_obstacle(original, graphs)

        def unfusable(node):
            why = obstacle(node)
            return why and f"{why}, and {only_modules}"

    def calls_stay(fused):
        if only_modules is not None:
            return only_modules
        if swap_obstacle(original, graphs, fused) is None:
            return "every other decision is a module swap, which keeps the model's class"
        return None

    return Context(original, dict(original.named_modules()), analysis.traced, policy,
                   activations, input_savers, unfusable, calls_stay)


def _put_in(work: nn.Module, original: nn.Module, analysis: _Analysis, decided: Plan,
            args: tuple, kwargs: dict[str, Any]
            ) -> tuple[nn.Module, str, str, tuple[dict[str, int], int]]:
    """The converted model, the report's result and its reason, and the bytes the converted
    model saves (per site and in all)."""
    graphs = {mode: t.graph for mode, t in analysis.traced.items()}
    obstacle = swap_obstacle(original, list(graphs.values()), decided.fused)
    if analysis.recorded_saves is not None:
        # Context.unfusable kept every fusion a module swap; calls stayed
        assert obstacle is None and not decided.calls, obstacle
        converted = swap(work, decided.layers, decided.fused)
        why = (f"{analysis.not_traced}: decided on one recorded run in train and eval mode at "
               f"input shape {_shape_text((args, kwargs))}; a forward that branches on sizes "
               f"may take other paths at other shapes")
        after, saved_after, _ = _bytes_recorded(converted, args, kwargs)
        return converted, "modules swapped", why, (after, saved_after)
    if obstacle is None:
        assert not decided.calls  # Context.calls_stay kept them
        converted = swap(work, decided.layers, decided.fused)
        probe = _deepcopy(converted)  # traced, so it gets the tracer's constants
        after, saved_after, _ = _bytes_per_node(probe, trace(probe, True).graph, args)
        return converted, "modules swapped", ("every decision is a module swap; the class is "
                                              "kept"), (after, saved_after)
    converted = as_graph_module(work, decided.layers, graphs, decided.fused, traced=original,
                                calls=decided.calls)
    after, saved_after, _ = _bytes_per_node(converted, converted.__dict__["_graphs"][True], args)
    return converted, "torch.fx GraphModule", obstacle, (after, saved_after)


def _report(decided: Plan, policy: str, args: tuple,
            before: tuple[dict[str, int], int, Any], after: tuple[dict[str, int], int],
            result: str, why: str) -> ConversionReport:
    """The report of the plan: a row per subject with the bytes its calls saved before and
    after (a replaced function call's are its new module's), totals, notes."""
    (before_rows, saved_before, _), (after_rows, saved_after) = before, after
    rows = [LayerRow(row.subject.name, row.pattern,
                     _layer_name(decided.layer(row.subject.name)), row.decision.reason,
                     before_rows.get(row.subject.key),
                     after_rows.get(row.subject.key if row.decision.layer == UNTOUCHED
                                    else row.subject.name))
            for row in decided.rows]
    report = ConversionReport(policy, _shapes(args), rows, saved_before, saved_after, result,
                              why)
    if any(row.decision.changes_model for row in decided.rows):
        report.notes.append("policy 'leaky_relu' changed the model (ReLU -> LeakyReLU(0.01) or "
                            "clamped |weight| < eps): fine-tune before use")
    report.notes.extend(decided.notes)
    return report


# ---------------------------------------------------------------- running without side effects


def _deepcopy(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, except that tensors a forward left on its modules (``self.x =
    h``, a list on self) which are not autograd leaves are shared: deepcopy refuses them."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for name, value in vars(m).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                for t in tree_leaves(value):
                    if isinstance(t, Tensor) and not t.is_leaf:
                        memo[id(t)] = t
    return copy.deepcopy(model, memo)


# ---------------------------------------------------------------- byte accounting


class _Attributing(fx.Interpreter):
    """Runs a graph and remembers which node is running, to attribute saved tensors, and the
    storage of each normalisation call's input."""

    current: str = ""

    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.norm_inputs: dict[str, Any] = {}   # node name -> storage key of its input
        #: those storages, held while the interpreter lives (recording._Recorder says why)
        self.norm_input_storages: list[Any] = []
        self._modules = dict(module.named_modules())

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        if is_site_node(n, self._modules):
            first = self.env.get(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
            if isinstance(first, Tensor):
                self.norm_inputs[n.name] = storage_key(first)
                self.norm_input_storages.append(first.untyped_storage())
        return super().run_node(n)


def _bytes_per_node(model: nn.Module, graph: fx.Graph,
                    args: tuple) -> tuple[dict[str, int], int, dict[str, set[fx.Node]]]:
    """For each normalisation module called in ``graph``: bytes of the storages that it and
    the activation consuming its output are first to save for backward (training mode); the
    bytes of all of them, which is :func:`iabn.memory.saved_tensor_bytes` of the model (the
    graph computes what the model computes; ``tests/conversion/test_convert_zoo.py`` compares them);
    and, for each convertible norm, the other nodes that save (part of) its input's storage."""
    with preserved(model), same_randomness(args):
        model.train()
        module = fx.GraphModule(model, graph)
        interpreter = _Attributing(module)
        with attributing_saves(lambda: interpreter.current, state_keys(model)) as saves:
            out = interpreter.run(*args)
            del out
    return _bytes_by_norm(graph, dict(module.named_modules()), saves, interpreter.norm_inputs)


def _record_both(model: nn.Module, args: tuple, kwargs: dict[str, Any]
                 ) -> tuple[dict[bool, Traced], tuple]:
    """Recorded runs in train and eval mode (:mod:`iabn.conversion.recording`), the train
    run counting the bytes saved for backward; the model's state is restored."""
    traced, counted = {}, None
    for mode in (True, False):
        with preserved(model), same_randomness((args, kwargs)):
            try:
                traced[mode], saves, norm_inputs = record(model, args, mode, count_saves=mode,
                                                          kwargs=kwargs)
            except Exception as error:
                raise ValueError(
                    f"example_input: {type(model).__name__}'s forward fails on it in "
                    f"{'train' if mode else 'eval'} mode ({_first_line(error, 200)}); give "
                    f"an input the model runs on, e.g. a batch of the training data"
                ) from error
        if mode:
            counted = (saves, norm_inputs)
    return traced, counted


def _bytes_recorded(model: nn.Module, args: tuple, kwargs: dict[str, Any]
                    ) -> tuple[dict[str, int], int, dict[str, set[fx.Node]]]:
    """:func:`_bytes_per_node` from a recorded training-mode run of ``model``."""
    with preserved(model), same_randomness((args, kwargs)):
        traced, saves, norm_inputs = record(model, args, True, count_saves=True,
                                            kwargs=kwargs)
    return _bytes_by_norm(traced.graph, dict(model.named_modules()), saves, norm_inputs)


def _bytes_by_norm(graph: fx.Graph, modules: dict[str, nn.Module], saves: Any,
                   norm_inputs: dict[str, Any]
                   ) -> tuple[dict[str, int], int, dict[str, set[fx.Node]]]:
    """:func:`_bytes_per_node`'s figures from the saves attributed to ``graph``'s nodes."""
    sizes, savers, alone = saves.first_bytes, saves.savers, saves.alone_bytes()
    by_name = {node.name: node for node in graph.nodes}
    result, input_savers = {}, {}
    for node in graph.nodes:
        m = modules[node.target] if node.op == "call_module" else None
        if isinstance(m, OWN_LAYERS) or (is_site_node(node, modules) and (
                m is None or is_layer_site(m))):
            # what it alone keeps: its output is saved by the next layer whichever keeps it
            result[site_key(node)] = alone.get(node.name, 0)
        elif m is not None and (is_convertible_norm(m) or isinstance(m, (ABN, GroupNormAct))):
            result[node.target] = sizes.get(node.name, 0) + sum(
                sizes.get(user.name, 0) for user in node.users
                if node_activation(user, modules) is not None)
        if node.name in norm_inputs:
            names = savers.get(norm_inputs[node.name], set()) - {node.name}
            input_savers[site_key(node)] = {by_name[n] for n in names if n in by_name}
    return result, sum(sizes.values()), input_savers


def _first_line(error: Exception, most: int) -> str:
    """``TraceError: its first line``, cut at ``most`` characters, for a one-line message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:most] if lines else ''}"


def _fx_failure(model: nn.Module, error: Exception) -> str:
    return f"torch.fx cannot trace {type(model).__name__} ({_first_line(error, 120)})"


def _listed(items: list[str], most: int = 3) -> str:
    more = len(items) - most
    return ", ".join(items[:most]) + (f" and {more} more" if more > 0 else "")


def _shape_text(args: tuple) -> str:
    return ", ".join("x".join(map(str, shape)) for shape in _shapes(args))


def _layer_name(layer: nn.Module | None) -> str:
    """The report's name of a new layer: its class, and the output-only mode."""
    if layer is None:
        return UNTOUCHED
    name = type(layer).__name__
    return name if getattr(layer, "overwrite_input", True) else f"{name}(overwrite_input=False)"


def _saved(model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> int:
    with preserved(model), same_randomness((args, kwargs)):
        return saved_tensor_bytes(model.train(), *args, **kwargs)


def _shapes(args: Any) -> list[list[int]]:
    return [list(a.shape) for a in tree_leaves(args) if isinstance(a, Tensor)]


def _differences(original: nn.Module, converted: nn.Module, args: tuple,
                 kwargs: dict[str, Any]) -> tuple[float, float]:
    """Largest absolute output difference in eval and in train mode, each after a backward
    pass through the converted model in that mode (frozen-statistics fine-tuning and input
    gradients run backward in eval mode). Nothing of either model changes: statistics are
    restored, gradients are not accumulated."""
    result = []
    with preserved(original), preserved(converted):
        for training in (False, True):
            original.train(training)
            converted.train(training)
            with same_randomness((args, kwargs)):
                expected = [t for t in tree_leaves(original(*args, **kwargs))
                            if isinstance(t, Tensor)]
            with same_randomness((args, kwargs)):
                got = [t for t in tree_leaves(converted(*args, **kwargs))
                       if isinstance(t, Tensor)]
            result.append(max((float((x.detach().double() - y.detach().double()).abs().max())
                               for x, y in zip(expected, got, strict=True) if x.numel()),
                              default=0.0))
            _backward(converted, got, original, expected, "train" if training else "eval")
    return result[0], result[1]


def _backward(converted: nn.Module, got: list[Tensor], original: nn.Module,
              expected: list[Tensor], mode: str) -> None:
    """A backward pass through the converted model's outputs; if it fails where the
    original's runs, a rule missed a write and the returned model would be broken."""
    outputs = [y for y in got if y.requires_grad]
    weights = [p for p in converted.parameters() if p.requires_grad]
    if not outputs or not weights:
        return
    try:
        torch.autograd.grad(sum(y.float().sum() for y in outputs), weights, allow_unused=True)
    except RuntimeError as error:
        reference = [x for x in expected if x.requires_grad]
        try:
            torch.autograd.grad(sum(x.float().sum() for x in reference),
                                [p for p in original.parameters() if p.requires_grad],
                                allow_unused=True)
        except RuntimeError:
            return  # the original's backward fails as well
        raise RuntimeError(
            f"iabn.convert: the converted model's {mode}-mode backward fails where the "
            f"original's runs ({str(error).splitlines()[0]}); this is a bug in iabn.convert's "
            f"rules: please report it with the model") from error


# ---------------------------------------------------------------- part by part


def _convert_by_parts(original: nn.Module, work: nn.Module, args: tuple, policy: str,
                      verify: bool, why: str, say: Callable[[str], None],
                      traced: dict[bool, Traced], activations: bool = True,
                      kwargs: dict[str, Any] | None = None
                      ) -> tuple[nn.Module, ConversionReport]:
    """Convert the submodules whose forward reads no tensor values, each on its own.

    ``model``'s forward reads tensor values (``why``), so its recorded graph holds for this
    input only. The submodules that ran once per mode, read no values while running and
    hold a normalisation (the largest such: a detector's backbone, its heads' towers) take
    the same path whatever their input's values; each is converted with the input it got
    in this run, its outputs counted as written by the code around it (which the recorded
    graph cannot vouch for). Norms outside them are left as they are."""
    parts: list[str] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if not any(is_site_module(m) for m in child.modules()):
                continue
            per_mode = [t.calls.get(name, []) for t in traced.values()]  # a bool per call
            if not any(per_mode) or any(map(any, per_mode)):
                visit(name, child)  # a container, or values read inside: look deeper
            elif not is_site_module(child) and all(len(c) <= 1 for c in per_mode):
                parts.append(name)

    visit("", original)
    kwargs = kwargs or {}
    inputs = _part_inputs(original, args, parts, kwargs)
    layers: dict[str, LayerRow] = {}
    converted_parts = []
    for name in parts:
        if name not in inputs:
            continue  # called only in eval mode
        part_module = original.get_submodule(name)
        try:
            part_args, part_kwargs = _example(part_module, *inputs[name])
        except TypeError:
            continue  # no tensor among its arguments
        say(f"converting the part {name}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConversionWarning)
            part, part_report = _convert(part_module, part_args, policy,
                                         False, lambda _text: None, enclosed=True,
                                         activations=activations, kwargs=part_kwargs)
        work.set_submodule(name, part)
        converted_parts.append(name)
        for row in part_report.rows:
            layers[f"{name}.{row.name}"] = dataclasses.replace(row, name=f"{name}.{row.name}")
    outside = ("not in a part of the model whose forward reads no tensor values "
               "(the model's forward does, so its path may differ for other inputs)")
    # model order; a site module inside a converted part has the row that part's report
    # gives it, or none (an activation a norm absorbed); then the parts' function calls
    rows = [layers.pop(name) if name in layers else
            LayerRow(name, type(m).__name__, UNTOUCHED, outside)
            for name, m in original.named_modules() if is_site_module(m)
            and (name in layers or not any(name.startswith(f"{part}.")
                                           for part in converted_parts))]
    rows += layers.values()
    done = sum(row.decision != UNTOUCHED for row in rows)
    warnings.warn(
        f"iabn.convert: {why}; so it is converted part by part: the "
        f"{len(converted_parts)} submodules whose forward reads no values, each on its own "
        f"({done} of {len(rows)} norms replaced), the rest left as it is. Make the forward "
        f"traceable by torch.fx (torch.fx.wrap for the function that reads values) for the "
        f"whole conversion.", ConversionWarning, stacklevel=3)
    report = ConversionReport(
        policy, _shapes((args, kwargs)), rows, _saved(original, args, kwargs),
        _saved(work, args, kwargs),
        "converted by parts", f"{why}; converted part by part: {_listed(converted_parts)}")
    if verify:
        report.max_difference_eval, report.max_difference_train = _differences(
            original, work, args, kwargs)
    return work, report


def _part_inputs(model: nn.Module, args: tuple, parts: list[str], kwargs: dict[str, Any]
                 ) -> dict[str, tuple[tuple, dict[str, Any]]]:
    """The arguments ``(args, kwargs)`` each of ``parts`` gets in a training-mode run of
    ``model`` (tensors copied as they were when it was called: a Hugging Face decoder layer
    gets its hidden states and the position embeddings as keywords)."""
    inputs: dict[str, tuple] = {}

    def keep(name):
        def hook(_module, part_args, part_kwargs):
            if name not in inputs:
                inputs[name] = tree_map(
                    lambda t: t.detach().clone() if isinstance(t, Tensor) else t,
                    (part_args, part_kwargs))
        return hook

    handles = [model.get_submodule(name).register_forward_pre_hook(keep(name),
                                                                    with_kwargs=True)
               for name in parts]
    try:
        with preserved(model), same_randomness((args, kwargs)), torch.no_grad():
            model.train()
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return inputs


__all__ = ["IN_PLACE", "NOT_IN_PLACE", "UNTOUCHED", "ConversionWarning", "convert"]
