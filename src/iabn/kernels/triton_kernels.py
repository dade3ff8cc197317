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

#: Activation codes (``constexpr`` arguments).
IDENTITY, LEAKY_RELU, ELU = 0, 1, 2


class Traffic(NamedTuple):
    """The pointer arguments a kernel loads from (``reads``) and stores to (``writes``), by
    name. :mod:`iabn.traffic` counts each launch's bytes from them; every kernel declares its
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
    if ACT == 1:
        y = tl.where(y >= 0, y, y * param)
    elif ACT == 2:
        # exp of the clamped value: the positive branch is discarded, and must not overflow.
        y = tl.where(y >= 0, y, param * (tl.exp(tl.minimum(y, 0.0)) - 1.0))
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
    if ACT == 1:
        negative = _negative(z)
        y = tl.where(negative, z / param, z)
        dy = tl.where(negative, dz * param, dz)
    elif ACT == 2:
        # log(1 + z/alpha), kept finite where exp underflowed in forward (z == -alpha); the
        # gradient there, dz * (z + alpha), is 0, so the clamp changes no gradient.
        negative = _negative(z)
        ratio = tl.maximum(tl.minimum(z, 0.0) / param, -1.0 + tiny)
        y = tl.where(negative, tl.log(1.0 + ratio), z)
        dy = tl.where(negative, dz * (z + param), dz)
    else:
        y = z
        dy = dz
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
    scale_ptr, coeffs_ptr, C, momentum, eps,
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
    x_ptr, coeffs_ptr, R, K, C, k_blocks, param,
    CHANNEL_ON_ROWS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
):
    """In place: ``x = phi(a[c] * x + b[c])``. 1-D grid over ``(row block, column block)``."""
    mask, offsets, r, k = _elementwise_tile(tl.program_id(0), k_blocks, R, K, BLOCK_R, BLOCK_K)
    a = _per_channel(coeffs_ptr, r, k, R, K, C, CHANNEL_ON_ROWS)
    b = _per_channel(coeffs_ptr + C, r, k, R, K, C, CHANNEL_ON_ROWS)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(ACC)
    z = _activate(x * a + b, ACT, param)
    tl.store(x_ptr + offsets, z.to(x_ptr.dtype.element_ty), mask=mask)


_declare(normalize_act_kernel, reads=("x_ptr", "coeffs_ptr"), writes=("x_ptr",))


# ---------------------------------------------------------------------------------------------
# Backward: partial sums (sum(dy), sum(dy * (y - beta))) -> parts[2, P, C], then
# dx = k1[c] * dy + k2[c] * y + k3[c].


@triton.jit
def _grad_tile(z_ptr, dz_ptr, offsets, mask, beta, ACT: tl.constexpr, param, tiny,
               ACC: tl.constexpr):
    """``(dy, dy * (y - beta))`` of one tile, zero where masked."""
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dz = tl.load(dz_ptr + offsets, mask=mask, other=0.0).to(ACC)
    y, dy = _recover(z, dz, ACT, param, tiny)
    return dy, tl.where(mask, dy * (y - beta), 0.0)


@triton.jit
def grad_sums_ncs_kernel(
    z_ptr, dz_ptr, bias_ptr, parts_ptr, N, C, S, tiles_per_program, param, tiny,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, ACC: tl.constexpr,
):
    """Grid ``(C, P)``, tiles as :func:`moments_ncs_kernel`."""
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
        dy, dy_centred = _grad_tile(z_ptr, dz_ptr, offsets, mask, beta, ACT, param, tiny, ACC)
        sum_dy += dy
        sum_dy_y += dy_centred
    plane = programs * C
    out = parts_ptr + p * C + c + tl.arange(0, 1)
    tl.store(out, tl.sum(tl.sum(sum_dy, axis=1), axis=0))
    tl.store(out + plane, tl.sum(tl.sum(sum_dy_y, axis=1), axis=0))


_declare(grad_sums_ncs_kernel, reads=("z_ptr", "dz_ptr", "bias_ptr"),
         writes=("parts_ptr",))


@triton.jit
def grad_sums_mc_kernel(
    z_ptr, dz_ptr, bias_ptr, parts_ptr, R, C, rows_per_program, param, tiny,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):
    """Grid ``(cdiv(C, BLOCK_C), P)``, rows as :func:`moments_mc_kernel`."""
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
        dy, dy_centred = _grad_tile(z_ptr, dz_ptr, offsets, mask, beta, ACT, param, tiny, ACC)
        sum_dy += dy
        sum_dy_y += dy_centred
    plane = programs * C
    out = parts_ptr + p * C + c
    tl.store(out, tl.sum(sum_dy, axis=0), mask=c_mask)
    tl.store(out + plane, tl.sum(sum_dy_y, axis=0), mask=c_mask)


_declare(grad_sums_mc_kernel, reads=("z_ptr", "dz_ptr", "bias_ptr"),
         writes=("parts_ptr",))


@triton.jit
def finalize_backward_kernel(
    parts_ptr, programs, weight_ptr, bias_ptr, invstd_ptr, scale_ptr,
    dgamma_ptr, dbeta_ptr, coeffs_ptr, C, count,
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
    z_ptr, dz_ptr, dx_ptr, coeffs_ptr, R, K, C, k_blocks, param, tiny,
    CHANNEL_ON_ROWS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
):
    """``dx = k1[c] * dy + k2[c] * y + k3[c]`` with ``y, dy`` recovered from ``z, dz``.
    Grid as :func:`normalize_act_kernel`; ``dx`` is a separate buffer (never ``dz``)."""
    mask, offsets, r, k = _elementwise_tile(tl.program_id(0), k_blocks, R, K, BLOCK_R, BLOCK_K)
    k1 = _per_channel(coeffs_ptr, r, k, R, K, C, CHANNEL_ON_ROWS)
    k2 = _per_channel(coeffs_ptr + C, r, k, R, K, C, CHANNEL_ON_ROWS)
    k3 = _per_channel(coeffs_ptr + 2 * C, r, k, R, K, C, CHANNEL_ON_ROWS)
    z = tl.load(z_ptr + offsets, mask=mask, other=0.0).to(ACC)
    dz = tl.load(dz_ptr + offsets, mask=mask, other=0.0).to(ACC)
    y, dy = _recover(z, dz, ACT, param, tiny)
    dx = k1 * dy + k2 * y + k3
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


_declare(input_grad_kernel, reads=("z_ptr", "dz_ptr", "coeffs_ptr"),
         writes=("dx_ptr",))
