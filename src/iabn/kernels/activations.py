"""The activations, one record each: everything the layers, both backends, the models, the
tests and ``iabn.convert`` know about an activation is read from :data:`ACTIVATIONS`
(docs/design.md, "Adding an activation").

An in-place layer stores only its output ``z = phi(y)``; backward recovers ``y`` from it. An
activation is one of three kinds:

invertible (``leaky_relu``, ``elu``, ``identity``, ``softplus``)
    ``y = phi^-1(z)`` and ``dy = phi'(y) dz`` from ``z`` alone (:attr:`Activation.invert`,
    :attr:`Activation.grad_from_output`), on PyTorch's own vectorised kernels (``leaky_relu``,
    ``elu`` and their ``*_backward`` ops evaluated from the output), never per-element Python.
with one minimum (``silu``, ``gelu``, ``gelu_tanh``, ``mish``: :attr:`Activation.needs_branch`)
    every output ``z* < z < 0`` comes from two inputs; the in-place batch-norm layers keep one
    bit per element that names the branch and recover ``y`` by Newton steps
    (:mod:`.branch`) on the functions of :class:`Minimum`. The in-place group-norm layer and
    BNActConv's in-place strategies do not keep the bit, and refuse them.
not invertible at all (``relu``)
    only the not-in-place layers (``iabn.ABN``, ``iabn.GroupNormAct``) take it.

A record also holds its parameter rule (:class:`Parameter`), its half-precision rule
(:attr:`Activation.half_in_float32`), its code in the Triton kernels
(:attr:`Activation.code`; the kernels name it, :mod:`.triton_kernels`), the ``torch.nn``
module that computes it (:meth:`Activation.torch_module`: the models' plain layer and the
tests' reference), and what ``iabn.convert`` recognises as it (:class:`TorchForms`:
module classes with their condition, functions with their parameter's keyword and default,
tensor methods).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import forward_ad

LEAKY_RELU = "leaky_relu"
ELU = "elu"
IDENTITY = "identity"
RELU = "relu"
SILU = "silu"
GELU = "gelu"
GELU_TANH = "gelu_tanh"
MISH = "mish"
SOFTPLUS = "softplus"


# ------------------------------------------------------------------ the record


@dataclass(frozen=True)
class Parameter:
    """The activation's one parameter (``activation_param``): what it is called in messages,
    the keyword of torch's functional form and the attribute of its ``nn`` module that hold
    it, and torch's default. It must be a finite number > 0 (the function is invertible)."""

    name: str       # in words, for messages: "negative slope", "alpha"
    keyword: str    # of the torch function (F.leaky_relu(x, negative_slope=...))
    attribute: str  # of the nn module (nn.LeakyReLU().negative_slope)
    default: float  # torch's default


@dataclass(frozen=True)
class FunctionForm:
    """A function ``iabn.convert`` recognises as the activation: the callable, the name a
    report shows, and the keyword arguments that must hold these values (``F.gelu`` only with
    ``approximate="none"``). The parameter, if any, is the record's :class:`Parameter`
    (its ``keyword``, positional after the input, and ``default``)."""

    function: Callable
    display: str
    required: tuple[tuple[str, object], ...] = ()


@dataclass(frozen=True)
class ModuleForm:
    """An ``nn.Module`` class ``iabn.convert`` recognises (exact type), with the condition a
    module of it must meet (``nn.GELU`` only with ``approximate == "none"``: the tanh
    approximation is another function). The parameter, if any, is read from the module's
    attribute :attr:`Parameter.attribute`."""

    cls: type[nn.Module]
    accepts: Callable[[nn.Module], bool] | None = None


@dataclass(frozen=True)
class TorchForms:
    """What ``iabn.convert`` recognises as the activation."""

    modules: tuple[ModuleForm, ...] = ()
    functions: tuple[FunctionForm, ...] = ()
    methods: tuple[str, ...] = ()  # Tensor methods without arguments: "relu" for x.relu()


@dataclass(frozen=True)
class Minimum:
    """The math of an activation with one minimum, which the in-place layer inverts with a
    branch bit (:mod:`.branch`): ``y*`` (``phi'(y*) = 0``), ``z* = phi(y*)``, ``c = phi''(y*)``
    and ``taylor``, ``phi^(k)(y*) / k!`` for ``k = 2..10`` (float64, from torch's own
    derivatives; tests/core/test_branch_activation.py checks them), and the functions the
    Newton steps evaluate, each as a new tensor:

    - ``value(y)``: ``phi(y)``, accurate in the left tail (relative);
    - ``derivative(y)``: ``phi'(y)``;
    - ``log_tail(y)``: ``log(phi(y) / y)`` for ``y < 0``, exact where ``phi(y)`` is tiny;
    - ``log_tail_derivative(y)``: its derivative;
    - ``apply_(x)``: ``x <- phi(x)`` in place (half inputs computed in float32, rounded once).

    ``exponential_tail``: ``-phi(y)`` falls like ``-y e^y`` on the left, so that
    ``log(z* / z) ~ -y`` gives the left branch's first Newton point far out (silu, mish).
    """

    y_star: float
    z_star: float
    curvature: float
    taylor: tuple[float, ...]
    exponential_tail: bool
    value: Callable[[Tensor], Tensor]
    derivative: Callable[[Tensor], Tensor]
    log_tail: Callable[[Tensor], Tensor]
    log_tail_derivative: Callable[[Tensor], Tensor]
    apply_: Callable[[Tensor], Tensor]


def _identity_out(z: Tensor, param: float, out: Tensor | None = None) -> Tensor:
    return z


def _grad_identity(dz: Tensor, z: Tensor, param: float, out: Tensor | None = None) -> Tensor:
    return dz


@dataclass(frozen=True)
class Activation:
    """One activation (see the module docstring). The functions take the activation's
    parameter (ignored where it has none):

    - ``apply_(x, param)``: ``x <- phi(x)``, returning ``x`` (``gelu`` of a tensor that
      autograd records returns a new tensor; callers use the returned one);
    - ``apply(x, param)``: ``phi(x)`` as a new tensor (``identity``: ``x`` itself);
    - ``invert(z, param, out=None)``: ``y = phi^-1(z)``, ``z`` left untouched (another
      backward may still need it, ``retain_graph=True``; ``identity``: ``z`` itself); ``out``,
      shaped like ``z``, receives it where ``writes_out``;
    - ``grad_from_output(dz, z, param, out=None)``: ``dy = phi'(y) dz`` from ``z``.

    ``invert`` and ``grad_from_output`` exist for the invertible activations, and for
    ``relu``, whose output tells where its input was positive (its derivative needs no
    inverse; ``invert`` is ``None``).
    """

    name: str
    #: Code in the Triton kernels (``ACT``); ``None``: not run there (relu).
    code: int | None
    parameter: Parameter | None
    invertible: bool
    apply_: Callable[[Tensor, float], Tensor]
    apply: Callable[[Tensor, float], Tensor]
    make_module: Callable[[float, bool], nn.Module]
    invert: Callable[..., Tensor] | None = None
    grad_from_output: Callable[..., Tensor] | None = None
    #: ``invert`` and ``grad_from_output`` write into ``out`` (the reference backward then
    #: gives them reused scratch memory).
    writes_out: bool = False
    #: Half-precision rule: the reference backward of a half input computes ``y`` and ``dy``
    #: in float32 (a slice at a time) rather than in the input's dtype (docs/design.md,
    #: "Kernels: numerics and launch plan").
    half_in_float32: bool = False
    minimum: Minimum | None = None
    forms: TorchForms = field(default_factory=TorchForms)

    @property
    def needs_branch(self) -> bool:
        """The in-place layer keeps a branch bit per element (one minimum)."""
        return self.minimum is not None

    @property
    def in_place(self) -> bool:
        """The in-place batch-norm layers take it (with a branch bit where it needs one)."""
        return self.invertible or self.needs_branch

    def torch_module(self, param: float = 0.0, inplace: bool = False) -> nn.Module:
        """The ``torch.nn`` module computing it (``inplace`` where the module has it)."""
        return self.make_module(param, inplace)

    def param_of(self, module: nn.Module) -> float:
        """The parameter a recognised ``module`` holds (0.0 without one)."""
        return float(getattr(module, self.parameter.attribute)) if self.parameter else 0.0


# ------------------------------------------------------------------ leaky_relu, elu, relu

# Resolved overloads: calling an OpOverload skips the packet's overload resolution (~0.3 µs).
_LEAKY_RELU_BACKWARD = torch.ops.aten.leaky_relu_backward.default
_LEAKY_RELU_BACKWARD_OUT = torch.ops.aten.leaky_relu_backward.grad_input


def _invert_leaky_relu(z: Tensor, param: float, out: Tensor | None = None) -> Tensor:
    # The inverse of a leaky ReLU with slope a is a leaky ReLU with slope 1/a.
    # torch._C._nn.leaky_relu is F.leaky_relu's own binding; it takes out= directly, at
    # half the host cost of the torch.ops.aten overload (0.9 vs 1.7 µs per call, measured).
    return torch._C._nn.leaky_relu(z, 1.0 / param, out=out)


def _grad_leaky_relu(dz: Tensor, z: Tensor, param: float, out: Tensor | None = None) -> Tensor:
    if out is not None:
        return _LEAKY_RELU_BACKWARD_OUT(dz, z, param, True, grad_input=out)
    return _LEAKY_RELU_BACKWARD(dz, z, param, True)


def _invert_elu(z: Tensor, alpha: float, out: Tensor | None = None) -> Tensor:
    # y = log1p(z / alpha) for z <= 0. Where exp(y) underflowed in forward, z == -alpha
    # and log1p(-1) = -inf; clamping keeps y finite. Its gradient there is
    # dz * (z + alpha) = 0, so the clamp does not change any gradient.
    tiny = torch.finfo(z.dtype).eps
    negative = torch.log1p((z.clamp(max=0) / alpha).clamp(min=-1 + tiny))
    return negative.add_(z.clamp(min=0))


def _grad_elu(dz: Tensor, z: Tensor, alpha: float, out: Tensor | None = None) -> Tensor:
    return torch.ops.aten.elu_backward(dz, alpha, 1, 1, True, z)


def _grad_relu(dz: Tensor, z: Tensor, param: float, out: Tensor | None = None) -> Tensor:
    # relu's output tells where its input was positive, so its derivative needs no inverse
    return torch.ops.aten.threshold_backward(dz, z, 0)


# ------------------------------------------------------------------ silu, gelu, mish

_SQRT1_2 = math.sqrt(0.5)
#: ATen's in-place GELU (``F.gelu`` has no ``inplace``): the kernel of ``F.gelu``, writing
#: its input.
_GELU_INPLACE = torch.ops.aten.gelu_.default
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _silu_derivative(y: Tensor) -> Tensor:
    """``s (1 + y (1 - s))`` with ``s = sigmoid(y)``."""
    s = torch.sigmoid(y)
    return (1 - s).mul_(y).add_(1).mul_(s)


def _silu_log_tail_derivative(y: Tensor) -> Tensor:
    return torch.sigmoid(-y)


def _gelu_value(y: Tensor) -> Tensor:
    """``y * erfc(-y / sqrt 2) / 2`` on every element: torch's ``F.gelu``, ``y * (1 + erf(y /
    sqrt 2)) / 2``, cancels below zero and rounds to 0 below y = -5.5 in float32 (-8.3 in
    float64), which would lose the left branch's ``y``; the erfc form keeps it down to -14.1
    (float32), and above zero it differs from torch's by rounding. One form on every element:
    two forms kept by a selection took 3.5x the time (15.5 against 4.4 ms in place at
    8x64x56x56 float32, one thread)."""
    return torch.special.erfc(y * -_SQRT1_2).mul_(y).mul_(0.5)


def _gelu_apply_(x: Tensor) -> Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.copy_(_gelu_value(x.float()))
    return x.mul_(torch.special.erfc(x * -_SQRT1_2)).mul_(0.5)


def _gelu_derivative(y: Tensor) -> Tensor:
    """``Phi(y) + y phi_N(y)``."""
    density = torch.exp(y.square().mul_(-0.5).sub_(_LOG_SQRT_2PI))
    return torch.special.erfc(y * -_SQRT1_2).mul_(0.5).addcmul_(y, density)


def _gelu_log_tail_derivative(y: Tensor) -> Tensor:
    return torch.exp(y.square().mul_(-0.5).sub_(_LOG_SQRT_2PI).sub_(torch.special.log_ndtr(y)))


def _gelu_apply_plain_(x: Tensor, param: float) -> Tensor:
    # torch's own exact GELU (the not-in-place layers compute what nn.GELU computes).
    # Its backward reads its input: where autograd records x, x must stay as it is.
    if x.requires_grad and torch.is_grad_enabled():
        return F.gelu(x)
    return _GELU_INPLACE(x)


#: The tanh approximation's constants, as ATen's (``kBeta = sqrt(2 / pi)``, ``kKappa``).
_GELU_TANH_BETA = math.sqrt(2 / math.pi)
_GELU_TANH_KAPPA = 0.044715


def _gelu_tanh_2u(y: Tensor) -> Tensor:
    """``2u``, ``u = sqrt(2/pi) (y + 0.044715 y^3)``: ``(1 + tanh(u)) / 2 = sigmoid(2u)``."""
    return y.square().mul_(_GELU_TANH_KAPPA).add_(1).mul_(y).mul_(2 * _GELU_TANH_BETA)


def _gelu_tanh_2u_derivative(y: Tensor) -> Tensor:
    """``d(2u)/dy = 2 sqrt(2/pi) (1 + 3 * 0.044715 y^2)``."""
    return y.square().mul_(3 * _GELU_TANH_KAPPA).add_(1).mul_(2 * _GELU_TANH_BETA)


def _gelu_tanh_value(y: Tensor) -> Tensor:
    """``y * sigmoid(2u)``: torch's ``y * (1 + tanh(u)) / 2`` cancels in the left tail (float32:
    steps of 6e-8 in ``1 + tanh(u)``, 0 below y = -5.3), this form keeps ``y`` there."""
    return torch.sigmoid(_gelu_tanh_2u(y)).mul_(y)


def _gelu_tanh_apply_(x: Tensor) -> Tensor:
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.copy_(_gelu_tanh_value(x.float()))
    return x.copy_(_gelu_tanh_value(x))


def _gelu_tanh_derivative(y: Tensor) -> Tensor:
    """``s + y s (1 - s) d(2u)/dy`` with ``s = sigmoid(2u)``, ``1 - s`` as ``sigmoid(-2u)``:
    ``1 - s`` rounds to a multiple of eps / 2 where ``s`` is near 1, which ``y d(2u)/dy``
    (84 at y = 7) turned into 9e-15 of a derivative of 1 in float64 (40 ulp)."""
    v = _gelu_tanh_2u(y)
    s = torch.sigmoid(v)
    return torch.sigmoid(v.neg_()).mul_(y).mul_(_gelu_tanh_2u_derivative(y)).add_(1).mul_(s)


def _gelu_tanh_log_tail(y: Tensor) -> Tensor:
    """``log sigmoid(2u)``, exact for ``y < 0``."""
    return F.logsigmoid(_gelu_tanh_2u(y))


def _gelu_tanh_log_tail_derivative(y: Tensor) -> Tensor:
    return torch.sigmoid(_gelu_tanh_2u(y).neg_()).mul_(_gelu_tanh_2u_derivative(y))


def _gelu_tanh_apply_plain_(x: Tensor, param: float) -> Tensor:
    # torch's own tanh GELU (what nn.GELU(approximate="tanh") computes); as the exact form,
    # into a new tensor where autograd records x (its backward reads its input)
    if x.requires_grad and torch.is_grad_enabled():
        return F.gelu(x, approximate="tanh")
    return _GELU_INPLACE(x, approximate="tanh")


def _mish_derivative(y: Tensor) -> Tensor:
    """``t + y s (1 - t^2)`` with ``t = tanh(softplus(y))``, ``s = sigmoid(y)``."""
    t = torch.tanh(F.softplus(y))
    return (1 - t.square()).mul_(torch.sigmoid(y)).mul_(y).add_(t)


def _mish_log_tail(y: Tensor) -> Tensor:
    """``log tanh(softplus(y)) = y + log1p(e / 2) - log1p(e + e^2 / 2)``, ``e = exp(y)``
    (``tanh(softplus(y)) = e (e + 2) / (e (e + 2) + 2)``), exact for ``y < 0``."""
    e = torch.exp(y)
    return torch.log1p(e * 0.5).add_(y).sub_(torch.log1p(e * (e * 0.5 + 1)))


def _mish_log_tail_derivative(y: Tensor) -> Tensor:
    """``1 + (e / 2) / (1 + e / 2) - (e + e^2) / (1 + e + e^2 / 2)``."""
    e = torch.exp(y)
    half = e * 0.5
    return (half / (1 + half)).add_(1).sub_(e * (1 + e) / (e * (half + 1) + 1))


def _branch(value, derivative, log_tail, log_tail_derivative, apply_, y_star, z_star,
            curvature, taylor, exponential_tail) -> Minimum:
    return Minimum(y_star, z_star, curvature, taylor, exponential_tail, value, derivative,
                   log_tail, log_tail_derivative, apply_)


# ------------------------------------------------------------------ softplus

#: ``nn.Softplus``'s default ``threshold``: above ``beta * x > threshold`` it returns ``x``. The
#: batch-norm and group-norm layers take ``beta`` as their parameter and compute with this
#: threshold (a module with another one is not recognised as this record); the layer without a
#: norm, :class:`iabn.InPlaceSoftplus`, takes both: its parameter is the pair.
SOFTPLUS_THRESHOLD = 20.0


def _softplus_options(param) -> tuple[float, float]:
    """``(beta, threshold)`` from the parameter: ``beta`` alone (the norm layers), or the
    pair (the layer without a norm)."""
    if isinstance(param, tuple):
        return float(param[0]), float(param[1])
    return float(param), SOFTPLUS_THRESHOLD


def _softplus(x: Tensor, param) -> Tensor:
    beta, threshold = _softplus_options(param)
    return F.softplus(x, beta, threshold)


def _softplus_(x: Tensor, param) -> Tensor:
    # ATen's softplus kernel writing its input (an elementwise out= may alias it); where
    # autograd or a torch.func transform records x, a new tensor (softplus has no in-place
    # op, its backward reads its input, and out= takes no forward-mode derivative)
    beta, threshold = _softplus_options(param)
    if ((x.requires_grad and torch.is_grad_enabled()) or _is_wrapped(x)
            or forward_ad._current_level >= 0):
        return F.softplus(x, beta, threshold)
    return torch._C._nn.softplus(x, beta, threshold, out=x)


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _softplus_slope(z: Tensor, beta: float) -> Tensor:
    """``sigmoid(beta y) = 1 - exp(-beta z)`` from the output ``z = softplus(y)``."""
    return torch.expm1(z * -beta).neg_()


def _softplus_branch(z: Tensor, beta: float, threshold: float
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, slope, linear)``: the input below the threshold whose softplus is ``z``, its slope
    ``1 - exp(-beta z)``,
    ``z + log(1 - exp(-beta z)) / beta``, and where there is none (``beta y > threshold``: the
    output came from the linear part, ``y = z``). Just above ``threshold / beta`` both parts
    give the same outputs (softplus is continuous to ``exp(-threshold)`` only); there the part
    below is taken, off by at most ``log1p(exp(-threshold)) / beta`` in ``y`` and
    ``exp(-threshold)`` in the slope for an input of the linear part (2.1e-9 at torch's
    default 20). An output that underflowed to 0 (``y`` below about -103 / beta in float32) is
    taken as the smallest normal number: ``y`` is then finite and its slope about 0."""
    clamped = z.clamp(min=torch.finfo(z.dtype).tiny)
    slope = _softplus_slope(clamped, beta)
    y = torch.log(slope).div_(beta).add_(clamped)
    return y, slope, y * beta > threshold


def _invert_softplus(z: Tensor, param, out: Tensor | None = None) -> Tensor:
    y, _, linear = _softplus_branch(z, *_softplus_options(param))
    return torch.where(linear, z, y)


def _grad_softplus(dz: Tensor, z: Tensor, param, out: Tensor | None = None) -> Tensor:
    _, slope, linear = _softplus_branch(z, *_softplus_options(param))
    return torch.where(linear, dz, slope.mul_(dz))


# ------------------------------------------------------------------ the registry

_NONE = (("approximate", "none"),)
_TANH = (("approximate", "tanh"),)

#: Every activation, by name, in the order messages list them.
ACTIVATIONS: dict[str, Activation] = {a.name: a for a in (
    Activation(
        LEAKY_RELU, 1, Parameter("negative slope", "negative_slope", "negative_slope", 0.01),
        True, apply_=F.leaky_relu_, apply=F.leaky_relu,
        make_module=lambda p, inplace: nn.LeakyReLU(p, inplace=inplace),
        invert=_invert_leaky_relu, grad_from_output=_grad_leaky_relu, writes_out=True,
        forms=TorchForms(
            modules=(ModuleForm(nn.LeakyReLU),),
            functions=(FunctionForm(F.leaky_relu, "F.leaky_relu"),
                       FunctionForm(F.leaky_relu_, "F.leaky_relu_")),
        ),
    ),
    Activation(
        ELU, 2, Parameter("alpha", "alpha", "alpha", 1.0), True,
        apply_=F.elu_, apply=F.elu, make_module=lambda p, inplace: nn.ELU(p, inplace=inplace),
        invert=_invert_elu, grad_from_output=_grad_elu,
        # dy = dz * (z + alpha) and y = log1p(z / alpha) cancel near z = -alpha (bias
        # gradient 2.3x PyTorch's error in bfloat16)
        half_in_float32=True,
        forms=TorchForms(
            modules=(ModuleForm(nn.ELU),),
            functions=(FunctionForm(F.elu, "F.elu"), FunctionForm(F.elu_, "F.elu_")),
        ),
    ),
    Activation(
        IDENTITY, 0, None, True, apply_=lambda x, p: x, apply=lambda x, p: x,
        make_module=lambda p, inplace: nn.Identity(),
        invert=_identity_out, grad_from_output=_grad_identity,
        forms=TorchForms(modules=(ModuleForm(nn.Identity),)),
    ),
    Activation(
        RELU, None, None, False, apply_=lambda x, p: F.relu_(x), apply=lambda x, p: F.relu(x),
        make_module=lambda p, inplace: nn.ReLU(inplace=inplace), grad_from_output=_grad_relu,
        forms=TorchForms(
            modules=(ModuleForm(nn.ReLU),),
            functions=(FunctionForm(F.relu, "F.relu"), FunctionForm(F.relu_, "F.relu_"),
                       FunctionForm(torch.relu, "torch.relu"),
                       FunctionForm(torch.relu_, "torch.relu_")),
            methods=("relu", "relu_"),
        ),
    ),
    Activation(
        SILU, 3, None, False, apply_=lambda x, p: F.silu(x, inplace=True),
        apply=lambda x, p: F.silu(x), make_module=lambda p, inplace: nn.SiLU(inplace=inplace),
        minimum=_branch(
            F.silu, _silu_derivative, F.logsigmoid, _silu_log_tail_derivative,
            lambda x: F.silu(x, inplace=True),
            -1.278464542761074, -0.27846454276107385, 0.2178117057198001,
            (0.10890585285990005, 0.04888293233231563, 0.0047187035559455763,
             -0.0030445310446376062, -0.0011010981897261157, 1.8089630011588907e-05,
             9.9815235229974976e-05, 2.0634138179096098e-05, -4.0905342374286093e-06),
            exponential_tail=True,
        ),
        forms=TorchForms(modules=(ModuleForm(nn.SiLU),),
                         functions=(FunctionForm(F.silu, "F.silu"),)),
    ),
    Activation(
        GELU, 4, None, False, apply_=_gelu_apply_plain_, apply=lambda x, p: F.gelu(x),
        make_module=lambda p, inplace: nn.GELU(),
        minimum=_branch(
            _gelu_value, _gelu_derivative, torch.special.log_ndtr, _gelu_log_tail_derivative,
            _gelu_apply_,
            -0.7517915246935645, -0.16997120747990363, 0.43149399231404695,
            (0.21574699615702347, 0.12942832766351733, -0.0045499190996677596,
             -0.022801646659444341, -0.0024619203580407241, 0.0027745256911698665,
             0.00056740354739067702, -0.00024883756311927752, -7.4482683867468184e-05),
            exponential_tail=False,
        ),
        # the exact (erf) form only: the tanh approximation is another function
        forms=TorchForms(
            modules=(ModuleForm(nn.GELU, lambda m: m.approximate == "none"),),
            functions=(FunctionForm(F.gelu, "F.gelu", _NONE),),
        ),
    ),
    Activation(
        GELU_TANH, 6, None, False, apply_=_gelu_tanh_apply_plain_,
        apply=lambda x, p: F.gelu(x, approximate="tanh"),
        make_module=lambda p, inplace: nn.GELU(approximate="tanh"),
        minimum=_branch(
            _gelu_tanh_value, _gelu_tanh_derivative, _gelu_tanh_log_tail,
            _gelu_tanh_log_tail_derivative, _gelu_tanh_apply_,
            -0.7524614220710163, -0.17004075057125406, 0.4304000910248585,
            (0.21520004551242924, 0.12917281537859632, -0.003945713380462007,
             -0.0227888966161918, -0.002769888057175427, 0.0028117584942618738,
             0.000657632406865239, -0.00026919242731945523, -9.27442023020545e-05),
            # -phi(y) falls like exp(-c |y|^3): H grows like |y|^1.5, so the linear start
            # from y* is the better one (y = -20: -22.5)
            exponential_tail=False,
        ),
        forms=TorchForms(
            modules=(ModuleForm(nn.GELU, lambda m: m.approximate == "tanh"),),
            functions=(FunctionForm(F.gelu, "F.gelu", _TANH),),
        ),
    ),
    Activation(
        MISH, 5, None, False, apply_=lambda x, p: F.mish(x, inplace=True),
        apply=lambda x, p: F.mish(x), make_module=lambda p, inplace: nn.Mish(inplace=inplace),
        minimum=_branch(
            F.mish, _mish_derivative, _mish_log_tail, _mish_log_tail_derivative,
            lambda x: F.mish(x, inplace=True),
            -1.1924312145154954, -0.3088434130172504, 0.26694791404953444,
            (0.13347395702476722, 0.06824375469336862, 0.010476955260902471,
             -0.004054364543336846, -0.002636854426955563, -0.0004800978467176101,
             0.000136550692618073, 0.00010997978912543549, 2.5412936386191083e-05),
            exponential_tail=True,
        ),
        forms=TorchForms(modules=(ModuleForm(nn.Mish),),
                         functions=(FunctionForm(F.mish, "F.mish"),)),
    ),
    Activation(
        SOFTPLUS, None, Parameter("beta", "beta", "beta", 1.0), True,
        apply_=_softplus_, apply=_softplus,
        make_module=lambda p, inplace: nn.Softplus(*_softplus_options(p)),
        invert=_invert_softplus, grad_from_output=_grad_softplus,
        # dy = dz * (1 - exp(-beta z)) cancels for small z in half precision
        half_in_float32=True,
        forms=TorchForms(
            modules=(ModuleForm(nn.Softplus, lambda m: m.threshold == SOFTPLUS_THRESHOLD),),
            functions=(FunctionForm(F.softplus, "F.softplus",
                                    (("threshold", SOFTPLUS_THRESHOLD),)),),
        ),
    ),
)}


def get(name: str) -> Activation:
    """The record of ``name``; a ``ValueError`` listing the known names otherwise."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown activation={name!r}: use one of {', '.join(map(repr, ACTIVATIONS))}"
        ) from None


#: Activations the in-place layer can invert from the output alone.
INVERTIBLE_ACTIVATIONS = tuple(n for n, a in ACTIVATIONS.items() if a.invertible)
#: Activations the in-place layer inverts with a saved branch bit.
BRANCH_ACTIVATIONS = tuple(n for n, a in ACTIVATIONS.items() if a.needs_branch)
#: Activations of the in-place batch-norm layer.
IN_PLACE_ACTIVATIONS = INVERTIBLE_ACTIVATIONS + BRANCH_ACTIVATIONS
#: Activations of the not-in-place layers (``iabn.ABN``, ``iabn.GroupNormAct``).
ALL_ACTIVATIONS = tuple(ACTIVATIONS)
#: Activations with a parameter (``activation_param``).
WITH_PARAMETER = tuple(n for n, a in ACTIVATIONS.items() if a.parameter is not None)


# ------------------------------------------------------------------ what convert recognises


def module_activation(module: nn.Module) -> tuple[str, float] | None:
    """``(name, parameter)`` of the activation ``module`` computes, if a record recognises it
    (exact type and its condition; the parameter read from the module), else ``None``.
    ``nn.GELU`` is two records': ``gelu`` (``approximate="none"``) and ``gelu_tanh``."""
    for record, form in MODULE_FORMS.get(type(module), ()):
        if form.accepts is None or form.accepts(module):
            return record.name, record.param_of(module)
    return None


def _index(pairs) -> dict:
    table: dict = {}
    for key, value in pairs:
        table.setdefault(key, []).append(value)
    return {key: tuple(values) for key, values in table.items()}


#: ``nn.Module`` class -> every ``(record, ModuleForm)`` of it, in the registry's order (each
#: form's condition picks one: ``nn.GELU``'s ``approximate``).
MODULE_FORMS: dict[type, tuple[tuple[Activation, ModuleForm], ...]] = _index(
    (form.cls, (a, form)) for a in ACTIVATIONS.values() for form in a.forms.modules
)
#: function -> every ``(record, FunctionForm)`` of it, in the registry's order: ``F.gelu`` is
#: ``gelu`` with ``approximate="none"`` and ``gelu_tanh`` with ``"tanh"`` (the form's
#: ``required`` keywords pick one; :func:`function_activation`).
FUNCTION_FORMS: dict[Callable, tuple[tuple[Activation, FunctionForm], ...]] = _index(
    (form.function, (a, form)) for a in ACTIVATIONS.values() for form in a.forms.functions
)


def function_forms(function: Callable) -> tuple[tuple[Activation, FunctionForm], ...]:
    """:data:`FUNCTION_FORMS` of ``function`` (empty for one no record names, or an
    unhashable callable)."""
    try:
        return FUNCTION_FORMS.get(function, ())
    except TypeError:
        return ()


def function_activation(function: Callable, arguments: dict[str, object]
                        ) -> tuple[Activation, FunctionForm] | None:
    """The ``(record, form)`` a call of ``function`` with these keyword ``arguments`` (bound
    by name) computes: the first form whose ``required`` keywords hold (absent ones take their
    required value, torch's default), else ``None``."""
    for record, form in function_forms(function):
        if all(arguments.get(key, value) == value for key, value in form.required):
            return record, form
    return None


#: Tensor method name -> record.
METHOD_FORMS: dict[str, Activation] = {
    method: a for a in ACTIVATIONS.values() for method in a.forms.methods
}


# ------------------------------------------------------------------ the parameter rule


def check_activation(activation: str, activation_param: float, *, in_place: bool,
                     branch: bool = False) -> None:
    """Raise a ``ValueError`` naming the fix when ``activation`` cannot be used.

    ``branch``: the in-place layer keeps a branch bit (``iabn.InPlaceABN``,
    ``iabn.InPlaceABNSync``, ``iabn.ABNSync``, ``iabn.InPlaceGroupNormAct`` and their
    functionals), so it takes the activations with one minimum; the other in-place layers
    (BNActConv's in-place strategies) invert from the output alone and refuse them.

    ``activation_param`` is the activation's :class:`Parameter` (``leaky_relu``'s negative
    slope, ``elu``'s alpha) and must then be a finite number > 0 so that the function is
    invertible. It is ignored by the activations without one.
    """
    record = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if not in_place:
        allowed = ALL_ACTIVATIONS
    else:
        allowed = IN_PLACE_ACTIVATIONS if branch else INVERTIBLE_ACTIVATIONS
    if in_place and not branch and record is not None and record.needs_branch:
        raise ValueError(
            f"activation={activation!r} is not invertible, and this layer recovers its input "
            f"from its output alone: only the norm layers (iabn.InPlaceABN, "
            f"iabn.InPlaceABNSync, iabn.ABNSync, iabn.InPlaceGroupNormAct and their "
            f"functionals) keep the branch bit {activation} needs; "
            f"use one of them, the not-in-place iabn.ABN, or an invertible "
            f"activation ({', '.join(map(repr, INVERTIBLE_ACTIVATIONS))})"
        )
    if activation == RELU and in_place:
        raise ValueError(
            "activation='relu' is not invertible, so the in-place layer cannot recover its "
            "input in backward: use activation='leaky_relu' (e.g. activation_param=0.01) "
            "or the non-in-place ABN for relu"
        )
    if activation not in allowed:
        raise ValueError(
            f"unknown activation={activation!r}: use one of {', '.join(map(repr, allowed))}"
        )
    if not isinstance(activation_param, numbers.Real) or isinstance(activation_param, bool):
        raise TypeError(
            f"activation_param={activation_param!r}: must be a number (leaky_relu's negative "
            f"slope or elu's alpha, e.g. 0.01)"
        )
    if record.parameter is not None:
        param = float(activation_param)
        if not param > 0 or param == float("inf"):
            raise ValueError(
                f"activation_param={activation_param!r} is the {record.parameter.name} of "
                f"{activation} and must be a finite number > 0 (e.g. 0.01 for leaky_relu, "
                f"1.0 for elu)"
                + (
                    "; a zero slope is relu, which only the non-in-place ABN accepts"
                    if activation == LEAKY_RELU and param == 0
                    else ""
                )
            )


# ------------------------------------------------------------------ by name


def apply_(x: Tensor, activation: str, activation_param: float) -> Tensor:
    """``x <- phi(x)``, returning ``x`` (see :class:`Activation`)."""
    return get(activation).apply_(x, activation_param)


def apply(x: Tensor, activation: str, activation_param: float) -> Tensor:
    """``phi(x)`` as a new tensor (``identity``: ``x`` itself)."""
    return get(activation).apply(x, activation_param)


def invert(z: Tensor, activation: str, activation_param: float,
           out: Tensor | None = None) -> Tensor:
    """``y = phi^-1(z)`` of an invertible activation (see :class:`Activation`)."""
    return ACTIVATIONS[activation].invert(z, activation_param, out)


def grad_from_output(dz: Tensor, z: Tensor, activation: str, activation_param: float,
                     out: Tensor | None = None) -> Tensor:
    """``dy = phi'(y) dz`` from the output ``z`` (see :class:`Activation`)."""
    return ACTIVATIONS[activation].grad_from_output(dz, z, activation_param, out)
