"""The activations' backward ``dx = phi'(y) dz`` on a CPU with AVX-512, 16 lanes at a time,
from the slope tables of :mod:`.slope_cells` (imported only where Numba is installed, on
first use, by :mod:`.cpu_loops`).

Why written as vector code: the scalar loop of :mod:`.numba_loops` evaluates polynomials of
degree 16 with their coefficients chosen per element, and the left branch's logarithm on
gathered elements; LLVM vectorises it, but it costs about 60 operations an element
(2.5-5.5 ms at 8x197x1536 float32 against 0.8-1.4 ms for torch's SiLU and GELU backward, one
thread). With one table of 32 cells of degree 7 for both branches, each coefficient of an
element's cell is one ``vpermi2ps`` from two registers holding the 32 cells' values, so both
branches cost a few operations an element, with no choice of pieces, no logarithm and no
gathering; the branch bits of 16 elements are one 16-bit mask. LLVM's loop vectoriser makes a
gather of a table lookup (measured: 1.1-1.4 ns an element for two lookups), so the loop is
written here as LLVM IR on ``<16 x float>`` (a Numba intrinsic); there is no portable form of a
variable permute in Numba. Where the CPU has no AVX-512 (:func:`supported`)
:mod:`.numba_loops` runs.

The cells (``benchmarks/fit_slope_cells.py``, per activation ``R + N + F = 32``): right
branch ``s = sqrt(z - z*)`` in ``R`` equal cells up to ``S``, the slope ``min(s, S) h``; left
branch near the minimum (``z <= z_b``) ``N`` equal cells in ``s``, the slope ``s h``, and below
``|z_b|`` one cell per binade of ``-z``, ``F`` of them, in ``t = 2 m - 3`` (``m`` its
mantissa), the slope ``z h``; ``h`` in ``t = s c - (floor(s c) + 1/2)`` for the cells in ``s``
(``c`` cells per unit of ``s``). Arithmetic: fused multiply-adds where written (``llvm.fma``),
no other fast-math, so LLVM forms every operation as written.
"""

import functools
import warnings

import llvmlite.binding as llvm_binding
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .slope_cells import TABLES

LANES = 16
CELLS = 32
#: Coefficients a cell (every activation's table has the same degree). Compiled into the loop:
#: Numba's on-disk cache follows this file, not :mod:`.slope_cells`, so :func:`backward`
#: checks the tables it is given against it (a stale compiled loop would read them wrongly).
COEFFICIENTS = len(next(iter(TABLES.values()))[1][0])
#: Constants per activation, in this order (float32; the cell counts and offsets are whole
#: numbers, made integers in the loop).
CONSTANT_NAMES = ("z_hi", "z_lo", "s_max", "right_scale", "near_scale", "z_b", "far_offset",
                  "right_last", "near_last", "near_first", "far_first")


@functools.cache
def supported() -> bool:
    """Whether the loop runs here: Numba compiles for a CPU with AVX-512 (``vpermi2ps`` on 512
    bits; the host's, as LLVM reads it, unless ``NUMBA_CPU_NAME`` or ``NUMBA_CPU_FEATURES``
    name another target, as for a cache shared between machines), and a first call on 16
    elements compiles and runs (else the scalar loop runs, with a warning)."""
    if numba.config.CPU_NAME is None and numba.config.CPU_FEATURES is None:
        if not llvm_binding.get_host_cpu_features().get("avx512f"):
            return False
    elif "+avx512f" not in (numba.config.CPU_FEATURES or "").split(","):
        return False
    try:
        tables, scalars = constants("silu", (-0.25, 0.0))  # any z*: finite slopes
        z = np.linspace(-0.25, 4.0, LANES, dtype=np.float32)
        out = np.full(LANES, np.nan, dtype=np.float32)
        backward(z, np.ones(LANES, np.float32), np.zeros(2, np.uint8), out, tables, scalars)
        if not np.isfinite(out).all():
            raise ArithmeticError(f"non-finite slopes {out}")
    except Exception as error:  # an LLVM or Numba that cannot build it: the scalar loop runs
        warnings.warn(f"iabn: the AVX-512 loop of the activations' backward did not run "
                      f"({type(error).__name__}: {error}); the scalar loop runs instead",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


@functools.cache
def constants(name: str, z_star: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """``(tables, scalars)`` of ``name`` as the loop reads them: per coefficient (from the
    highest) the 32 cells' values, float32; and :data:`CONSTANT_NAMES`' values (``z*`` in two
    float32 parts, ``z_star``)."""
    fitted, cells = TABLES[name]
    coefficients = len(cells[0])
    if coefficients != COEFFICIENTS:
        raise ValueError(f"slope_cells: {name}'s cells have {coefficients} coefficients, the "
                         f"loop {COEFFICIENTS}; fit every activation at one degree")
    tables = np.array([[cell[coefficients - 1 - k] for cell in cells]
                       for k in range(coefficients)], dtype=np.float32)
    right, near = fitted["right_cells"], fitted["near_cells"]
    # the far cells: index right + near + (E - 1) - e, e = biased exponent - 127
    far_offset = right + near + fitted["left_exponent"] - 1 + 127
    scalars = np.array([z_star[0], z_star[1], fitted["s_max"], fitted["right_scale"],
                        fitted["near_scale"], fitted["z_b"], far_offset, right - 1, near - 1,
                        right, right + near], dtype=np.float32)
    return tables.reshape(-1), scalars


def _vector_intrinsic(module, name: str, vector, arguments):
    return cgutils.get_or_insert_function(module, ir.FunctionType(vector, arguments), name)


@intrinsic
def _blocks(typingctx, z, dz, bits, out, blocks, tables, scalars):
    """``out[i] = phi'(z[i]) dz[i]`` for the first ``16 blocks`` elements (1-d contiguous
    float32 arrays; ``bits`` the packed branch bits of the same elements, uint8)."""
    arrays = (z, dz, bits, out, tables, scalars)
    if any(not isinstance(a, types.Array) or a.ndim != 1 or a.layout != "C" for a in arrays):
        return None  # the IR reads each array's data as one contiguous run
    sig = types.void(z, dz, bits, out, blocks, tables, scalars)

    def codegen(context, builder, signature, args):
        f32, i32, i16 = ir.FloatType(), ir.IntType(32), ir.IntType(16)
        vf, vi, vb = ir.VectorType(f32, LANES), ir.VectorType(i32, LANES), \
            ir.VectorType(ir.IntType(1), LANES)
        intp = context.get_value_type(types.intp)
        data = [context.make_array(t)(context, builder, a).data
                for t, a in zip(signature.args, args, strict=True) if isinstance(t, types.Array)]
        zp, dzp, bp, op, tp, sp = data
        module = builder.module
        sqrt = _vector_intrinsic(module, "llvm.sqrt.v16f32", vf, [vf])
        floor = _vector_intrinsic(module, "llvm.floor.v16f32", vf, [vf])
        fma = _vector_intrinsic(module, "llvm.fma.v16f32", vf, [vf, vf, vf])
        permute = _vector_intrinsic(module, "llvm.x86.avx512.vpermi2var.ps.512", vf,
                                    [vf, vi, vf])
        zeros = ir.Constant(ir.VectorType(i32, LANES), [0] * LANES)

        def splat(value):
            one = builder.insert_element(ir.Constant(vf, ir.Undefined), value,
                                         ir.Constant(i32, 0))
            return builder.shuffle_vector(one, ir.Constant(vf, ir.Undefined), zeros)

        def const(value, vector=vf, element=f32):
            return ir.Constant(vector, [ir.Constant(element, value)] * LANES)

        def load_vector(pointer, offset):
            address = builder.gep(pointer, [offset])
            return builder.load(builder.bitcast(address, vf.as_pointer()), align=4)

        # a NaN in a (an output that is NaN) is kept, so that its gradient is NaN, as torch's
        def minimum(a, b):
            return builder.select(builder.fcmp_unordered("<", a, b), a, b)

        def maximum(a, b):
            return builder.select(builder.fcmp_unordered(">", a, b), a, b)

        scalar = [splat(builder.load(builder.gep(sp, [ir.Constant(intp, j)])))
                  for j in range(len(CONSTANT_NAMES))]
        (z_hi, z_lo, s_max, right_scale, near_scale, z_b, far_offset, right_last, near_last,
         near_first, far_first) = scalar
        far_offset, near_first, far_first = (builder.fptosi(v, vi)
                                             for v in (far_offset, near_first, far_first))
        # per coefficient k: cells 0-15, 16-31
        table = [[load_vector(tp, ir.Constant(intp, k * CELLS + half * LANES))
                  for half in (0, 1)] for k in range(COEFFICIENTS)]
        zero, half = const(0.0), const(0.5)
        last = ir.Constant(vi, [CELLS - 1] * LANES)
        with cgutils.for_range(builder, args[4]) as loop:
            first = builder.mul(loop.index, ir.Constant(intp, LANES))
            zv = load_vector(zp, first)
            dzv = load_vector(dzp, first)
            byte = builder.gep(bp, [builder.mul(loop.index, ir.Constant(intp, 2))])
            left = builder.bitcast(builder.load(builder.bitcast(byte, i16.as_pointer()),
                                                align=1), vb)
            d = maximum(builder.fsub(builder.fsub(zv, z_hi), z_lo), zero)
            s = builder.call(sqrt, [d])
            # right: its cells of s on [0, S]
            s_c = minimum(s, s_max)
            cell = minimum(builder.call(floor, [builder.fmul(s_c, right_scale)]), right_last)
            # t = s c - (cell + 1/2) rounded once: rounding s c first moved t by up to
            # 2e-6 in the last cells
            t_right = builder.call(fma, [s_c, right_scale, builder.fneg(builder.fadd(cell, half))])
            index_right = builder.fptosi(cell, vi)
            # left near the minimum: its cells of s
            cell = minimum(builder.call(floor, [builder.fmul(s, near_scale)]), near_last)
            t_near = builder.call(fma, [s, near_scale, builder.fneg(builder.fadd(cell, half))])
            index_near = builder.add(builder.fptosi(cell, vi), near_first)
            # left below |z_b|: the binade of -z, t = 2 m - 3
            word = builder.bitcast(builder.fneg(zv), vi)
            exponent = builder.lshr(word, ir.Constant(vi, [23] * LANES))
            exponent = builder.and_(exponent, ir.Constant(vi, [0xFF] * LANES))
            index_far = builder.sub(far_offset, exponent)
            index_far = builder.select(builder.icmp_signed("<", index_far, far_first), far_first,
                                       index_far)
            index_far = builder.select(builder.icmp_signed(">", index_far, last), last, index_far)
            mantissa = builder.or_(builder.and_(word, ir.Constant(vi, [0x7FFFFF] * LANES)),
                                   ir.Constant(vi, [0x3F800000] * LANES))
            t_far = builder.call(fma, [builder.bitcast(mantissa, vf), const(2.0), const(-3.0)])
            near = builder.fcmp_ordered("<=", zv, z_b)
            index = builder.select(left, builder.select(near, index_near, index_far),
                                   index_right)
            t = builder.select(left, builder.select(near, t_near, t_far), t_right)
            multiplier = builder.select(left, builder.select(near, s, zv), s_c)
            h = builder.call(permute, [table[0][0], index, table[0][1]])
            for k in range(1, COEFFICIENTS):
                h = builder.call(fma, [h, t, builder.call(permute, [table[k][0], index,
                                                                    table[k][1]])])
            result = builder.fmul(builder.fmul(h, multiplier), dzv)
            target = builder.gep(op, [first])
            builder.store(result, builder.bitcast(target, vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def backward(z, dz, bits, out, tables, scalars):
    """``out = phi'(y) dz`` of 1-d float32 ``z``, ``dz`` and the packed ``bits`` (bit ``j`` of
    byte ``k``: element ``8 k + j``), with :func:`constants`' ``tables`` and ``scalars``. The
    last ``n % 16`` elements are run as one block of copies, padded with zeros."""
    if tables.shape[0] != COEFFICIENTS * CELLS or scalars.shape[0] != len(CONSTANT_NAMES):
        raise ValueError("vector_loops: the tables do not fit the compiled loop (Numba's cache "
                         "holds a loop of another degree: remove iabn's entries from it)")
    n = z.shape[0]
    blocks = n // LANES
    _blocks(z, dz, bits, out, blocks, tables, scalars)
    first = blocks * LANES
    rest = n - first
    if rest:
        zt = np.zeros(LANES, np.float32)
        dzt = np.zeros(LANES, np.float32)
        bt = np.zeros(2, np.uint8)
        ot = np.empty(LANES, np.float32)
        for i in range(rest):
            zt[i] = z[first + i]
            dzt[i] = dz[first + i]
        for k in range((rest + 7) // 8):
            bt[k] = bits[first // 8 + k]
        _blocks(zt, dzt, bt, ot, 1, tables, scalars)
        for i in range(rest):
            out[first + i] = ot[i]
