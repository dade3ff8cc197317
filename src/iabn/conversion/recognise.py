"""Recognising a norm or activation module of another library by what it computes, not by
its class name (docs/design.md, "Converting existing models").

Hugging Face's models (and others) define their own classes for what ``nn.LayerNorm``,
``nn.RMSNorm``, ``nn.GELU``, ``nn.SiLU`` and ``nn.Mish`` compute: an RMSNorm that upcasts to
float32 (Llama), one scaled by ``1 + weight`` (Gemma), GELUs that write the tanh formula out
(GPT-2's ``NewGELUActivation``), a channels-first layer norm (ConvNeXt). A module of a class
the conversion does not know is a *candidate* when it has no submodules and either no
parameters or buffers (an activation) or exactly a 1-d ``weight`` and optionally a ``bias``
of the same shape (a norm). A candidate is run on probes, on a copy (its hooks do not run,
its parameters are replaced by probe values), in train and eval mode, and compared with each
form the library can replace:

- activations: ``F.gelu`` (erf and tanh), ``F.silu``, ``F.mish``, in float64 and float32;
- norms: layer norm over the last dimension or over dim 1 (channels-first), with or without
  bias; RMS norm over the last dimension scaled by ``weight`` or ``1 + weight``, computed as
  ``nn.RMSNorm`` or with Llama's, Gemma's or T5's float32 upcast
  (:mod:`iabn.layers.norm_forms`); in float64 and float32, and in bfloat16 to tell the
  upcasts apart. ``eps`` is read from the module's attributes whose name holds ``eps``
  (``eps``, ``variance_epsilon``, ``layer_norm_eps``), else estimated from a probe, and the
  form is verified with it.

A match means the same function: every output within 32 units of roundoff of the form's
compute dtype (float64 for the activations, float32 for an upcasting form's float64 probe)
times ``|reference| + |input|`` (activations) or the row's largest ``|reference|`` (norms),
which admits another evaluation order (the tanh formula written out against
``F.gelu(approximate="tanh")``: measured within 4 ulps) and refuses another constant
(``FastGELUActivation``'s ``0.7978845608``: 3e-11 relative off ``sqrt(2/pi)``) or another
formula (eps outside the square root: the probes hold rows whose mean square is near eps).
In bfloat16 the form must give the module's very values, or where none does the fewest
elements off, by at most one unit in the last place. Rows of small magnitude make eps
matter. A candidate that matches nothing stays, with the closest form and its distance as
the reason.
"""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.activations import ACTIVATIONS
from ..layers.norm_forms import UPCASTS, rms_reference

#: Units of roundoff a match may be off (module against reference), see the docstring.
ULPS = 32
#: How far (relative) an activation that matches nothing may be from a form to get a row.
NEAR = 1e-6
#: The probes' input sizes (rows, or positions of a channels-first input).
_ROWS = 24


@dataclass(frozen=True)
class NormForm:
    """What a recognised norm computes, as iabn's layer is built for it."""

    kind: str                # "layer_norm", "layer_norm_2d" or "rms_norm"
    eps: float | None
    bias: bool = False
    weight_offset: float = 0.0
    upcast: str | None = None


@dataclass(frozen=True)
class Recognised:
    """The outcome for a candidate: ``found`` is a :class:`NormForm`, or the ``torch.nn``
    activation module it equals; ``None`` with ``why`` when it matches nothing."""

    found: NormForm | nn.Module | None
    why: str | None = None
    #: a module that matches nothing gets a row in the report where it is a near miss: a
    #: norm (its parameters are a norm's), or an activation within 1e-6 relative of a form
    #: (FastGELUActivation's constant; not a sigmoid, nor a module that fails on a probe)
    reported: bool = True


def _activation_form(record) -> tuple[str, Callable[[], nn.Module], Callable[[Tensor], Tensor]]:
    """(name, torch module, function) of a registry record: its first function form, with
    the keyword values it requires (``F.gelu(approximate='tanh')``)."""
    form = record.forms.functions[0]
    required = dict(form.required)
    name = form.display + (f"({', '.join(f'{k}={v!r}' for k, v in required.items())})"
                           if required else "")
    return name, record.torch_module, functools.partial(form.function, **required)


#: The activation forms, from the registry: the activations with one minimum (SiLU, GELU,
#: GELU-tanh, Mish), which the in-place layers replace.
_ACTIVATIONS = tuple(_activation_form(record) for record in ACTIVATIONS.values()
                     if record.needs_branch)

_cache: dict[tuple, Recognised | None] = {}


def recognise(m: nn.Module) -> Recognised | None:
    """What ``m`` computes, if it is a candidate (``None``: not one, so never probed).
    In bfloat16 an RMS norm must give the module's values (Llama's, Gemma's and T5's
    roundings differ there), or, for a module computing in bfloat16 throughout, be no
    farther from the float64 function than the module is."""
    params = dict(m.named_parameters(recurse=False))
    if next(m.children(), None) is not None or any(True for _ in m.buffers(recurse=False)):
        return None
    if params and not _norm_shaped(params):
        return None
    key = _key(m, params)
    if key not in _cache:
        # the probes may run while fx traces or a run is recorded (is_leaf asks): torch
        # function modes must not see them (a recorder would take their float() for reads
        # of the model's values)
        with warnings.catch_warnings(), torch._C.DisableTorchFunction():
            warnings.simplefilter("ignore")  # torch.rms_norm of mixed dtypes warns
            _cache[key] = _recognise_norm(m, params) if params else _recognise_activation(m)
    return _cache[key]


def is_candidate_class(m: nn.Module) -> bool:
    """A class the conversion does not know by name: not PyTorch's, timm's known ones nor
    iabn's (the caller checks those first)."""
    module = type(m).__module__
    return not module.startswith(("torch.", "iabn."))


def _norm_shaped(params: dict[str, Tensor]) -> bool:
    weight = params.get("weight")
    if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"}:
        return False
    bias = params.get("bias")
    return bias is None or tuple(bias.shape) == tuple(weight.shape)


def _plain(value: object) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _key(m: nn.Module, params: dict[str, Tensor]) -> tuple:
    """Modules of one class with the same plain attributes, the same functions in their
    public attributes (GELUActivation's ``act``: ``F.gelu`` or its Python formula; not a
    ``forward`` put on the instance, as a recorded run does) and parameter shapes compute
    the same function (the probes replace the parameters' values)."""
    plain = tuple(sorted(
        (k, v if _plain(v) else getattr(v, "__qualname__", None) or type(v).__qualname__)
        for k, v in vars(m).items()
        if k != "training" and (_plain(v) or (callable(v) and not k.startswith("_")
                                              and k != "forward"))))
    return (type(m), plain, tuple((k, tuple(p.shape)) for k, p in params.items()))


# ------------------------------------------------------------------ running probes


def _run(m: nn.Module, x: Tensor, params: dict[str, Tensor] | None, training: bool) -> Tensor:
    """``m``'s forward on ``x`` on a copy (no hooks run; ``params`` replace its parameters);
    a ``ValueError`` if it writes into ``x`` or returns it or a view of it."""
    probe = copy.deepcopy(m)
    for name, value in (params or {}).items():
        setattr(probe, name, nn.Parameter(value, requires_grad=False))
    probe.train(training)
    before = x.clone()
    with torch.no_grad():
        # the class's forward: a recorded run puts a recording wrapper on the instance
        out = type(probe).forward(probe, x)
    if not isinstance(out, Tensor) or out.shape != x.shape:
        raise ValueError("it returns no tensor of its input's shape")
    if not torch.equal(x, before) or out.untyped_storage().data_ptr() == \
            x.untyped_storage().data_ptr():
        raise ValueError("it writes into its input or returns it")
    return out


def _excess(out: Tensor, ref: Tensor, scale: Tensor, unit: float) -> float:
    """The largest ``|out - ref| / (ULPS * unit * scale)``: at most 1 is a match."""
    if out.dtype != ref.dtype:
        return math.inf
    err = (out.double() - ref.double()).abs()
    return float((err / (ULPS * unit * scale.double().clamp_min(1e-300))).max())


def _probe_input(dtype: torch.dtype, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(_ROWS, 40, generator=g, dtype=torch.float64) * 4
    x[0] = torch.linspace(-12, 12, 40, dtype=torch.float64)
    return x.to(dtype)


def _recognise_activation(m: nn.Module) -> Recognised:
    best = (math.inf, "")
    try:
        outputs = {(dtype, training): _run(m, _probe_input(dtype), None, training)
                   for dtype in (torch.float64, torch.float32) for training in (True, False)}
    except Exception as error:  # any failure on a probe: no match
        return Recognised(None, f"its forward fails on a probe ({_short(error)})",
                          reported=False)
    for name, make, function in _ACTIVATIONS:
        worst = 0.0
        for (dtype, _), out in outputs.items():
            x = _probe_input(dtype)
            ref = function(x)
            worst = max(worst, _excess(out, ref, ref.abs() + x.abs(), torch.finfo(dtype).eps))
        if worst <= 1:
            return Recognised(make())
        best = min(best, (worst, name))
    near = best[0] * ULPS * torch.finfo(torch.float64).eps <= NEAR
    return Recognised(None, _no_match("activation", best), reported=near)


def _no_match(what: str, best: tuple[float, str]) -> str:
    worst, name = best
    off = "raises or differs in shape" if not math.isfinite(worst) else \
        f"is up to {worst * ULPS:.3g} units of roundoff off"
    return (f"it matches no {what} iabn replaces: the closest, {name}, {off} "
            f"(a match is within {ULPS})")


def _short(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:100] if lines else ''}"


# ------------------------------------------------------------------ norms


def _norm_probe(d: int, channels: bool, dtype: torch.dtype) -> Tensor:
    """Rows of magnitudes 1e-7 to 1e2 (the small ones make eps matter), normalised over the
    last dimension, or over dim 1 of ``(2, d, 3, 4)``."""
    g = torch.Generator().manual_seed(1)
    scales = torch.logspace(-7, 2, _ROWS, dtype=torch.float64)
    if channels:
        x = torch.randn(2, 12, d, generator=g, dtype=torch.float64) + 0.5
        x = x * scales[:, None].reshape(2, 12, 1)
        return x.reshape(2, 3, 4, d).permute(0, 3, 1, 2).contiguous().to(dtype)
    x = (torch.randn(_ROWS, d, generator=g, dtype=torch.float64) + 0.5) * scales[:, None]
    return x.reshape(2, _ROWS // 2, d).to(dtype)


def _probe_params(d: int, bias: bool, dtype: torch.dtype) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(2)
    params = {"weight": (torch.rand(d, generator=g, dtype=torch.float64) + 0.5).to(dtype)}
    if bias:
        params["bias"] = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    return params


def _reference(form: NormForm, x: Tensor, params: dict[str, Tensor]) -> Tensor:
    weight, bias = params["weight"], params.get("bias")
    if form.kind == "rms_norm":
        return rms_reference(x, weight, form.eps, form.weight_offset, form.upcast)
    if form.kind == "layer_norm_2d":
        return F.layer_norm(x.movedim(1, -1), weight.shape, weight, bias,
                            form.eps).movedim(-1, 1)
    return F.layer_norm(x, weight.shape, weight, bias, form.eps)


def _forms(bias: bool, eps: float | None) -> list[NormForm]:
    forms = [NormForm("layer_norm", eps, bias), NormForm("layer_norm_2d", eps, bias)]
    if not bias:
        forms += [NormForm("rms_norm", eps, False, offset, upcast)
                  for upcast in UPCASTS
                  for offset in (0.0, 1.0)]
    return forms


def _eps_values(m: nn.Module) -> list[float]:
    return list(dict.fromkeys(float(v) for k, v in vars(m).items() if "eps" in k.lower()
                              and isinstance(v, (int, float)) and not isinstance(v, bool)
                              and v >= 0))


def _estimate_eps(m: nn.Module, form: NormForm, d: int) -> float | None:
    """eps from a float64 probe with weight ``1 - offset``... scale 1 and bias 0: each row's
    ``rstd`` is ``y / xhat``, and ``eps = 1 / rstd^2 - (variance or mean square)``, read
    from the row where eps is largest against the latter."""
    channels = form.kind == "layer_norm_2d"
    x = _norm_probe(d, channels, torch.float64)
    params = {"weight": torch.full((d,), 1.0 - form.weight_offset, dtype=torch.float64)}
    if form.bias:
        params["bias"] = torch.zeros(d, dtype=torch.float64)
    try:
        y = _run(m, x, params, False)
    except Exception:
        return None
    rows_x = (x.movedim(1, -1) if channels else x).reshape(-1, d)
    rows_y = (y.movedim(1, -1) if channels else y).reshape(-1, d)
    centred = rows_x - rows_x.mean(-1, keepdim=True) if form.kind != "rms_norm" else rows_x
    second = centred.pow(2).mean(-1)
    rstd = (rows_y * centred).sum(-1) / centred.pow(2).sum(-1)
    estimates = 1 / rstd.pow(2) - second
    ratio = estimates / second
    good = (ratio > 0.1) & (ratio < 10)
    return float(estimates[good].median()) if bool(good.any()) else None


def _recognise_norm(m: nn.Module, params: dict[str, Tensor]) -> Recognised:
    d = params["weight"].shape[0]
    bias = "bias" in params
    given = _eps_values(m)
    best = (math.inf, "")
    for form in _forms(bias, None):
        for eps in given or [_estimate_eps(m, form, d)]:
            if eps is None:
                continue
            candidate = NormForm(form.kind, eps, form.bias, form.weight_offset, form.upcast)
            worst = _norm_excess(m, candidate, d)
            if worst <= 1:
                return _pick_upcast(m, candidate, d)
            best = min(best, (worst, _describe(candidate)))
    if not math.isfinite(best[0]):  # no norm at all: its forward takes something else
        return Recognised(None, "its forward fails on every norm's probe", reported=False)
    return Recognised(None, _no_match("norm", best))


def _norm_excess(m: nn.Module, form: NormForm, d: int, strict: bool = False) -> float:
    """The largest excess over the float64 and float32 probes in both modes (``strict``:
    the float64 probe alone, in float64's units whatever the form computes in)."""
    worst = 0.0
    channels = form.kind == "layer_norm_2d"
    for dtype in (torch.float64,) if strict else (torch.float64, torch.float32):
        x = _norm_probe(d, channels, dtype)
        params = _probe_params(d, form.bias, dtype)
        ref = _reference(form, x, params)
        # an upcasting RMS form computes a float64 input in float32
        unit = torch.finfo(torch.float32 if form.upcast and not strict else dtype).eps
        rows = ref.movedim(1, -1) if channels else ref
        scale = rows.abs().amax(-1, keepdim=True)
        scale = scale.movedim(-1, 1) if channels else scale
        for training in (True, False):
            try:
                out = _run(m, x, params, training)
            except Exception:
                return math.inf
            worst = max(worst, _excess(out, ref, scale.expand_as(ref), unit))
    return worst


def _pick_upcast(m: nn.Module, form: NormForm, d: int) -> Recognised:
    """Among the forms equal in float64 and float32 to ``form`` (the RMS norms' upcasts, the
    layer norm alone), the one that gives the module's values in bfloat16, with bfloat16
    and with float32 parameters."""
    if form.kind != "rms_norm":
        return Recognised(form)
    candidates = [NormForm(form.kind, form.eps, False, form.weight_offset, upcast)
                  for upcast in (None, "normalise", "scale", "statistics")]
    candidates = [c for c in candidates if _norm_excess(m, c, d) <= 1]
    # float64 in its own units tells a module computing in float64 from one rounding to
    # float32 (Llama's, Gemma's and T5's upcasts also differ there from one another)
    strict = {c: _norm_excess(m, c, d, strict=True) for c in candidates}
    best = min(strict.values(), default=0.0)
    candidates = [c for c in candidates if strict[c] <= max(1.0, 4 * best)]
    scores = []
    for candidate in candidates:
        off, ulps, closer = 0, 0.0, True
        for param_dtype in (torch.bfloat16, torch.float32):
            x = _norm_probe(d, False, torch.bfloat16)
            params = _probe_params(d, False, param_dtype)
            try:
                out = _run(m, x, params, False)
            except Exception as error:
                return Recognised(None, f"its forward fails on a bfloat16 probe "
                                  f"({_short(error)})")
            ref = _reference(candidate, x, params)
            if out.dtype != ref.dtype:
                off, ulps, closer = math.inf, math.inf, False
                break
            err = (out.double() - ref.double()).abs()
            spacing = torch.finfo(ref.dtype).eps * ref.double().abs().clamp_min(
                torch.finfo(ref.dtype).tiny)
            off += int((err > 0).sum())
            ulps = max(ulps, float((err / spacing).max()))
            # the same function in float64: is the form no farther from it than the module?
            truth = _reference(NormForm("rms_norm", form.eps, False, form.weight_offset),
                               x.double(), {k: v.double() for k, v in params.items()})
            closer = closer and bool((ref.double() - truth).abs().max()
                                     <= (out.double() - truth).abs().max())
        scores.append((off, ulps, closer, candidate))
    good = [s for s in scores if s[1] <= 2]  # one unit in the last place either side
    if good:
        return Recognised(min(good, key=lambda s: s[0])[3])
    # a module computing in bfloat16 throughout: a form closer to the float64 function
    closer = [s for s in scores if s[2]]
    if closer:
        return Recognised(min(closer, key=lambda s: s[0])[3])
    return Recognised(None, f"{_describe(form)} in float64 and float32, but no RMS norm form "
                      f"gives its bfloat16 values or comes closer to the float64 function")


def _describe(form: NormForm) -> str:
    what = {"layer_norm": "a layer norm over the last dimension",
            "layer_norm_2d": "a channels-first layer norm",
            "rms_norm": "an RMS norm"}[form.kind]
    if form.kind == "rms_norm":
        what += " scaled by 1 + weight" if form.weight_offset else ""
        what += f" (upcast {form.upcast!r})" if form.upcast else ""
    elif not form.bias:
        what += " without bias"
    return f"{what}, eps={form.eps:g}"


__all__ = ["NormForm", "Recognised", "is_candidate_class", "recognise"]
