"""The loops of :mod:`.cpu_loops`, compiled by Numba (imported only where Numba is
installed, on first use). Module-level functions, so that Numba's on-disk cache finds them
again in the next process (a closure's cache key changes with every process: each one
compiled anew, about 2 s, and added a file). Everything a loop computes is written as
selections (``a if c else b`` of values already formed): LLVM then vectorises it.

Compiler options: ``fastmath`` limited to :data:`FAST_MATH`; ``error_model="numpy"``: a
division by zero gives inf, not a check that stops the vectoriser; ``nogil``: the threads of
:func:`.cpu_loops._run` run at once; ``cache``: compiled once per machine.
"""

import math

import numba
import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros  # LLVM's cttz (no public name)

#: LLVM's fast-math flags the loops allow: fused multiply-adds, no NaN, infinity or signed
#: zero cases (their inputs are clamped finite). Not reassociation: it would fold the two parts
#: of ``z*`` back into one (``(z - z*_hi) - z*_lo`` to ``z - (z*_hi + z*_lo)``; 2e-5 of error
#: in the slopes near the minimum, measured), nor approximate reciprocals.
FAST_MATH = {"contract", "nnan", "ninf", "nsz"}

OPTIONS = {"fastmath": FAST_MATH, "error_model": "numpy", "nogil": True, "cache": True}
jit = numba.njit(**OPTIONS)
f32 = np.float32


#: Elements per chunk of the loops that unpack the bits: a chunk's mask (4 KiB) and slices
#: stay in a core's cache.
CHUNK = 4096
#: Byte ``b`` of the bits as eight 0/1 bytes, one ``uint64`` (little-endian: element ``j`` of
#: the byte is byte ``j`` of the word). A module-level array: Numba compiles it in.
BYTE_MASKS = np.array([sum(((b >> j) & 1) << (8 * j) for j in range(8)) for b in range(256)],
                      dtype=np.uint64)


@numba.njit(**OPTIONS, inline="always")
def unpack_chunk(bits, a, count, mask):
    """``mask[i] = 1`` where element ``a + i`` of the packed ``bits`` is set, for ``i <
    count`` (``a`` a multiple of 8), eight elements per table lookup."""
    words = mask.view(np.uint64)
    for k in range((count + 7) // 8):
        words[k] = BYTE_MASKS[bits[a // 8 + k]]


@numba.njit(**OPTIONS, inline="always")
def bit_word(bits, w):
    """Bytes ``8 w .. 8 w + 7`` of the packed ``bits`` as one ``uint64``: element ``64 w + j``
    is bit ``j``. Assembled byte by byte: a range's bits need not start on a word."""
    word = np.uint64(0)
    for b in range(8):
        word |= np.uint64(bits[8 * w + b]) << np.uint64(8 * b)
    return word


@numba.njit(**OPTIONS, inline="always")
def count_set(bits, a, end):
    """How many of elements ``a .. end - 1`` (``a`` a multiple of 64) have their bit set: a
    word's population count in a few shifts and masks (LLVM makes them one instruction)."""
    k = np.int64(0)
    for w in range(a // 64, end // 64):
        x = bit_word(bits, w)
        x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
        x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2))
                                                   & np.uint64(0x3333333333333333))
        x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
        k += np.int64((x * np.uint64(0x0101010101010101)) >> np.uint64(56))
    for p in range(max(end // 64 * 64, a), end):
        k += np.int64((bits[p // 8] >> (p % 8)) & 1)
    return k


@numba.njit(**OPTIONS, inline="always")
def gather_set(bits, a, end, z, dz, index, zb, dzb):
    """For each element ``p`` of ``a .. end - 1`` (``a`` a multiple of 64) whose bit is set, in
    order: ``index[k] = p - a``, ``zb[k] = z[p - a]``, ``dzb[k] = dz[p - a]`` (``z``, ``dz``
    the chunk's); returns ``k``. One step per set bit (its word's lowest set bit cleared each
    time), none for a word without one."""
    k = 0
    for w in range(a // 64, end // 64):
        word = bit_word(bits, w)
        base = w * 64 - a
        while word != 0:
            p = base + np.int64(trailing_zeros(word))
            index[k] = p
            zb[k] = z[p]
            dzb[k] = dz[p]
            k += 1
            word &= word - np.uint64(1)
    for p in range(max(end // 64 * 64, a), end):
        if (bits[p // 8] >> (p % 8)) & 1:
            index[k] = p - a
            zb[k] = z[p - a]
            dzb[k] = dz[p - a]
            k += 1
    return k


@numba.njit(**OPTIONS, inline="always")
def slope(z, left, cl, cn, cf, maps):
    """``phi'(y)`` at the output ``z`` on the branch ``left`` names (float32)."""
    (scale_left, scale_near, scale_far, shift_far, edge, s_max, z_hi, z_lo, log_star,
     f_edge) = maps
    one, two = f32(1.0), f32(2.0)
    # right branch: s = sqrt(z - z*); left: v = sqrt(log(z* / z))
    d = (z - z_hi) - z_lo
    zl = min(max(z, z_hi), f32(-1.1754944e-38))
    dl = max((zl - z_hi) - z_lo, f32(0.0))
    near_log = dl <= -zl  # u = dl / -zl <= 1
    bits = np.float32(-zl).view(np.int32)
    m = np.int32((bits & 0x7FFFFF) | 0x3F800000).view(np.float32)
    e = f32((bits >> 23) - 127)
    big = m > f32(1.4142135)
    m = f32(0.5) * m if big else m
    e = e + one if big else e
    s = (dl if near_log else m - one) / (dl - two * zl if near_log else m + one)
    s2 = s * s
    p = f32(1 / 13)
    p = p * s2 + f32(1 / 11)
    p = p * s2 + f32(1 / 9)
    p = p * s2 + f32(1 / 7)
    p = p * s2 + f32(1 / 5)
    p = p * s2 + f32(1 / 3)
    p = p * s2 + one
    atanh2 = two * s * p
    log_ratio = atanh2 if near_log else log_star - (atanh2 + e * f32(0.6931471805599453))
    r = math.sqrt(max(log_ratio if left else d, f32(0.0)))
    near = r <= edge
    scale = scale_left if left else (scale_near if near else scale_far)
    shift = -one if (left or near) else shift_far
    t = min(max(r * scale + shift, -one), one)
    # Horner with constant indices (a loop over k indexes the tuples in memory, which
    # stops the vectoriser); the left branch its own (degree 12), the right branch's
    # two pieces one, their coefficients chosen per element
    g = cl[12]
    g = g * t + cl[11]
    g = g * t + cl[10]
    g = g * t + cl[9]
    g = g * t + cl[8]
    g = g * t + cl[7]
    g = g * t + cl[6]
    g = g * t + cl[5]
    g = g * t + cl[4]
    g = g * t + cl[3]
    g = g * t + cl[2]
    g = g * t + cl[1]
    g = g * t + cl[0]
    h = cn[16] if near else cf[16]
    h = h * t + (cn[15] if near else cf[15])
    h = h * t + (cn[14] if near else cf[14])
    h = h * t + (cn[13] if near else cf[13])
    h = h * t + (cn[12] if near else cf[12])
    h = h * t + (cn[11] if near else cf[11])
    h = h * t + (cn[10] if near else cf[10])
    h = h * t + (cn[9] if near else cf[9])
    h = h * t + (cn[8] if near else cf[8])
    h = h * t + (cn[7] if near else cf[7])
    h = h * t + (cn[6] if near else cf[6])
    h = h * t + (cn[5] if near else cf[5])
    h = h * t + (cn[4] if near else cf[4])
    h = h * t + (cn[3] if near else cf[3])
    h = h * t + (cn[2] if near else cf[2])
    h = h * t + (cn[1] if near else cf[1])
    h = h * t + (cn[0] if near else cf[0])
    h = f_edge + (r * scale_near - two) * h if near else h
    return g * zl if left else h * min(r, s_max)


@jit
def backward(z, dz, bits, out, cl, cn, cf, maps, split):
    """``out = phi'(y) dz`` of 1-d ``z`` (float32), ``dz`` and the packed ``bits``, with
    :func:`slope`'s constants. A chunk whose left-branch elements are at most ``split`` of it
    runs the right branch's vector loop over all its elements, then the left branch's over
    its left elements alone, gathered into a buffer and scattered back (the left branch costs
    about twice the right: its logarithm, division and square root); any other chunk forms
    both branches on every element and keeps one, by its bits unpacked to a mask."""
    mask = np.empty(CHUNK, np.uint8)
    index = np.empty(CHUNK, np.int64)
    zb = np.empty(CHUNK, np.float32)
    gb = np.empty(CHUNK, np.float32)  # the left elements' dz, then their gradients
    n = z.shape[0]
    for a in range(0, n, CHUNK):
        count = min(CHUNK, n - a)
        # the chunk's slices indexed from 0: with a + i the index may look negative to
        # LLVM (Numba wraps negative indices), which made every access a gather
        zc, dzc, oc = z[a:a + count], dz[a:a + count], out[a:a + count]
        if count_set(bits, a, a + count) > split * count:
            unpack_chunk(bits, a, count, mask)
            for i in range(count):
                oc[i] = slope(zc[i], mask[i] != 0, cl, cn, cf, maps) * dzc[i]
            continue
        for i in range(count):
            oc[i] = slope(zc[i], False, cl, cn, cf, maps) * dzc[i]
        k = gather_set(bits, a, a + count, zc, dzc, index, zb, gb)
        for j in range(k):
            gb[j] = slope(zb[j], True, cl, cn, cf, maps) * gb[j]
        for j in range(k):
            oc[index[j]] = gb[j]


@jit
def pack_below(x, y_star, bits):
    """Bit ``j`` of byte ``k``: ``x[8 k + j] < y_star`` (``branch.pack_bits``' order), the
    last byte padded with zeros. A chunk's comparisons as 0/1 bytes first (a vector loop),
    then each eight of them, one ``uint64``, to one byte by a multiply: ``0x0102040810204080``
    moves bit ``8 j`` to bit ``56 + j`` (no carries: each sum of shifted bits has distinct
    positions). 0.13 ms at 8x197x1536 float32, one thread, where eight shifts a byte took
    0.8-1.2 ms."""
    mask = np.empty(CHUNK, np.uint8)
    words = mask.view(np.uint64)
    magic = np.uint64(0x0102040810204080)
    n = x.shape[0]
    for a in range(0, n, CHUNK):
        count = min(CHUNK, n - a)
        xc = x[a:a + count]
        for i in range(count):
            mask[i] = np.uint8(1) if xc[i] < y_star else np.uint8(0)
        for i in range(count, (count + 7) // 8 * 8):  # the last byte's padding
            mask[i] = np.uint8(0)
        bc = bits[a // 8:(a + count + 7) // 8]
        for k in range(bc.shape[0]):
            bc[k] = np.uint8((words[k] * magic) >> np.uint64(56))


# ------------------------------------------------------------ the fitted inverses (float64)


@numba.njit(**OPTIONS, inline="always")
def horner17(t, c):
    """``sum_k c[k] t^k``, ``k = 0 .. 16`` (constant indices: the vectoriser needs them)."""
    h = c[16]
    h = h * t + c[15]
    h = h * t + c[14]
    h = h * t + c[13]
    h = h * t + c[12]
    h = h * t + c[11]
    h = h * t + c[10]
    h = h * t + c[9]
    h = h * t + c[8]
    h = h * t + c[7]
    h = h * t + c[6]
    h = h * t + c[5]
    h = h * t + c[4]
    h = h * t + c[3]
    h = h * t + c[2]
    h = h * t + c[1]
    h = h * t + c[0]
    return h


@numba.njit(**OPTIONS, inline="always")
def three_pieces(x, c0, c1, c2, maps):
    """``fitted_inverse``'s sum of three pieces at ``x``; ``maps``: each piece's ``t = x scale
    + shift`` as ``(scale_0, shift_0, scale_1, shift_1, scale_2, shift_2)``."""
    one = 1.0
    t = min(max(x * maps[0] + maps[1], -one), one)
    total = horner17(t, c0)
    t = min(max(x * maps[2] + maps[3], -one), one)
    total += (t + one) * horner17(t, c1)
    t = min(max(x * maps[4] + maps[5], -one), one)
    return total + (t + one) * horner17(t, c2)


@numba.njit(**OPTIONS, inline="always")
def log_ratio64(z, z_star, log_star):
    """``log(z* / z)`` for ``z* <= z < 0`` in float64, as the float32 slope's: ``2 atanh(s)``
    with ``s = d / (d - 2 z)``, ``d = z - z*``, where ``d <= -z`` (exact near the minimum),
    else ``log(-z*) - log(-z)`` with ``log(-z)`` from the exponent and mantissa of ``-z``;
    the series to ``s^32 / 33`` (its first omitted term: 2e-17 of the logarithm)."""
    one, two = 1.0, 2.0
    d = max(z - z_star, 0.0)
    near = d <= -z
    bits = np.float64(-z).view(np.int64)
    m = np.int64((bits & 0xFFFFFFFFFFFFF) | 0x3FF0000000000000).view(np.float64)
    e = np.float64((bits >> 52) - 1023)
    big = m > 1.4142135623730951
    m = 0.5 * m if big else m
    e = e + one if big else e
    s = (d if near else m - one) / (d - two * z if near else m + one)
    s2 = s * s
    p = 1.0 / 33.0
    p = p * s2 + 1.0 / 31.0
    p = p * s2 + 1.0 / 29.0
    p = p * s2 + 1.0 / 27.0
    p = p * s2 + 1.0 / 25.0
    p = p * s2 + 1.0 / 23.0
    p = p * s2 + 1.0 / 21.0
    p = p * s2 + 1.0 / 19.0
    p = p * s2 + 1.0 / 17.0
    p = p * s2 + 1.0 / 15.0
    p = p * s2 + 1.0 / 13.0
    p = p * s2 + 1.0 / 11.0
    p = p * s2 + 1.0 / 9.0
    p = p * s2 + 1.0 / 7.0
    p = p * s2 + 1.0 / 5.0
    p = p * s2 + 1.0 / 3.0
    p = p * s2 + 1.0
    atanh2 = two * s * p
    return atanh2 if near else log_star - (atanh2 + e * 0.6931471805599453)


@numba.njit(**OPTIONS, inline="always")
def right_inverse(z, right, z_star):
    """The right branch's fitted inverse at the float32 output ``z``, in float64."""
    c0, c1, c2, maps = right
    z64 = np.float64(z)
    return z64 + three_pieces(math.sqrt(max(z64 - z_star, 0.0)), c0, c1, c2, maps)


@numba.njit(**OPTIONS, inline="always")
def left_inverse(z, left, z_star, log_star, smallest):
    """The left branch's fitted inverse at ``z``, in float64; an output of 0 is taken as
    ``-smallest`` (``branch.invert``'s rule)."""
    c0, c1, c2, maps = left
    zl = min(max(np.float64(z), z_star), -smallest)
    return three_pieces(math.sqrt(max(log_ratio64(zl, z_star, log_star), 0.0)), c0, c1, c2,
                        maps)


@jit
def invert_and_slope(z, dz, bits, y, dy, cl, cn, cf, maps, right, left, z_star, log_star,
                     smallest, split):
    """``y`` (the fitted inverse, evaluated in float64, rounded to ``y``'s dtype) and
    ``dy = phi'(y) dz`` (the fitted slope, float32) of 1-d ``z`` (float32) and the packed
    ``bits``: the batch-norm layers' recovery in one pass; with ``dz`` and ``dy`` None, ``y``
    alone (Numba prunes the slope's lines where they are None: compiled apart). ``right``,
    ``left``: each branch's three pieces' coefficients and maps (:func:`three_pieces`). The
    chunks are cut between the branches as :func:`backward`'s, by ``split`` (here the left
    branch's float64 inverse costs twice the right's: 7.9 against 3.9 ms over 8x64x56x56
    elements, one thread; its logarithm's series has 17 terms)."""
    mask = np.empty(CHUNK, np.uint8)
    index = np.empty(CHUNK, np.int64)
    zb = np.empty(CHUNK, np.float32)
    yb = np.empty(CHUNK, np.float32)
    gb = np.empty(CHUNK, np.float32)  # the left elements' dz, then their dy
    n = z.shape[0]
    for a in range(0, n, CHUNK):
        count = min(CHUNK, n - a)
        zc, yc = z[a:a + count], y[a:a + count]
        # without a slope, z stands in for dz (gathered beside z, not read)
        dzc = zc if dz is None else dz[a:a + count]
        if dy is not None:
            dyc = dy[a:a + count]
        if count_set(bits, a, a + count) > split * count:
            unpack_chunk(bits, a, count, mask)
            for i in range(count):
                zi = zc[i]
                on_left = mask[i] != 0
                if dy is not None:
                    dyc[i] = slope(zi, on_left, cl, cn, cf, maps) * dzc[i]
                y_left = left_inverse(zi, left, z_star, log_star, smallest)
                y_right = right_inverse(zi, right, z_star)
                yc[i] = y_left if on_left else y_right
            continue
        for i in range(count):
            zi = zc[i]
            if dy is not None:
                dyc[i] = slope(zi, False, cl, cn, cf, maps) * dzc[i]
            yc[i] = right_inverse(zi, right, z_star)
        k = gather_set(bits, a, a + count, zc, dzc, index, zb, gb)
        for j in range(k):
            yb[j] = left_inverse(zb[j], left, z_star, log_star, smallest)
            if dy is not None:
                gb[j] = slope(zb[j], True, cl, cn, cf, maps) * gb[j]
        for j in range(k):
            p = index[j]
            yc[p] = yb[j]
            if dy is not None:
                dyc[p] = gb[j]


#: The row norms' loop also sums (a row's two means, the weight and bias gradients), which LLVM
#: vectorises only where it may reorder the additions: the flags above plus reassociation
#: (the loop has no split constant for it to fold).
SUM_OPTIONS = {**OPTIONS, "fastmath": FAST_MATH | {"reassoc"}}


@numba.njit(**SUM_OPTIONS)
def row_norm_backward(y, dz, w, shift, rstd, layer, dx, dw, db):
    """The output-only row norm's backward for rows ``y`` and ``dz`` (``(m, D)`` float32):
    ``xhat = y / w + shift`` (``shift = -b / w``), ``dxhat = w dz``; per row
    ``dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat))`` (layer norm; an RMS norm,
    ``layer`` false, subtracts no ``mean(dxhat)``), written to ``dx``; ``dw += sum dz xhat``
    and ``db += sum dz`` over the rows (float64 ``(D,)``). Each row is read from memory once:
    its second sweep finds it in cache."""
    m, d = y.shape
    for i in range(m):
        yi, dzi, dxi = y[i], dz[i], dx[i]
        s1 = f32(0.0)
        s2 = f32(0.0)
        for j in range(d):
            xhat = yi[j] / w[j] + shift[j]
            g = dzi[j] * w[j]
            s1 += g
            s2 += g * xhat
            dw[j] += np.float64(dzi[j] * xhat)
            db[j] += np.float64(dzi[j])
        mean1 = s1 / f32(d) if layer else f32(0.0)
        mean2 = s2 / f32(d)
        r = rstd[i]
        for j in range(d):
            xhat = yi[j] / w[j] + shift[j]
            dxi[j] = r * (dzi[j] * w[j] - mean1 - xhat * mean2)
