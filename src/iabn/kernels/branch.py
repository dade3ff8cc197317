"""The branch bit of the activations with one minimum (``silu``, ``gelu``, ``mish``: the
registry's ``needs_branch``), and the Newton steps that recover ``y`` from ``z`` and the bit
(docs/design.md, "SiLU and GELU in place"). Math only, used by the reference backend
(:mod:`.reference`), whose Triton twin runs the same steps in :mod:`.triton_kernels` with the
constants and step counts of this module.

Such an activation falls to one minimum ``z* = phi(y*)`` and rises again, so every output
``z* < z < 0`` comes from two inputs. Forward keeps, besides ``z``, the bit ``y < y*`` of every
element, packed eight to a byte (``uint8``, 1/32 of a float32 activation; :func:`new_bits`
makes the buffer the backends fill); backward recovers ``y`` on that branch by a fixed number
of Newton steps in the compute dtype (float32 for half inputs).

The Newton steps. Near the minimum ``phi(y) - z* ~ c (y - y*)^2 / 2`` (``c = phi''(y*)``), so
Newton on ``phi`` itself stalls there; it runs on functions that are close to linear across
the minimum instead:

- right branch (``y >= y*``): ``G(y) = sqrt(phi(y) - z*) = sqrt(z - z*)``, from
  ``y0 = max(y* + sqrt(2 (z - z*) / c), z)``;
- left branch (``y < y*``, ``z* < z < 0``): ``H(y) = sqrt(log(z* / phi(y))) = sqrt(log(z* / z))``
  with ``log(-phi(y))`` formed as ``log(-y) + log(phi(y) / y)`` (the registry's ``log_tail``:
  ``log sigmoid(y)``, ``log Phi(y)``...), exact in the tail where ``z`` is tiny, from
  ``y0 = y* - H / |H'(y*)|`` (exponential tails, SiLU and Mish: or ``y* - H^2`` where that
  is further out: their tail is ``H^2 ~ -y``).

Each step is clamped to its branch; ``invert`` has the details that make float32 exact near
the minimum (``z*`` in two parts, ``log1p``, a Taylor series of ``phi - z*``). Four steps in
float32 and five in float64 reach the float64 inverse of the stored ``z`` (measured over ``y``
in [-80, 30] and 1e-9 .. 1 from ``y*``: at most 3.7e-7 relative in float32, 2.9e-8 within
0.05 of ``y*``; 4e-15 in float64 away from the minimum).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import activations as act
from . import common as cutting
from . import cpu_loops
from .common import RecoverPiece, at_most, compute_dtype, part_count
from .fitted_inverse import INVERSE

#: Newton steps per compute dtype (float32 also for half inputs); measured, see above.
ITERATIONS = {torch.float32: 4, torch.float64: 5}
#: ``(y*, z*, c)`` per activation with one minimum: where ``phi' = 0``, ``phi(y*)`` and
#: ``c = phi''(y*)`` (the registry's :class:`~iabn.kernels.activations.Minimum`). Plain
#: floats: the compiler traces them as constants.
MINIMA = {name: (act.ACTIVATIONS[name].minimum.y_star, act.ACTIVATIONS[name].minimum.z_star,
                 act.ACTIVATIONS[name].minimum.curvature) for name in act.BRANCH_ACTIVATIONS}
#: ``phi(y* + u) - z* = sum_k a_k u^k``, ``k = 2..10``: the Taylor coefficients
#: ``phi^(k)(y*) / k!`` (float64, from torch's own derivatives; checked by the tests). Within
#: ``|u| <= 0.3`` they give ``phi - z*`` to 1e-9 of itself where float32 evaluation of
#: ``phi`` leaves an absolute error of ``z*``'s rounding, which the square root near the
#: minimum turns into errors in ``y`` of sqrt(eps) (measured: 5x the weight-gradient error of
#: the exact float64 inverse of the stored float32 ``z`` without them, 1.0-1.3x with them).
TAYLOR = {name: act.ACTIVATIONS[name].minimum.taylor for name in act.BRANCH_ACTIVATIONS}
TAYLOR_RADIUS = 0.3
#: The left branch's slope as a function of the output, ``phi'(y) = z R(v)``,
#: ``v = sqrt(log(z* / z))``: ``(V, a_0 .. a_12)``, ``R = sum_k a_k t^k`` with
#: ``t = min(2 v / V - 1, 1)``. Fitted by ``benchmarks/fit_inverse.py`` (Chebyshev least squares
#: weighted by ``|z|``, degree 12, down to ``z = -1e-9``; results in
#: ``benchmarks/results/fit_inverse.json``): in float32, farther than 0.05 from ``y*``, within
#: 9.8e-8 (silu), 7.5e-8 (gelu), 8.8e-8 (gelu_tanh), 7.9e-8 (mish) of the exact slope at the
#: float32 output (absolute; the left slopes lie in [-0.11, 0]). Used for float32 and half
#: inputs; float64 keeps the Newton steps.
LEFT_SLOPE = {
    "silu": (4.409578633618451, (
        0.8785234393100662, 0.16559526541836034, -0.16715952003184997, 0.1569400616190395,
        -0.19807657928587652, 0.1929160382704454, 0.1649499209740286, 0.5833064737306664,
        0.08321625833245094, -1.6015524542436408, -2.080073873273527, -1.0054424057931186,
        -0.1896166649554949)),
    "gelu": (4.353157961554606, (
        3.2819336193591453, 2.9716540561423868, 0.02142907586496004, 0.03275003277694388,
        -0.06996224005068402, 0.0661844992465172, 0.027570114219322095, 0.2372690499060386,
        0.03730517784736187, -0.366600705843078, -0.7028303287202374, -0.49043732608869867,
        -0.14462581112443074)),
    "gelu_tanh": (4.353306508085302, (
        3.569114582531944, 3.976319487285701, 1.0114391412735135, -0.0252089169854047,
        -0.3276405494799251, 0.3200282768114953, -0.05572914958759301, 0.029573342274365977,
        0.4840852157687447, -0.016314086243202464, -1.0300027929427449, -0.8845348631848619,
        -0.251403207414733)),
    "mish": (4.421349963623196, (
        0.8773228121122797, 0.1687859914628701, -0.16879352789279223, 0.16091118503201096,
        -0.12646623385308686, 0.10988101424146057, -0.3460867407580805, -0.3941565078224668,
        0.15536516407961387, 1.207628657642899, 1.5323795038386063, 0.8051970389886458,
        0.1345264008140457)),
}

#: The right branch's slope as a function of the output, ``phi'(y) = s h(s)``,
#: ``s = sqrt(z - z*)``: ``(S, E, q_0 .. q_15, f_0 .. f_16)``, ``h = F(t_f) + (t_n - 1) Q(t_n)``
#: with ``t_n = min(2 s / E - 1, 1)`` (the piece ``s <= E``) and ``t_f`` the same map of
#: ``[E, S]``, held to ``[-1, 1]``; ``Q`` is fitted with ``h(E) = F(-1)``, so each piece adds
#: nothing beyond its own (no choice per element); beyond ``S`` the slope is ``S h(S)``, 1 to
#: 2e-8. Fitted by ``benchmarks/fit_inverse.py`` (Chebyshev least squares of ``h`` weighted by
#: ``s``, degree 16 each, ``E`` the best of 0.25, 0.3 .. 0.75 ``S``; results in
#: ``benchmarks/results/fit_inverse.json``): within 3.7e-9 (gelu_tanh) .. 1.5e-8 (mish) of
#: the slope in float64; evaluated in float32 as here, within 2.0e-7 (gelu, gelu_tanh),
#: 2.2e-7 (silu, mish) of the exact slope at the float32 output farther than 0.05 from
#: ``y*`` (slopes up to 1.13, which float32 rounds in steps of 1.2e-7: about two of its
#: roundings). Used for float32 and half inputs.
RIGHT_SLOPE = {
    "silu": (4.581137994720667, 2.2905689973603334, (
        -0.43115132988968363, -0.025340418320774917, 0.3168209437977962,
        -0.04606334151578939, -0.0892206649387965, -0.025360618030020744,
        0.011914599449906065, 0.019707465883762924, 0.011004834129215872,
        -0.0009286421559867109, -0.007934768120499626, -0.0050356913270150185,
        0.0018731608318821409, 0.002694583966977666, -4.339003271217143e-05,
        -0.00047543308262493764), (
        0.29107871516639866, -0.09724143086001277, 0.033135651689631014,
        -0.01254626626277661, 0.006314850473062328, -0.00423341418063719,
        0.0028372595483555467, -0.0014159616771562149, 0.00027498226419770744,
        0.0002799845434518881, -0.00035767433276219957, 0.00026012742110762113,
        -0.00011851160328541375, -1.6784602587746022e-05, 5.292614923462017e-05,
        -1.73119848458976e-05, -7.639512186862266e-07)),
    "gelu": (2.503495932928648, 1.502097559757189, (
        -0.4848155011331431, -0.2521118241529329, 0.15393798384805413,
        0.05884135377754891, 0.03280899302437995, 0.003337019526864583,
        -0.0034125883375298025, -0.006289801662449827, -0.004066859245726551,
        -0.0024814983392891623, -0.0014209494940484405, -0.0003234203895675049,
        0.0011122988695642267, 0.0009335242472930464, 5.052917728807045e-06,
        -0.00015767502261698229), (
        0.4997491924174522, -0.1281176314603292, 0.041943045038266444,
        -0.02758393139383164, 0.02289374300082756, -0.009648751321964962,
        -0.006246821967643726, 0.01159735989341307, -0.004892740908872435,
        -0.0032909993117788304, 0.004589265201911156, -0.0007758067314811842,
        -0.0016700604807139464, 0.0008528626644256117, 0.00023191340737059506,
        -0.00019883863329655014, 9.637937789578304e-06)),
    "gelu_tanh": (2.404156162333976, 1.442493697400386, (
        -0.45101015507848213, -0.2583815917612362, 0.1268558573646281,
        0.04310400968029449, 0.024496677348829016, 0.002380500628392972,
        -0.0012594286679395745, -0.0030075095681774905, -0.001778749611377255,
        -0.0010904254239678527, -0.0004388419576638808, -0.00018622106533010524,
        0.00015649094927444444, 0.000216312994944453, 7.024897953620059e-05,
        -1.5617018988377287e-05), (
        0.5210664522077536, -0.13775189846549513, 0.05495797851379445,
        -0.041603660117662596, 0.023907340188843485, 0.006278048566005514,
        -0.020660847192171504, 0.00763213242411185, 0.00838011961625859,
        -0.0072484888806051565, -0.0015797021533806364, 0.003652104033555202,
        -0.00042411310257646473, -0.0011172799443603806, 0.0003782752160139108,
        0.0001629981085812609, -8.30927154448181e-05)),
    "mish": (3.320761972214642, 1.660380986107321, (
        -0.4432576653640293, -0.24052424267531744, 0.2570609408977404,
        0.1070464199535166, -0.020925183749712525, -0.03821012914685932,
        -0.022470298039350748, -0.006108907361334456, 0.0028957802632126194,
        0.005845124260682777, 0.005801486099481033, 0.00195827477244081,
        -0.002509739052388531, -0.0021331251478226357, 0.00023194443322109795,
        0.0004328174484273841), (
        0.40157949053213765, -0.13434683893576144, 0.04649504587155502,
        -0.019226509339760514, 0.011929773898895855, -0.009643180082299833,
        0.00687625220750576, -0.00288271901012296, -0.0005257254022600476,
        0.001864311017065843, -0.002125816609318694, 0.0020420972444003416,
        -0.0004468765818729188, -0.0013115468252294232, 0.0008561514402723833,
        0.0002102435228132913, -0.00020844572556838112)),
}


def _split(x: float, dtype: torch.dtype) -> tuple[float, float]:
    """``x`` as its value rounded to ``dtype`` plus the rest."""
    high = float(torch.tensor(x, dtype=dtype))
    return high, x - high


#: ``(z*_hi, z*_lo, y*_hi, y*_lo)`` per ``(activation, compute dtype)``: ``z*`` and ``y*`` in
#: two parts (:func:`invert`), made here once: made per call, ``float(torch.tensor(...))``
#: is a read of a tensor's value, which stops ``torch.compile``'s graph (a graph break in
#: every backward of a compiled model).
SPLIT = {(name, dtype): (*_split(z_star, dtype), *_split(y_star, dtype))
         for name, (y_star, z_star, _) in MINIMA.items()
         for dtype in (torch.float32, torch.float64)}
#: Per activation, its fitted slopes as :mod:`.cpu_loops` takes them.
SLOPES = {name: (LEFT_SLOPE[name], RIGHT_SLOPE[name], SPLIT[name, torch.float32][:2])
          for name in MINIMA}


def value(y: Tensor, activation: str) -> Tensor:
    """``phi(y)`` as a new tensor, accurate in the left tail (the registry's
    :attr:`~iabn.kernels.activations.Minimum.value`)."""
    return act.ACTIVATIONS[activation].minimum.value(y)


def apply_(x: Tensor, activation: str) -> Tensor:
    """``x <- phi(x)``; half inputs are computed in float32 and rounded once."""
    return act.ACTIVATIONS[activation].minimum.apply_(x)


def derivative(y: Tensor, activation: str) -> Tensor:
    """``phi'(y)``."""
    return act.ACTIVATIONS[activation].minimum.derivative(y)


def minimum(activation: str) -> tuple[float, float, float]:
    """``(y*, z*, c)`` of ``activation`` (:data:`MINIMA`)."""
    return MINIMA[activation]


def _log_neg(y: Tensor, activation: str) -> Tensor:
    """``log(-phi(y))`` for ``y < 0``, exact where ``phi(y)`` is tiny."""
    return torch.log(-y).add_(act.ACTIVATIONS[activation].minimum.log_tail(y))


def _log_neg_derivative(y: Tensor, activation: str) -> Tensor:
    return act.ACTIVATIONS[activation].minimum.log_tail_derivative(y).add_(y.reciprocal())


def _log1p_(u: Tensor) -> Tensor:
    """``log1p(u)`` for ``u >= 0`` as ``log(w) + (u - (w - 1)) / w``, ``w = 1 + u`` rounded (the
    second term restores what the rounding of ``w`` lost; ``w - 1``, ``u - (w - 1)`` and
    ``(w - 1) + 1`` are exact), a new tensor; ``u`` is overwritten. ``log2`` is vectorised on
    CPU, ``log1p`` and ``log`` are not (float32, one thread, 2.4M elements: ``log2`` 3.5 ms,
    ``log`` 11 ms, ``log1p`` 41 ms, measured under load 4)."""
    w = u + 1
    u.sub_(w.sub_(1)).div_(w.add_(1))
    return w.log2_().mul_(math.log(2)).add_(u)


#: The coefficients of :func:`_polynomial_` as 0-d tensors, per ``(powers, device)``.
_COEFFICIENTS: dict[tuple, list[Tensor]] = {}


def _polynomial_(out: Tensor, t: Tensor, powers: tuple[float, ...]) -> Tensor:
    """``sum_k powers[k] t^k`` by Horner's rule, written into ``out`` (``t``'s shape). Outside
    the compiler one ``addcmul`` a step with the coefficient as a 0-d tensor (on CPU, one
    thread: 0.57x the time of ``mul_`` then ``add_``, 16 steps on 2.4M float32); the compiler
    fuses the plain steps."""
    out.fill_(powers[-1])
    if torch.compiler.is_compiling():
        for a in powers[-2::-1]:
            out.mul_(t).add_(a)
        return out
    key = (powers, t.device, t.dtype)
    if key not in _COEFFICIENTS:
        _COEFFICIENTS[key] = [torch.tensor(a, device=t.device, dtype=t.dtype)
                              for a in powers[-2::-1]]
    for a in _COEFFICIENTS[key]:
        torch.addcmul(a, out, t, out=out)
    return out


def left_slope(z: Tensor, activation: str) -> Tensor:
    """``phi'(y)`` of left-branch outputs ``z`` (float32), from :data:`LEFT_SLOPE`: no Newton
    step, no ``exp``/``erfc``; ``log(z* / z)`` as ``log1p((z - z*) / -z)`` with ``z*`` in two
    parts (exact near the minimum). An output that underflowed to 0 gets the slope 0. Three
    temporaries of ``z``'s size, the result one of them."""
    v_max, powers = LEFT_SLOPE[activation]
    z_hi, z_lo = SPLIT[activation, z.dtype][:2]
    z = z.clamp(min=z_hi, max=-torch.finfo(z.dtype).tiny)
    u = (z - z_hi).sub_(z_lo).div_(z).neg_()
    t = _log1p_(u).clamp_(min=0).sqrt_().mul_(2 / v_max).sub_(1).clamp_(max=1)
    return _polynomial_(u, t, powers).mul_(z)


def right_slope(z: Tensor, activation: str) -> Tensor:
    """``phi'(y)`` of right-branch outputs ``z`` (float32), from :data:`RIGHT_SLOPE`: no
    Newton step, no ``exp``/``erf``; finite for every finite ``z`` (an output below ``z*``
    is taken as ``z*``). Four temporaries of ``z``'s size, the result one of them."""
    s_max, edge, near, far = RIGHT_SLOPE[activation]
    z_hi, z_lo = SPLIT[activation, z.dtype][:2]
    s = (z - z_hi).sub_(z_lo).clamp_(min=0).sqrt_()
    u = s.mul(2 / edge).sub_(2).clamp_(max=0)  # t_n - 1: 0 on the far piece
    h = _polynomial_(torch.empty_like(s), u + 1, near).mul_(u)
    width = s_max - edge
    t = torch.mul(s, 2 / width, out=u).sub_((s_max + edge) / width).clamp_(min=-1, max=1)
    h.add_(_polynomial_(torch.empty_like(s), t, far))
    return h.mul_(s.clamp_(max=s_max))


def fitted_slope(z: Tensor, left: Tensor, activation: str) -> Tensor:
    """``phi'(y)`` from ``z`` (float32) and the branch ``left`` names (bool, or float32 0/1:
    :func:`torch.lerp`'s weight, exact at 0 and 1), both fitted slopes on every element."""
    right, left_ = right_slope(z, activation), left_slope(z, activation)
    if left.dtype == torch.bool:
        return torch.where(left, left_, right)
    return torch.lerp(right, left_, left)


def invert(z: Tensor, left: Tensor, activation: str, stored: torch.dtype) -> Tensor:
    """``y`` with ``phi(y) = z`` on the branch ``left`` (``y < y*``) names, in ``z``'s dtype.

    ``stored``: the dtype ``z`` was rounded to. A left-branch ``z`` that underflowed to 0 is
    taken as the smallest subnormal of that dtype: ``y`` then is the point below which every
    output rounds to 0 (docs/design.md: the bound)."""
    y_star, z_star, c = minimum(activation)
    info = torch.finfo(z.dtype)
    # below this, G and H are dominated by the rounding of z: use their slope at y*
    floor = 4 * math.sqrt(info.eps)
    smallest = torch.finfo(stored).tiny * torch.finfo(stored).eps
    slope_right = math.sqrt(c / 2)
    slope_left = math.sqrt(c / (2 * -z_star))
    log_star = math.log(-z_star)
    # z* in two parts: z - z_hi is exact near z* (Sterbenz), so z* rounded to z's dtype does
    # not shift every target near the minimum by the same amount (measured in float32: 8x
    # the weight-gradient error of the exact inverse, 1.0x with the split)
    z_hi, z_lo, y_hi, y_lo = SPLIT[activation, z.dtype]

    def above_minimum(f: Tensor) -> Tensor:
        return (f - z_hi).sub_(z_lo)

    series = TAYLOR[activation] if z.dtype == torch.float32 else None

    def phi_above_minimum(y: Tensor, right: bool = False) -> tuple[Tensor, Tensor]:
        """``(phi(y), phi(y) - z*)``, the latter from the Taylor series near y* (float32).
        ``right``: every ``y >= y*``, where torch's own function does not cancel (GELU's
        erfc form, for the left tail, computes both forms)."""
        f = act.ACTIVATIONS[activation].apply(y, 0.0) if right else value(y, activation)
        d = above_minimum(f)
        if series is None:
            return f, d
        u = (y - y_hi).sub_(y_lo)
        poly = torch.full_like(u, series[-1])
        for coefficient in series[-2::-1]:
            poly.mul_(u).add_(coefficient)
        poly.mul_(u).mul_(u)
        return f, torch.where(u.abs() <= TAYLOR_RADIUS, poly, d)

    def log_ratio(f: Tensor, d: Tensor, log_f: Tensor | None) -> Tensor:
        # log(z* / f) for z* <= f < 0: log1p(d / -f) near the minimum, where it is exact;
        # log(-z*) - log(-f) in the tail, where d / -f grows without bound
        ratio = d / -f
        tail = log_star - (torch.log(-f) if log_f is None else log_f)
        return torch.where(ratio <= 1, torch.log1p(ratio), tail).clamp_(min=0)

    # On a CPU outside the compiler each branch's steps run on its own elements only (a
    # boolean gather): the left branch's log tail (log_ndtr for GELU, 10 ns an element) ran
    # on every element otherwise, and most elements are on the right (a ViT-S step's GELUs
    # on CPU: 1.9 of 2.4 s in their backward before). On a GPU a gather needs the host to
    # know the count (a synchronisation), and the compiler wants static shapes: both
    # branches run on every element there and one is chosen per element.
    split = z.device.type == "cpu" and not torch.compiler.is_compiling()
    right = ~left if split else None
    z_right, z_left = (z[right], z[left]) if split else (z, z)
    # right branch: G(y) = sqrt(phi(y) - z*) = target_r
    target_r = above_minimum(z_right).clamp_(min=0).sqrt_()
    y_r = torch.maximum(target_r / slope_right + y_star, z_right)
    # left branch: H(y) = sqrt(log(z* / phi(y))) = target_l
    z_left = z_left.clamp(min=z_star, max=-smallest)
    target_l = log_ratio(z_left, above_minimum(z_left).clamp_(min=0), None).sqrt_()
    y_l = y_star - target_l / slope_left
    if act.ACTIVATIONS[activation].minimum.exponential_tail:
        y_l = torch.minimum(y_l, y_star - target_l.square())
    for _ in range(ITERATIONS[z.dtype]):
        g = phi_above_minimum(y_r, right=True)[1].clamp_(min=0).sqrt_()
        g_slope = derivative(y_r, activation) / (2 * g).clamp_(min=info.tiny)
        g_slope = torch.where(g > floor, g_slope, slope_right)
        y_r = (y_r - (g - target_r) / g_slope).clamp_(min=y_star)
        f, d = phi_above_minimum(y_l)
        f = f.clamp_(max=-info.tiny)
        h = log_ratio(f, d.clamp_(min=0), _log_neg(y_l, activation)).sqrt_()
        h_slope = _log_neg_derivative(y_l, activation) / (-2 * h).clamp_(max=-info.tiny)
        h_slope = torch.where(h > floor, h_slope, -slope_left)
        y_l = (y_l - (h - target_l) / h_slope).clamp_(max=y_star)
    if not split:
        return torch.where(left, y_l, y_r)
    y = torch.empty_like(z)
    y[left] = y_l
    y[right] = y_r
    return y


# ------------------------------------------------------------------ the branch bits

def _bit_weights(device: torch.device) -> Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_bits(mask: Tensor) -> Tensor:
    """A bool tensor as ``uint8`` bytes, eight elements each in its logical (contiguous)
    order, the last byte padded with zeros: ``ceil(numel / 8)`` bytes."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = F.pad(flat, (0, pad))
    rows = flat.view(-1, 8)
    if not torch.compiler.is_compiling():  # three launches
        return rows.mul_(_bit_weights(mask.device)).sum(-1, dtype=torch.uint8)
    # under the compiler, shifted ORs of the eight columns, which Inductor vectorises (its
    # uint8 sum over rows of 8 took 201 ms at 8x197x1536 on CPU, one thread; these 1.8 ms)
    packed = rows[:, 0].clone()
    for k in range(1, 8):
        packed = packed.bitwise_or_(rows[:, k].bitwise_left_shift(k))
    return packed


def pack_below(x: Tensor, y_star: float) -> Tensor:
    """:func:`pack_bits` of ``x < y_star``: one pass on a CPU float32 or float64 ``x`` where
    Numba runs (:mod:`.cpu_loops`; torch's compare and packing are four passes, 3.9 ms at
    8x197x1536 float32 on one thread against 0.2 ms), torch's operations elsewhere."""
    if x.dtype in (torch.float32, torch.float64) and cpu_loops.runs_on(x):
        return cpu_loops.pack_below(x, y_star)
    return pack_bits(x < y_star)


def unpack_bits(packed: Tensor, shape: torch.Size) -> Tensor:
    """The inverse of :func:`pack_bits`: a contiguous bool tensor of ``shape``."""
    bits = packed.unsqueeze(-1).bitwise_and(_bit_weights(packed.device)).ne(0)
    return bits.reshape(-1)[: math.prod(shape)].view(shape)


# ------------------------------------------------------------------ activations without a norm


#: Elements per pass of the CPU backward (a multiple of 8: whole bytes of the bits). Its
#: dozen float32 temporaries of this size stay in a core's cache; each fitted slope is
#: about 40 ATen operations, each a pass.
CHUNK = 1 << 16


def _bit_table(device: torch.device) -> Tensor:
    """Row ``b``: the eight bits of the byte ``b`` as float32 0/1, in :func:`pack_bits`'
    order (a lookup by ``F.embedding`` unpacks a chunk's bits straight to :func:`torch.lerp`'s
    weights; a bool mask's ``where`` cost 10 passes)."""
    return _bit_weights(device).unsqueeze(0).bitwise_and(
        torch.arange(256, device=device, dtype=torch.uint8).unsqueeze(1)).ne(0).float()


#: :func:`_bit_table` of the CPU, where :func:`_fitted_grad_cpu` runs: made once, on import.
_CPU_BIT_TABLE = _bit_table(torch.device("cpu"))


def _fitted_grad_cpu(z: Tensor, dz: Tensor, bits: Tensor, activation: str) -> Tensor:
    """``dx = phi'(y) dz`` from the fitted slopes of both branches on every element: float32
    and half ``z`` on a CPU. Numba's one loop where it runs (:mod:`.cpu_loops`), else ATen's
    operations a :data:`CHUNK` of the flattened (contiguous) ``z`` at a time."""
    if cpu_loops.runs_on(z, dz, bits):
        return cpu_loops.activation_grad(z, dz, bits, activation, SLOPES[activation])
    zf, dzf = z.contiguous().view(-1), dz.contiguous().view(-1)
    dx = torch.empty(zf.shape, dtype=z.dtype, device=z.device)
    table = _CPU_BIT_TABLE
    for a in range(0, zf.numel(), CHUNK):
        b = min(a + CHUNK, zf.numel())
        left = F.embedding(bits[a // 8: (b + 7) // 8].long(), table).view(-1)[: b - a]
        slope = fitted_slope(zf[a:b].float(), left, activation)
        dx[a:b] = slope.mul_(dzf[a:b])
    return dx.view(z.shape)


@torch.library.custom_op("iabn::fitted_activation_grad", mutates_args=())
def _fitted_grad_op(z: Tensor, dz: Tensor, bits: Tensor, activation: str) -> Tensor:
    """:func:`_fitted_grad_cpu` as an operator the compiler calls, not traces: Inductor's one
    fused loop of both fitted slopes took 2-3x the eager chunks' time on CPU (8x197x1536, one
    thread: GELU 106 ms against 45 ms; its vector code runs 8 of 16 lanes on rows of eight,
    and unpacks the bits per element otherwise)."""
    return _fitted_grad_cpu(z, dz, bits, activation)


@_fitted_grad_op.register_fake
def _(z, dz, bits, activation):
    return torch.empty(z.shape, dtype=z.dtype, device=z.device)


def _fitted_grad_rows(z: Tensor, dz: Tensor, bits: Tensor, activation: str) -> Tensor:
    """The compiler's form for float32 and half ``z`` of ``8 k`` elements off the CPU: rows of
    eight, one byte of bits each, so that a row's bits are a broadcast, not a division per
    element (Inductor, CPU, one thread, 8x197x1536 GELU: 43 ms, 87 ms unpacked per element,
    under load 3.5)."""
    rows = z.reshape(-1, 8)
    left = bits[: rows.shape[0]].unsqueeze(1).bitwise_and(_bit_weights(z.device)).ne(0)
    slope = fitted_slope(rows.float(), left, activation)
    return slope.mul_(dz.reshape(-1, 8)).to(z.dtype).view(z.shape)


def _activation_grad_whole(z: Tensor, dz: Tensor, left: Tensor, activation: str) -> Tensor:
    compute = compute_dtype(z.dtype)
    if compute == torch.float32:  # under the compiler (CPU ones outside go to _fitted_grad_cpu)
        return fitted_slope(z.float(), left, activation).mul_(dz).to(z.dtype)
    y = invert(z.to(compute), left, activation, z.dtype)
    dy = act.ACTIVATIONS[activation].minimum.derivative(y).mul_(dz.to(compute))
    return dy.to(z.dtype)


def activation_grad(z: Tensor, dz: Tensor, bits: Tensor | None, activation: str,
                    activation_param: Any = 0.0) -> Tensor:
    """``dx = phi'(y) dz`` with ``y`` recovered from ``z`` and the packed ``bits``
    (:meth:`.backend.KernelBackend.activation_grad`); for an invertible activation (``bits``
    ``None``) the registry's ``grad_from_output``, in the compute dtype.

    float32 and half ``z``: the fitted slopes (:func:`fitted_slope`). On a CPU one Numba loop
    (:mod:`.cpu_loops`), or where Numba is missing a :data:`CHUNK` of the flattened ``z`` at a
    time (:func:`_fitted_grad_cpu`; under the compiler either through the operator
    :func:`_fitted_grad_op`); elsewhere under the compiler whole, as rows of eight
    (:func:`_fitted_grad_rows`); elsewhere outside it a slice at a time, as below. float64:
    Newton's steps (:func:`invert`). A slice is one along ``z``'s largest dimension, 1/64 of
    a large activation, as the batch-norm layers' backward (:func:`pieces`): Newton's
    temporaries (about 16 tensors of what it inverts) are a slice's."""
    if bits is None:
        compute = compute_dtype(z.dtype)
        return act.ACTIVATIONS[activation].grad_from_output(
            dz.to(compute), z.to(compute), activation_param).to(z.dtype)
    fitted = compute_dtype(z.dtype) == torch.float32
    compiling = torch.compiler.is_compiling()
    if fitted and z.device.type == "cpu":
        if compiling:
            return _fitted_grad_op(z, dz, bits, activation)
        return _fitted_grad_cpu(z, dz, bits, activation)
    if fitted and compiling and z.numel() % 8 == 0:
        return _fitted_grad_rows(z, dz, bits, activation)
    left = unpack_bits(bits, z.shape)
    count = part_count(z.numel(), 4 * cutting.PIECES) if z.dim() else 1
    if count == 1 or compiling:
        return _activation_grad_whole(z, dz, left, activation)
    dim = max(range(z.dim()), key=lambda d: z.shape[d])
    dx = torch.empty_like(z)
    for a, b in at_most(z.shape[dim], count):
        at = (slice(None),) * dim + (slice(a, b),)
        dx[at] = _activation_grad_whole(z[at], dz[at], left[at], activation)
    return dx


# ------------------------------------------------------ the norm layers' recovery of y


def recovery(z: Tensor, bits: Tensor, dz: Tensor, activation: str
             ) -> tuple[list[tuple], RecoverPiece]:
    """``(index, recover_piece)`` for the norm layers' backward: :func:`.common.pieces` of
    ``z`` (``(N, C, *)``), its branch bits and ``dz``, and the function that gives a piece's
    ``y`` and ``dy = phi'(y) dz`` in the compute dtype: for half inputs on a CPU the loop of
    :func:`.cpu_loops.invert_and_slope` on the piece in float32 (its bits packed again),
    else Newton's steps (:func:`invert`)."""
    compute = compute_dtype(z.dtype)
    # Newton's temporaries (at their peak 16.25 float32 tensors of what it inverts, measured
    # with iabn.measure.traffic) are a piece's, not the activation's: 1/64 of it for large
    # activations
    (zv, dzv, leftv), index = cutting.pieces(z, dz, unpack_bits(bits, z.shape),
                                             parts=4 * cutting.PIECES)
    loop = compute == torch.float32 and cpu_loops.runs_on(z, dz, bits)

    def recover_piece(at: tuple, with_y: bool) -> tuple[Tensor, Tensor]:
        if loop:
            return cpu_loops.invert_and_slope(
                zv[at].to(compute), dzv[at].to(compute), pack_bits(leftv[at]), activation,
                SLOPES[activation], INVERSE[activation], MINIMA[activation][1])
        y = invert(zv[at].to(compute), leftv[at], activation, z.dtype)
        return y, derivative(y, activation).mul_(dzv[at].to(compute))

    return index, recover_piece


def recover(z: Tensor, bits: Tensor, dz: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    """``(y, dy)`` of the whole of ``z`` (``(N, C, *)``, float32 or float64; ``y`` and ``dy``
    in its shape): on a CPU for float32 the one loop of :func:`.cpu_loops.invert_and_slope`
    (the fitted inverse in float64 and the fitted slope: within 6e-8 of ``max(|y|, 1)`` of the
    exact inverse of the stored output, where the float32 Newton steps reach 3.8e-7 to
    4.0e-7; the layer's forward + backward with SiLU at 8x64x56x56 15 ms, one thread, where
    the Newton steps' backward alone took about 200 ms; docs/design.md), else Newton's steps
    a piece at a time."""
    if not z.numel():  # an empty batch: nothing to cut into pieces
        return torch.empty_like(z), torch.empty_like(z)
    if z.dtype == torch.float32 and cpu_loops.runs_on(z, dz, bits):
        return cpu_loops.invert_and_slope(z, dz, bits, activation, SLOPES[activation],
                                          INVERSE[activation], MINIMA[activation][1])
    index, recover_piece = recovery(z, bits, dz, activation)
    y, dy = torch.empty_like(z), torch.empty_like(z)
    (yv, dyv), _ = cutting.pieces(y, dy)  # the (N, C, L) views that recovery's index cuts
    for at in index:
        y_piece, dy_piece = recover_piece(at, True)
        yv[at].copy_(y_piece)
        dyv[at].copy_(dy_piece)
    return y, dy


__all__ = ["activation_grad", "fitted_slope", "invert", "left_slope", "minimum", "pack_bits",
           "recover", "recovery", "right_slope", "unpack_bits"]
