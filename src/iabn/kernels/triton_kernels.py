"""Triton kernels of In-Place ABN (math only; the launches are in :mod:`.triton_backend`).

A layer's tensor is seen as a dense matrix of ``R`` rows by ``K`` columns, row stride ``K``:

``NCS`` (contiguous ``(N, C, *spatial)``)
    ``R = N * C`` rows of ``K = S`` spatial values; the channel of row ``r`` is ``r % C``.
``MC`` (channels-last, and ``(N, C)``)
    ``R = N * S`` rows of ``K = C`` channels; the channel of column ``k`` is ``k``.

Per-channel reductions write one partial result per (program, channel); a ``finalize`` kernel
merges the partials in a fixed order. So the result does not depend on scheduling
(deterministic, no atomics, no locks).

The forward statistics are accurate to far below one unit in the last place of the data's
spread, because the mean decides on which side of the activation's kink each value lands:
an error of ``d`` standard deviations in the mean moves about ``0.4 * d`` of all values across
it, and those get the other slope in backward. (With float32 tile means merged in float32 the
mean was off by ~1e-7 std, and one value in ~10M of a 100k-per-channel layer took the wrong
slope; PyTorch's kernels, which accumulate in float64 on CPU, none.) So each tile is summarised
by the corrected two-pass formula in ``ACC`` (float32; float64 for float64 inputs) -- its
mean, then the sum ``r`` of the deviations from that mean, which is the mean's rounding error
times the count and is summed accurately because the deviations are small -- and the tile
summaries ``(count, mean + r/n, M2 - r^2/n)`` are merged with Chan's formula in float64. Per
element this costs one more sum; float64 arithmetic runs once per tile and channel, not per
element. Mean and variance never come from a sum and a sum of squares, which cancel
catastrophically when ``|mean| >> std``.

Row offsets are computed in 64 bits, so tensors of more than 2**31 elements are addressed
correctly. Elementwise math runs in the accumulation dtype (float32 for half inputs).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from .activations import ACTIVATIONS

#: Activation codes, ``ACT`` of the kernels (``constexpr``: a kernel reads no other globals),
#: the registry's :attr:`~.activations.Activation.code`. Kernels branch on these names, and an
#: activation no branch names fails to compile (``tl.static_assert``) rather than take another
#: one's path. The activations with a branch bit (``needs_branch``) get ``BRANCH=True``: their
#: kernels take the packed bits and a table of constants (``consts``, below).
IDENTITY, LEAKY_RELU, ELU, SILU, GELU, MISH, GELU_TANH = (
    tl.constexpr(ACTIVATIONS[name].code)
    for name in ("identity", "leaky_relu", "elu", "silu", "gelu", "mish", "gelu_tanh")
)


class Traffic(NamedTuple):
    """The pointer arguments a kernel loads from (``reads``) and stores to (``writes``), by
    name. :mod:`iabn.measure.traffic` counts each launch's bytes from them; every kernel declares
    its
    own right after its definition, to be kept true to its ``tl.load`` and ``tl.store``."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]


#: Kernel name -> its :class:`Traffic`.
TRAFFIC: dict[str, Traffic] = {}


def _declare(kernel, reads: tuple[str, ...], writes: tuple[str, ...]) -> None:
    unknown = (set(reads) | set(writes)) - set(kernel.arg_names)
    if unknown:
        raise NameError(f"{kernel.fn.__name__} has no arguments {sorted(unknown)}")
    TRAFFIC[kernel.fn.__name__] = Traffic(reads, writes)


@triton.jit
def _activate(y, ACT: tl.constexpr, param):
    if ACT == LEAKY_RELU:
        y = tl.where(y >= 0, y, y * param)
    elif ACT == ELU:
        # exp of the clamped value: the positive branch is discarded, and must not overflow.
        y = tl.where(y >= 0, y, param * (tl.exp(tl.minimum(y, 0.0)) - 1.0))
    else:
        tl.static_assert(ACT == IDENTITY, "an invertible activation without a branch here")
    return y


@triton.jit
def _negative(z):
    """Whether ``z``'s sign bit is set: ``-0.0`` counts as negative. A half-precision output
    of a tiny negative ``y`` rounds to ``-0.0`` (leaky_relu's ``0.01 * y`` underflows for
    ``|y| < 3e-6`` in float16); its sign still tells which branch produced it, where
    ``z >= 0`` would take the positive one."""
    if z.dtype == tl.float64:  # noqa: SIM108 (a compile-time branch of the kernel)
        bits = z.to(tl.int64, bitcast=True)
    else:
        bits = z.to(tl.int32, bitcast=True)
    return bits < 0


@triton.jit
def _recover(z, dz, ACT: tl.constexpr, param, tiny):
    """``(y, dy)``: the activation's input and gradient, from its output ``z`` and ``dz``."""
    if ACT == LEAKY_RELU:
        negative = _negative(z)
        y = tl.where(negative, z / param, z)
        dy = tl.where(negative, dz * param, dz)
    elif ACT == ELU:
        # log(1 + z/alpha), kept finite where exp underflowed in forward (z == -alpha); the
        # gradient there, dz * (z + alpha), is 0, so the clamp changes no gradient.
        negative = _negative(z)
        ratio = tl.maximum(tl.minimum(z, 0.0) / param, -1.0 + tiny)
        y = tl.where(negative, tl.log(1.0 + ratio), z)
        dy = tl.where(negative, dz * (z + param), dz)
    else:
        tl.static_assert(ACT == IDENTITY, "an invertible activation without a branch here")
        y = z
        dy = dz
    return y, dy


# ---------------------------------------------------------------------------------------------
# SiLU, GELU and Mish: the branch bit and the Newton inversion of :func:`.branch.invert`,
# step for step. Every constant that is not exact in float32 comes from a table in the compute
# dtype (``consts``, :func:`.triton_backend.branch_constants`), at the indices below: a Python
# float in a kernel is a float32 constant, which would cost a float64 layer its precision.
# For the same reason every float argument of a kernel is annotated ``tl.float64``: unannotated,
# Triton passes a Python float as float32 (momentum 0.1 then updates the running statistics
# 1.5e-8 off, eps 1e-5 moves a float64 output by 1e-13; the interpreter keeps float64, so only
# a GPU showed it), and kernels cast them to ``ACC`` before tile arithmetic.

#: Indices into ``consts`` (``constexpr``: a kernel reads no other globals).
(Y_STAR, Z_HI, Z_LO, Y_LO, SLOPE_RIGHT, SLOPE_LEFT, LOG_STAR, FLOOR, SMALLEST, TINY, SQRT1_2,
 LOG_SQRT_2PI, LOG_HALF, EXP_TAIL, TANH_BETA2, TANH_KAPPA, TAYLOR_FIRST) = (
    tl.constexpr(i) for i in range(17))
#: The Taylor series has 9 coefficients; the Chebyshev series of ``erfcx`` follows it.
CHEB_FIRST = tl.constexpr(int(TAYLOR_FIRST) + 9)


@triton.jit
def _const(consts_ptr, INDEX: tl.constexpr):
    return tl.load(consts_ptr + INDEX)


@triton.jit
def _sigmoid(y):
    """``1 / (1 + exp(-y))`` without overflow: ``e / (1 + e)`` with ``e = exp(-|y|)`` below 0
    (keeps the subnormal outputs of SiLU's far tail that ``F.silu`` has)."""
    e = tl.exp(-tl.abs(y))
    return tl.where(y >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _log1p(x):
    """``log(1 + x)``, exact for small ``x``: ``log(u) * x / (u - 1)``, ``u = 1 + x`` rounded
    (the rounding of ``u`` cancels in the ratio). Triton has no ``log1p`` in its interpreter."""
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * (x / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _erfcx(t, consts_ptr, CHEB: tl.constexpr):
    """``exp(t^2) erfc(t)`` for ``t >= 0``: ``q(s) / (1 + 2 t)``, ``q`` a Chebyshev series in
    ``s = (t - K) / (t + K)`` (``(1 + 2t) erfcx(t)`` is smooth and bounded on ``[0, inf)``, as
    Shepherd and Laframboise use it). Coefficients: :data:`.triton_backend.ERFCX_SERIES`,
    measured within 7e-16 (25 terms, float64) and 2.3e-7 (16, float32) of the exact value.
    Hand-written: the interpreter has no ``erfc`` and none of CUDA's libdevice."""
    s = (t - 3.75) / (t + 3.75)
    b1 = tl.zeros_like(t)
    b2 = tl.zeros_like(t)
    for i in tl.static_range(CHEB - 1, 0, -1):
        b0 = 2.0 * s * b1 - b2 + tl.load(consts_ptr + CHEB_FIRST + i)
        b2 = b1
        b1 = b0
    return (s * b1 - b2 + tl.load(consts_ptr + CHEB_FIRST)) / (1.0 + 2.0 * t)


@triton.jit
def _exp_neg_square(t):
    """``exp(-t^2)`` without the rounding of ``t^2`` (an error of ``eps * t^2`` relative):
    ``t = h + (t - h)`` with ``h`` on a grid of 1/64, whose square is exact."""
    h = tl.floor(t * 64.0) / 64.0
    return tl.exp(-(h * h)) * tl.exp(-((t - h) * (t + h)))


@triton.jit
def _half_erfc(t, consts_ptr, CHEB: tl.constexpr):
    """``erfc(t) / 2`` for ``t >= 0`` (``Phi(-t sqrt 2)``)."""
    return 0.5 * _exp_neg_square(t) * _erfcx(t, consts_ptr, CHEB)


@triton.jit
def _mish_tanh(y):
    """``(t, 1 - t)``, ``t = tanh(softplus(y))``, without overflow or cancellation: with
    ``e = exp(-|y|)``, ``t = (1 + 2e) / (1 + 2e + 2e^2)`` for ``y >= 0`` and
    ``e (e + 2) / (e (e + 2) + 2)`` below."""
    e = tl.exp(-tl.abs(y))
    n = e * (e + 2.0)
    right = 1.0 + 2.0 * e + 2.0 * e * e
    t = tl.where(y >= 0, (1.0 + 2.0 * e) / right, n / (n + 2.0))
    return t, tl.where(y >= 0, 2.0 * e * e / right, 2.0 / (n + 2.0))


@triton.jit
def _tanh_2u(y, consts_ptr):
    """The tanh GELU's ``2u = 2 sqrt(2/pi) (y + 0.044715 y^3)`` and ``d(2u)/dy``
    (``(1 + tanh(u)) / 2 = sigmoid(2u)``)."""
    beta2 = _const(consts_ptr, TANH_BETA2)
    kappa_y2 = _const(consts_ptr, TANH_KAPPA) * (y * y)
    return beta2 * y * (1.0 + kappa_y2), beta2 * (1.0 + 3.0 * kappa_y2)


@triton.jit
def _branch_value(y, ACT: tl.constexpr, consts_ptr, CHEB: tl.constexpr):
    """``phi(y)``: SiLU ``y * sigmoid(y)``; GELU ``y * Phi(y)``, ``Phi`` from ``erf`` for
    ``y >= 0`` (as ``F.gelu``) and from ``erfc`` below (no cancellation in the tail); Mish
    ``y * tanh(softplus(y))``; tanh GELU ``y * sigmoid(2u)``."""
    if ACT == SILU:
        f = y * _sigmoid(y)
    elif ACT == MISH:
        f = y * _mish_tanh(y)[0]
    elif ACT == GELU_TANH:
        f = y * _sigmoid(_tanh_2u(y, consts_ptr)[0])
    else:
        tl.static_assert(ACT == GELU, "an activation with a branch bit without a branch here")
        r = _const(consts_ptr, SQRT1_2)
        left = y * _half_erfc(tl.maximum(-y, 0.0) * r, consts_ptr, CHEB)
        f = tl.where(y < 0, left, 0.5 * y * (1.0 + tl.math.erf(y * r)))
    return f


@triton.jit
def _branch_derivative(y, ACT: tl.constexpr, consts_ptr, CHEB: tl.constexpr):
    """``phi'(y)``: ``s (1 + y (1 - s))``, ``s = sigmoid(y)``; ``Phi(y) + y phi_N(y)``;
    Mish ``t + y s (1 - t^2)``, ``t = tanh(softplus(y))``."""
    if ACT == SILU:
        s = _sigmoid(y)
        d = s * (1.0 + y * (1.0 - s))
    elif ACT == MISH:
        t, one_minus_t = _mish_tanh(y)
        d = t + y * (one_minus_t * (1.0 + t)) * _sigmoid(y)
    elif ACT == GELU_TANH:
        v, dv = _tanh_2u(y, consts_ptr)
        s = _sigmoid(v)
        d = s * (1.0 + y * _sigmoid(-v) * dv)  # 1 - s rounds where s is near 1
    else:
        tl.static_assert(ACT == GELU, "an activation with a branch bit without a branch here")
        r = _const(consts_ptr, SQRT1_2)
        cdf = tl.where(y < 0, _half_erfc(tl.maximum(-y, 0.0) * r, consts_ptr, CHEB),
                       0.5 * (1.0 + tl.math.erf(y * r)))
        density = tl.exp(-0.5 * y * y - _const(consts_ptr, LOG_SQRT_2PI))
        d = cdf + y * density
    return d


@triton.jit
def _log_tail(y, ACT: tl.constexpr, consts_ptr, CHEB: tl.constexpr):
    """``log(phi(y) / y)`` for ``y < 0``, exact in the tail: ``log sigmoid(y)`` (SiLU),
    ``log Phi(y)`` (GELU), ``log tanh(softplus(y))`` (Mish)."""
    if ACT == SILU:
        tail = y - _log1p(tl.exp(y))
    elif ACT == MISH:
        e = tl.exp(y)  # log tanh(softplus(y)) = y + log1p(e / 2) - log1p(e + e^2 / 2)
        tail = y + _log1p(0.5 * e) - _log1p(e * (1.0 + 0.5 * e))
    elif ACT == GELU_TANH:
        v = _tanh_2u(y, consts_ptr)[0]  # log sigmoid(2u), 2u < 0
        tail = v - _log1p(tl.exp(v))
    else:
        tl.static_assert(ACT == GELU, "an activation with a branch bit without a branch here")
        t = -y * _const(consts_ptr, SQRT1_2)
        tail = _const(consts_ptr, LOG_HALF) + tl.log(_erfcx(t, consts_ptr, CHEB)) - t * t
    return tail


@triton.jit
def _log_neg_derivative(y, tail, ACT: tl.constexpr, consts_ptr):
    """``d/dy log(-phi(y))`` for ``y < 0``; ``tail``: :func:`_log_tail` of ``y`` (GELU's
    derivative reuses it rather than evaluate ``erfcx`` again)."""
    if ACT == SILU:
        d = _sigmoid(-y) + 1.0 / y
    elif ACT == MISH:
        e = tl.exp(y)
        h = 0.5 * e
        d = 1.0 + h / (1.0 + h) - e * (1.0 + e) / (1.0 + e * (1.0 + h)) + 1.0 / y
    elif ACT == GELU_TANH:
        v, dv = _tanh_2u(y, consts_ptr)
        d = _sigmoid(-v) * dv + 1.0 / y
    else:
        tl.static_assert(ACT == GELU, "an activation with a branch bit without a branch here")
        log_density = -0.5 * y * y - _const(consts_ptr, LOG_SQRT_2PI)
        d = tl.exp(log_density - tail) + 1.0 / y
    return d


@triton.jit
def _above_minimum(f, consts_ptr):
    """``f - z*`` with ``z*`` in two parts (exact near ``z*``)."""
    return (f - _const(consts_ptr, Z_HI)) - _const(consts_ptr, Z_LO)


@triton.jit
def _phi_above_minimum(y, ACT: tl.constexpr, consts_ptr, CHEB: tl.constexpr,
                       TAYLOR: tl.constexpr):
    """``(phi(y), phi(y) - z*)``, the latter from the Taylor series near ``y*`` when
    ``TAYLOR`` (float32)."""
    f = _branch_value(y, ACT, consts_ptr, CHEB)
    d = _above_minimum(f, consts_ptr)
    if TAYLOR:
        u = (y - _const(consts_ptr, Y_STAR)) - _const(consts_ptr, Y_LO)
        poly = tl.zeros_like(u) + tl.load(consts_ptr + TAYLOR_FIRST + 8)
        for i in tl.static_range(7, -1, -1):
            poly = poly * u + tl.load(consts_ptr + TAYLOR_FIRST + i)
        d = tl.where(tl.abs(u) <= 0.3, poly * u * u, d)
    return f, d


@triton.jit
def _log_ratio(f, d, log_f, consts_ptr):
    """``log(z* / f)`` for ``z* <= f < 0``: ``log1p(d / -f)`` near the minimum, where it is
    exact, ``log(-z*) - log(-f)`` in the tail."""
    ratio = d / -f
    tail = _const(consts_ptr, LOG_STAR) - log_f
    return tl.maximum(tl.where(ratio <= 1.0, _log1p(tl.where(ratio <= 1.0, ratio, 0.0)), tail),
                      0.0)


@triton.jit
def _invert(z, left, ACT: tl.constexpr, consts_ptr, NEWTON: tl.constexpr, CHEB: tl.constexpr,
            TAYLOR: tl.constexpr):
    """``y`` with ``phi(y) = z`` on the branch ``left`` (``y < y*``) names."""
    y_star = _const(consts_ptr, Y_STAR)
    z_star = _const(consts_ptr, Z_HI)
    slope_right = _const(consts_ptr, SLOPE_RIGHT)
    slope_left = _const(consts_ptr, SLOPE_LEFT)
    floor = _const(consts_ptr, FLOOR)
    tiny = _const(consts_ptr, TINY)
    # right branch: G(y) = sqrt(phi(y) - z*) = target_r
    target_r = tl.sqrt(tl.maximum(_above_minimum(z, consts_ptr), 0.0))
    y_r = tl.maximum(target_r / slope_right + y_star, z)
    # left branch: H(y) = sqrt(log(z* / phi(y))) = target_l
    z_left = tl.minimum(tl.maximum(z, z_star), -_const(consts_ptr, SMALLEST))
    target_l = tl.sqrt(_log_ratio(z_left, tl.maximum(_above_minimum(z_left, consts_ptr), 0.0),
                                  tl.log(-z_left), consts_ptr))
    y_l = y_star - target_l / slope_left
    # exponential tails (H^2 ~ -y): EXP_TAIL is 1, else 0 (y_l <= y* already)
    y_l = tl.minimum(y_l, y_star - _const(consts_ptr, EXP_TAIL) * target_l * target_l)
    for _ in tl.static_range(NEWTON):
        g = tl.sqrt(tl.maximum(_phi_above_minimum(y_r, ACT, consts_ptr, CHEB, TAYLOR)[1], 0.0))
        g_slope = _branch_derivative(y_r, ACT, consts_ptr, CHEB) / tl.maximum(2.0 * g, tiny)
        g_slope = tl.where(g > floor, g_slope, slope_right)
        y_r = tl.maximum(y_r - (g - target_r) / g_slope, y_star)
        f, d = _phi_above_minimum(y_l, ACT, consts_ptr, CHEB, TAYLOR)
        f = tl.minimum(f, -tiny)
        tail = _log_tail(y_l, ACT, consts_ptr, CHEB)
        h = tl.sqrt(_log_ratio(f, tl.maximum(d, 0.0), tl.log(-y_l) + tail, consts_ptr))
        h_slope = _log_neg_derivative(y_l, tail, ACT, consts_ptr) / tl.minimum(-2.0 * h, -tiny)
        h_slope = tl.where(h > floor, h_slope, -slope_left)
        y_l = tl.minimum(y_l - (h - target_l) / h_slope, y_star)
    return tl.where(left, y_l, y_r)


@triton.jit
def _branch_bit(bits_ptr, offsets, mask):
    """The saved bit ``y < y*`` of the elements at ``offsets`` (memory order, eight to a
    byte, lowest bit first)."""
    byte = tl.load(bits_ptr + (offsets >> 3), mask=mask, other=0).to(tl.int32)
    return ((byte >> (offsets & 7).to(tl.int32)) & 1) != 0


@triton.jit
def _recover_branch(z, dz, bits_ptr, offsets, mask, ACT: tl.constexpr, consts_ptr,
                    NEWTON: tl.constexpr, CHEB: tl.constexpr, TAYLOR: tl.constexpr):
    """``(y, dy)`` of SiLU or GELU from ``z``, ``dz`` and the branch bits."""
    y = _invert(z, _branch_bit(bits_ptr, offsets, mask), ACT, consts_ptr, NEWTON, CHEB, TAYLOR)
    return y, _branch_derivative(y, ACT, consts_ptr, CHEB) * dz


@triton.jit
def _recover_any(z, dz, offsets, mask, ACT: tl.constexpr, param, tiny, bits_ptr, consts_ptr,
                 BRANCH: tl.constexpr, NEWTON: tl.constexpr, CHEB: tl.constexpr,
                 TAYLOR: tl.constexpr):
    """``(y, dy)`` of any activation (``bits_ptr``, ``consts_ptr`` are read with ``BRANCH``
    only: the activations with a branch bit)."""
    if BRANCH:
        y, dy = _recover_branch(z, dz, bits_ptr, offsets, mask, ACT, consts_ptr, NEWTON, CHEB,
                                TAYLOR)
    else:
        y, dy = _recover(z, dz, ACT, param, tiny)
    return y, dy


@triton.jit
def _merge(count, mean, m2, tile_count, tile_mean, tile_m2):
    """Chan's parallel merge of two (count, mean, M2) summaries."""
    total = count + tile_count
    delta = tile_mean - mean
    share = tile_count / tl.maximum(total, 1.0)
    return total, mean + delta * share, m2 + tile_m2 + delta * delta * count * share


@triton.jit
def _tile_moments(x, mask, WHOLE: tl.constexpr):
    """``(count, mean, M2)`` in float64 of the masked values of a 2-D tile: per column, or of
    the whole tile when ``WHOLE``. Corrected two-pass (see the module docstring): the sums
    run in ``x``'s dtype, the correction ``r`` lifts the mean past that dtype's precision."""
    x = tl.where(mask, x, 0.0)
    if WHOLE:
        count = tl.sum(tl.sum(mask.to(x.dtype), axis=1), axis=0)
        mean = tl.sum(tl.sum(x, axis=1), axis=0) / tl.maximum(count, 1.0)
        centred = tl.where(mask, x - mean, 0.0)
        residual = tl.sum(tl.sum(centred, axis=1), axis=0)
        m2 = tl.sum(tl.sum(centred * centred, axis=1), axis=0)
    else:
        count = tl.sum(mask.to(x.dtype), axis=0)
        mean = tl.sum(x, axis=0) / tl.maximum(count, 1.0)
        centred = tl.where(mask, x - mean[None, :], 0.0)
        residual = tl.sum(centred, axis=0)
        m2 = tl.sum(centred * centred, axis=0)
    n = count.to(tl.float64)
    r = residual.to(tl.float64)
    correction = r / tl.maximum(n, 1.0)
    return n, mean.to(tl.float64) + correction, m2.to(tl.float64) - r * correction


# ---------------------------------------------------------------------------------------------
# Forward statistics: partial (count, mean, M2) per program and channel -> parts[3, P, C],
# float64.


@triton.jit
def moments_ncs_kernel(
    x_ptr, parts_ptr, N, C, S, tiles_per_program,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ACC: tl.constexpr,
):
    """Grid ``(C, P)``: program ``(c, p)`` summarises its share of channel ``c``'s tiles."""
    c = tl.program_id(0)
    p = tl.program_id(1)
    programs = tl.num_programs(1)
    s_blocks = tl.cdiv(S, BLOCK_S)
    tiles = tl.cdiv(N, BLOCK_N) * s_blocks
    count = tl.zeros([1], tl.float64)
    mean = tl.zeros([1], tl.float64)
    m2 = tl.zeros([1], tl.float64)
    start = p * tiles_per_program
    for t in range(start, tl.minimum(start + tiles_per_program, tiles)):
        n = (t // s_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        s = (t % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
        mask = (n < N)[:, None] & (s < S)[None, :]
        rows = n.to(tl.int64) * C + c
        x = tl.load(x_ptr + rows[:, None] * S + s[None, :], mask=mask, other=0.0).to(ACC)
        tile_count, tile_mean, tile_m2 = _tile_moments(x, mask, True)
        count, mean, m2 = _merge(count, mean, m2, tile_count, tile_mean, tile_m2)
    plane = programs * C
    out = parts_ptr + p * C + c + tl.arange(0, 1)
    tl.store(out, count)
    tl.store(out + plane, mean)
    tl.store(out + 2 * plane, m2)


_declare(moments_ncs_kernel, reads=("x_ptr",), writes=("parts_ptr",))


@triton.jit
def moments_mc_kernel(
    x_ptr, parts_ptr, R, C, rows_per_program,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):
    """Grid ``(cdiv(C, BLOCK_C), P)``: program ``(b, p)`` summarises rows
    ``[p * rows_per_program, ...)`` of channels ``[b * BLOCK_C, ...)``."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.program_id(1)
    programs = tl.num_programs(1)
    c_mask = c < C
    count = tl.zeros([BLOCK_C], tl.float64)
    mean = tl.zeros([BLOCK_C], tl.float64)
    m2 = tl.zeros([BLOCK_C], tl.float64)
    start = p * rows_per_program
    stop = tl.minimum(start + rows_per_program, R)
    for first in range(start, stop, BLOCK_R):
        r = first + tl.arange(0, BLOCK_R)
        mask = (r < stop)[:, None] & c_mask[None, :]
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * C + c[None, :], mask=mask, other=0.0)
        tile_count, tile_mean, tile_m2 = _tile_moments(x.to(ACC), mask, False)
        count, mean, m2 = _merge(count, mean, m2, tile_count, tile_mean, tile_m2)
    plane = programs * C
    out = parts_ptr + p * C + c
    tl.store(out, count, mask=c_mask)
    tl.store(out + plane, mean, mask=c_mask)
    tl.store(out + 2 * plane, m2, mask=c_mask)


_declare(moments_mc_kernel, reads=("x_ptr",), writes=("parts_ptr",))


@triton.jit
def finalize_forward_kernel(
    parts_ptr, programs, weight_ptr, bias_ptr, running_mean_ptr, running_var_ptr, invstd_ptr,
    scale_ptr, coeffs_ptr, C, momentum: tl.float64, eps: tl.float64,
    TRAINING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    UPDATE_RUNNING: tl.constexpr, GAMMA_ABS: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per channel, in float64: merge the float64 partials (training) or read the running
    statistics (eval); write ``invstd`` and ``g`` (saved for backward), the coefficients
    ``a = g * invstd`` and ``b = beta - mean * a`` of the normalisation (``coeffs[2, C]``, in
    ``ACC``; ``b`` is formed from the rounded ``a``, so that ``a * x + b`` is zero where ``x``
    is the mean), and update the running statistics as ``nn.BatchNorm`` does (unbiased
    variance)."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    if TRAINING:
        count = tl.zeros([BLOCK_C], tl.float64)
        mean = tl.zeros([BLOCK_C], tl.float64)
        m2 = tl.zeros([BLOCK_C], tl.float64)
        plane = programs * C
        for p in range(0, programs):
            part = parts_ptr + p * C + c
            count, mean, m2 = _merge(
                count, mean, m2,
                tl.load(part, mask=c_mask, other=0.0),
                tl.load(part + plane, mask=c_mask, other=0.0),
                tl.load(part + 2 * plane, mask=c_mask, other=0.0),
            )
        m2 = tl.maximum(m2, 0.0)
        var = m2 / tl.maximum(count, 1.0)
        if UPDATE_RUNNING:
            old_mean = tl.load(running_mean_ptr + c, mask=c_mask, other=0.0)
            old_var = tl.load(running_var_ptr + c, mask=c_mask, other=0.0)
            unbiased = m2 / tl.maximum(count - 1.0, 1.0)
            new_mean = old_mean.to(tl.float64) * (1.0 - momentum) + mean * momentum
            new_var = old_var.to(tl.float64) * (1.0 - momentum) + unbiased * momentum
            tl.store(running_mean_ptr + c, new_mean.to(old_mean.dtype), mask=c_mask)
            tl.store(running_var_ptr + c, new_var.to(old_var.dtype), mask=c_mask)
    else:
        mean = tl.load(running_mean_ptr + c, mask=c_mask, other=0.0).to(tl.float64)
        var = tl.load(running_var_ptr + c, mask=c_mask, other=1.0).to(tl.float64)
    invstd = 1.0 / tl.sqrt(var + eps)
    if HAS_WEIGHT:
        gamma = tl.load(weight_ptr + c, mask=c_mask, other=1.0).to(tl.float64)
        if GAMMA_ABS:
            g = tl.abs(gamma) + eps
        else:
            # sign(gamma) * max(|gamma|, eps), with sign(+0.0) = +1 and sign(-0.0) = -1
            negative = _negative(gamma)
            magnitude = tl.maximum(tl.abs(gamma), eps)
            g = tl.where(negative, -magnitude, magnitude)
    else:
        g = tl.full([BLOCK_C], 1.0, tl.float64)
    if HAS_BIAS:
        beta = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(tl.float64)
    else:
        beta = tl.zeros([BLOCK_C], tl.float64)
    a = (g * invstd).to(ACC)
    tl.store(invstd_ptr + c, invstd.to(invstd_ptr.dtype.element_ty), mask=c_mask)
    tl.store(scale_ptr + c, g.to(scale_ptr.dtype.element_ty), mask=c_mask)
    tl.store(coeffs_ptr + c, a, mask=c_mask)
    tl.store(coeffs_ptr + C + c, (beta - mean * a.to(tl.float64)).to(ACC), mask=c_mask)


_declare(
    finalize_forward_kernel,
    reads=("parts_ptr", "weight_ptr", "bias_ptr", "running_mean_ptr", "running_var_ptr"),
    writes=("running_mean_ptr", "running_var_ptr", "invstd_ptr", "scale_ptr", "coeffs_ptr"),
)


@triton.jit
def _elementwise_tile(pid, k_blocks, R, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``r``, columns ``k``, mask and offsets of tile ``pid`` of a 1-D grid over tiles."""
    r = (pid // k_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = (pid % k_blocks) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (r < R)[:, None] & (k < K)[None, :]
    offsets = r.to(tl.int64)[:, None] * K + k[None, :]
    return mask, offsets, r, k


@triton.jit
def _per_channel(ptr, r, k, R, K, C, CHANNEL_ON_ROWS: tl.constexpr):
    """A ``(C,)`` vector at ``ptr``, broadcastable against the tile of rows ``r``, columns
    ``k``."""
    if CHANNEL_ON_ROWS:
        values = tl.load(ptr + r % C, mask=r < R, other=0.0)[:, None]
    else:
        values = tl.load(ptr + k, mask=k < K, other=0.0)[None, :]
    return values


@triton.jit
def normalize_act_kernel(
    x_ptr, coeffs_ptr, R, K, C, k_blocks, param: tl.float64,
    CHANNEL_ON_ROWS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
):
    """In place: ``x = phi(a[c] * x + b[c])``. 1-D grid over ``(row block, column block)``."""
    param = tl.full((), param, ACC)  # a float64 argument, computed in ACC
    mask, offsets, r, k = _elementwise_tile(tl.program_id(0), k_blocks, R, K, BLOCK_R, BLOCK_K)
    a = _per_channel(coeffs_ptr, r, k, R, K, C, CHANNEL_ON_ROWS)
    b = _per_channel(coeffs_ptr + C, r, k, R, K, C, CHANNEL_ON_ROWS)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(ACC)
    z = _activate(x * a + b, ACT, param)
    tl.store(x_ptr + offsets, z.to(x_ptr.dtype.element_ty), mask=mask)


_declare(normalize_act_kernel, reads=("x_ptr", "coeffs_ptr"), writes=("x_ptr",))


@triton.jit
def normalize_branch_kernel(
    x_ptr, bits_ptr, coeffs_ptr, consts_ptr, numel, K, C,
    CHANNEL_ON_ROWS: tl.constexpr, ACT: tl.constexpr, CHEB: tl.constexpr,
    BLOCK_BYTES: tl.constexpr, ACC: tl.constexpr,
):
    """SiLU, GELU in place: ``x = phi(y)``, ``y = a[c] * x + b[c]``, and the bit ``y < y*`` of
    every element into ``bits`` (``ceil(numel / 8)`` bytes, eight elements of consecutive
    memory offsets to a byte, lowest bit first). A 1-D grid over blocks of ``BLOCK_BYTES``
    whole bytes, so that no byte is shared between programs; the channel of each element
    comes from its offset (``(o // K) % C`` on rows, ``o % C`` channels-last)."""
    byte = tl.program_id(0).to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    bit = tl.arange(0, 8)
    offsets = byte[:, None] * 8 + bit[None, :]
    mask = offsets < numel
    if CHANNEL_ON_ROWS:  # noqa: SIM108 (a compile-time branch of the kernel)
        c = (offsets // K) % C
    else:
        c = offsets % C
    a = tl.load(coeffs_ptr + c, mask=mask, other=0.0)
    b = tl.load(coeffs_ptr + C + c, mask=mask, other=0.0)
    y = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(ACC) * a + b
    z = _branch_value(y, ACT, consts_ptr, CHEB)
    tl.store(x_ptr + offsets, z.to(x_ptr.dtype.element_ty), mask=mask)
    left = mask & (y < _const(consts_ptr, Y_STAR))
    packed = tl.sum(tl.where(left, 1 << bit[None, :], 0), axis=1)
    tl.store(bits_ptr + byte, packed.to(tl.uint8), mask=byte * 8 < numel)


_declare(normalize_branch_kernel, reads=("x_ptr", "coeffs_ptr", "consts_ptr"),
         writes=("x_ptr", "bits_ptr"))


@triton.jit
def activation_grad_kernel(
    z_ptr, dz_ptr, dx_ptr, bits_ptr, consts_ptr, numel,
    ACT: tl.constexpr, NEWTON: tl.constexpr, CHEB: tl.constexpr, TAYLOR: tl.constexpr,
    ACC: tl.constexpr, BLOCK: tl.constexpr,
):
    """The backward of an activation with one minimum and no norm (:class:`iabn.InPlaceGELU`
    ...): ``dx = phi'(y) dz``, ``y`` recovered from ``z`` and its bit (``bits``: eight
    consecutive elements to a byte, lowest bit first, as torch packs them). ``z``, ``dz`` and
    ``dx`` are contiguous; a 1-D grid over blocks of ``BLOCK`` elements."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dz = tl.load(dz_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dx = _recover_branch(z, dz, bits_ptr, offsets, mask, ACT, consts_ptr, NEWTON, CHEB,
                         TAYLOR)[1]
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


_declare(activation_grad_kernel, reads=("z_ptr", "dz_ptr", "bits_ptr", "consts_ptr"),
         writes=("dx_ptr",))


# ---------------------------------------------------------------------------------------------
# Backward: partial sums (sum(dy), sum(dy * (y - beta))) -> parts[2, P, C], then
# dx = k1[c] * dy + k2[c] * y + k3[c].


@triton.jit
def _grad_tile(z_ptr, dz_ptr, offsets, mask, beta, ACT: tl.constexpr, param, tiny,
               bits_ptr, consts_ptr, BRANCH: tl.constexpr, NEWTON: tl.constexpr,
               CHEB: tl.constexpr, TAYLOR: tl.constexpr, ACC: tl.constexpr):
    """``(dy, dy * (y - beta))`` of one tile, zero where masked."""
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dz = tl.load(dz_ptr + offsets, mask=mask, other=0.0).to(ACC)
    y, dy = _recover_any(z, dz, offsets, mask, ACT, param, tiny, bits_ptr, consts_ptr, BRANCH,
                         NEWTON, CHEB, TAYLOR)
    # masked elements: z = dz = 0, so dy = phi'(y) * 0 = 0 for every activation
    return dy, tl.where(mask, dy * (y - beta), 0.0)


@triton.jit
def grad_sums_ncs_kernel(
    z_ptr, dz_ptr, bias_ptr, parts_ptr, N, C, S, tiles_per_program, param: tl.float64,
    tiny: tl.float64, bits_ptr, consts_ptr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BRANCH: tl.constexpr, NEWTON: tl.constexpr,
    CHEB: tl.constexpr, TAYLOR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(C, P)``, tiles as :func:`moments_ncs_kernel`."""
    param, tiny = tl.full((), param, ACC), tl.full((), tiny, ACC)  # float64 arguments, in ACC
    c = tl.program_id(0)
    p = tl.program_id(1)
    programs = tl.num_programs(1)
    beta = 0.0
    if HAS_BIAS:
        beta = tl.load(bias_ptr + c).to(ACC)
    s_blocks = tl.cdiv(S, BLOCK_S)
    tiles = tl.cdiv(N, BLOCK_N) * s_blocks
    sum_dy = tl.zeros([BLOCK_N, BLOCK_S], ACC)
    sum_dy_y = tl.zeros([BLOCK_N, BLOCK_S], ACC)
    start = p * tiles_per_program
    for t in range(start, tl.minimum(start + tiles_per_program, tiles)):
        n = (t // s_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        s = (t % s_blocks) * BLOCK_S + tl.arange(0, BLOCK_S)
        mask = (n < N)[:, None] & (s < S)[None, :]
        offsets = (n.to(tl.int64) * C + c)[:, None] * S + s[None, :]
        dy, dy_centred = _grad_tile(z_ptr, dz_ptr, offsets, mask, beta, ACT, param, tiny,
                                    bits_ptr, consts_ptr, BRANCH, NEWTON, CHEB, TAYLOR,
                                    ACC)
        sum_dy += dy
        sum_dy_y += dy_centred
    plane = programs * C
    out = parts_ptr + p * C + c + tl.arange(0, 1)
    tl.store(out, tl.sum(tl.sum(sum_dy, axis=1), axis=0))
    tl.store(out + plane, tl.sum(tl.sum(sum_dy_y, axis=1), axis=0))


_declare(grad_sums_ncs_kernel, reads=("z_ptr", "dz_ptr", "bias_ptr", "bits_ptr", "consts_ptr"),
         writes=("parts_ptr",))


@triton.jit
def grad_sums_mc_kernel(
    z_ptr, dz_ptr, bias_ptr, parts_ptr, R, C, rows_per_program, param: tl.float64,
    tiny: tl.float64, bits_ptr, consts_ptr,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BRANCH: tl.constexpr, NEWTON: tl.constexpr,
    CHEB: tl.constexpr, TAYLOR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Grid ``(cdiv(C, BLOCK_C), P)``, rows as :func:`moments_mc_kernel`."""
    param, tiny = tl.full((), param, ACC), tl.full((), tiny, ACC)  # float64 arguments, in ACC
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    p = tl.program_id(1)
    programs = tl.num_programs(1)
    c_mask = c < C
    if HAS_BIAS:
        beta = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(ACC)[None, :]
    else:
        beta = tl.zeros([1, BLOCK_C], ACC)
    sum_dy = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    sum_dy_y = tl.zeros([BLOCK_R, BLOCK_C], ACC)
    start = p * rows_per_program
    stop = tl.minimum(start + rows_per_program, R)
    for first in range(start, stop, BLOCK_R):
        r = first + tl.arange(0, BLOCK_R)
        mask = (r < stop)[:, None] & c_mask[None, :]
        offsets = r.to(tl.int64)[:, None] * C + c[None, :]
        dy, dy_centred = _grad_tile(z_ptr, dz_ptr, offsets, mask, beta, ACT, param, tiny,
                                    bits_ptr, consts_ptr, BRANCH, NEWTON, CHEB, TAYLOR,
                                    ACC)
        sum_dy += dy
        sum_dy_y += dy_centred
    plane = programs * C
    out = parts_ptr + p * C + c
    tl.store(out, tl.sum(sum_dy, axis=0), mask=c_mask)
    tl.store(out + plane, tl.sum(sum_dy_y, axis=0), mask=c_mask)


_declare(grad_sums_mc_kernel, reads=("z_ptr", "dz_ptr", "bias_ptr", "bits_ptr", "consts_ptr"),
         writes=("parts_ptr",))


@triton.jit
def finalize_backward_kernel(
    parts_ptr, programs, weight_ptr, bias_ptr, invstd_ptr, scale_ptr,
    dgamma_ptr, dbeta_ptr, coeffs_ptr, C, count: tl.float64,
    TRAINING: tl.constexpr, HAS_BIAS: tl.constexpr, WANT_DGAMMA: tl.constexpr,
    WANT_DBETA: tl.constexpr, GAMMA_ABS: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Per channel: sum the partials in order, ``dbeta = sum(dy)``,
    ``dg = sum(dy * (y - beta)) / g`` (= ``sum(dy * xhat)``), ``dgamma`` from ``dg``, and the
    coefficients ``k1, k2, k3`` of ``dx`` (``coeffs[3, C]``; docs/design.md, "The math"):
    training ``dx = g*invstd*(dy - (y - beta)/g * dg/m - dbeta/m)``, eval ``dx = g*invstd*dy``.
    """
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = c < C
    sum_dy = tl.zeros([BLOCK_C], ACC)
    sum_dy_y = tl.zeros([BLOCK_C], ACC)
    plane = programs * C
    for p in range(0, programs):
        sum_dy += tl.load(parts_ptr + p * C + c, mask=c_mask, other=0.0)
        sum_dy_y += tl.load(parts_ptr + plane + p * C + c, mask=c_mask, other=0.0)
    g = tl.load(scale_ptr + c, mask=c_mask, other=1.0).to(ACC)
    invstd = tl.load(invstd_ptr + c, mask=c_mask, other=0.0).to(ACC)
    dg = sum_dy_y / g
    if WANT_DGAMMA:
        dgamma = dg
        if GAMMA_ABS:
            gamma = tl.load(weight_ptr + c, mask=c_mask, other=0.0).to(ACC)
            dgamma = tl.where(gamma < 0, -dg, dg)  # +dg at 0, as scale.gamma_grad
        tl.store(dgamma_ptr + c, dgamma.to(dgamma_ptr.dtype.element_ty), mask=c_mask)
    if WANT_DBETA:
        tl.store(dbeta_ptr + c, sum_dy.to(dbeta_ptr.dtype.element_ty), mask=c_mask)
    k1 = g * invstd
    if TRAINING:
        if HAS_BIAS:
            beta = tl.load(bias_ptr + c, mask=c_mask, other=0.0).to(ACC)
        else:
            beta = tl.zeros([BLOCK_C], ACC)
        k2 = -invstd * dg / count
        k3 = invstd * (beta * dg - g * sum_dy) / count
    else:
        k2 = tl.zeros([BLOCK_C], ACC)
        k3 = tl.zeros([BLOCK_C], ACC)
    tl.store(coeffs_ptr + c, k1, mask=c_mask)
    tl.store(coeffs_ptr + C + c, k2, mask=c_mask)
    tl.store(coeffs_ptr + 2 * C + c, k3, mask=c_mask)


_declare(
    finalize_backward_kernel,
    reads=("parts_ptr", "weight_ptr", "bias_ptr", "invstd_ptr", "scale_ptr"),
    writes=("dgamma_ptr", "dbeta_ptr", "coeffs_ptr"),
)


@triton.jit
def input_grad_kernel(
    z_ptr, dz_ptr, dx_ptr, coeffs_ptr, R, K, C, k_blocks, param: tl.float64, tiny: tl.float64,
    bits_ptr, consts_ptr,
    CHANNEL_ON_ROWS: tl.constexpr, ACT: tl.constexpr, BRANCH: tl.constexpr,
    NEWTON: tl.constexpr,
    CHEB: tl.constexpr, TAYLOR: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
):
    """``dx = k1[c] * dy + k2[c] * y + k3[c]`` with ``y, dy`` recovered from ``z, dz``.
    Grid as :func:`normalize_act_kernel`; ``dx`` is a separate buffer (never ``dz``)."""
    param, tiny = tl.full((), param, ACC), tl.full((), tiny, ACC)  # float64 arguments, in ACC
    mask, offsets, r, k = _elementwise_tile(tl.program_id(0), k_blocks, R, K, BLOCK_R, BLOCK_K)
    k1 = _per_channel(coeffs_ptr, r, k, R, K, C, CHANNEL_ON_ROWS)
    k2 = _per_channel(coeffs_ptr + C, r, k, R, K, C, CHANNEL_ON_ROWS)
    k3 = _per_channel(coeffs_ptr + 2 * C, r, k, R, K, C, CHANNEL_ON_ROWS)
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dz = tl.load(dz_ptr + offsets, mask=mask, other=0.0).to(ACC)
    y, dy = _recover_any(z, dz, offsets, mask, ACT, param, tiny, bits_ptr, consts_ptr, BRANCH,
                         NEWTON, CHEB, TAYLOR)
    dx = k1 * dy + k2 * y + k3
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


_declare(input_grad_kernel, reads=("z_ptr", "dz_ptr", "coeffs_ptr", "bits_ptr", "consts_ptr"),
         writes=("dx_ptr",))


# --- the output-only layer and RMS norms' backward (docs/design.md, "Output-only layer norm") ---


@triton.jit
def row_norm_grad_kernel(
    y_ptr, dy_ptr, dx_ptr, rstd_ptr, weight_ptr, bias_ptr, parts_ptr, M, D, rows_per_program,
    LAYER: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    WANT_DX: tl.constexpr, WANT_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    """One pass over the rows of a layer or RMS norm's output ``y`` ``(M, D)`` (row-major) and
    its gradient: ``xhat = (y - b) / w`` rebuilt in registers, ``dxhat = w * dy``,

        layer norm: ``dx = rstd * (dxhat - mean_D(dxhat) - xhat * mean_D(dxhat * xhat))``
        RMS norm:   ``dx = rstd * (dxhat - xhat * mean_D(dxhat * xhat))``

    written to ``dx`` (never into ``dy``), and this program's column sums ``sum(dy * xhat)``
    and ``sum(dy)`` over its rows to ``parts[0, p, :]`` and ``parts[1, p, :]`` (the weight and
    bias gradients once summed over the programs). A whole row is one tile (``BLOCK_D >=
    D``); each program takes ``rows_per_program`` consecutive rows, ``BLOCK_M`` at a time. Only
    for features whose ``xhat`` is rebuilt (no kept columns: the launcher checks)."""
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    c_mask = cols < D
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=c_mask, other=1.0).to(ACC)[None, :]
    else:
        w = tl.full([1, BLOCK_D], 1.0, ACC)
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(ACC)[None, :]
    else:
        b = tl.zeros([1, BLOCK_D], ACC)
    sum_dy = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    sum_dy_xhat = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    start = p * rows_per_program
    stop = tl.minimum(start + rows_per_program, M)
    for first in range(start, stop, BLOCK_M):
        r = first + tl.arange(0, BLOCK_M)
        r_mask = r < stop
        mask = r_mask[:, None] & c_mask[None, :]
        offsets = r.to(tl.int64)[:, None] * D + cols[None, :]
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(ACC)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(ACC)
        xhat = (y - b) / w  # 0 outside the tile's rows and columns (y = b = 0, w = 1)
        if WANT_DX:
            rstd = tl.load(rstd_ptr + r, mask=r_mask, other=0.0).to(ACC)[:, None]
            dxhat = dy * w
            dot = (tl.sum(dxhat * xhat, axis=1) / D)[:, None]
            centred = dxhat - (tl.sum(dxhat, axis=1) / D)[:, None] if LAYER else dxhat
            dx = rstd * (centred - xhat * dot)
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if WANT_SUMS:
            sum_dy += dy
            sum_dy_xhat += dy * xhat
    if WANT_SUMS:
        out = parts_ptr + p * D + cols
        tl.store(out, tl.sum(sum_dy_xhat, axis=0), mask=c_mask)
        tl.store(out + programs * D, tl.sum(sum_dy, axis=0), mask=c_mask)


_declare(row_norm_grad_kernel,
         reads=("y_ptr", "dy_ptr", "rstd_ptr", "weight_ptr", "bias_ptr"),
         writes=("dx_ptr", "parts_ptr"))
