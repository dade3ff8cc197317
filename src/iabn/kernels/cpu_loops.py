"""One-pass CPU loops, compiled by Numba (:mod:`.numba_loops`), and what calls them: for the
activations with one minimum (``silu``, ``gelu``, ``gelu_tanh``, ``mish``) the backward
``dx = phi'(y) dz`` from the output ``z``, the packed branch bits and the fitted slopes of
:mod:`.branch`, and the forward's bit packing; for the output-only layer and RMS norms the
backward (:mod:`.row_norm`'s math, each row read from memory once).

Why by hand: PyTorch has no elementwise kernel that reads ``z``, ``dz`` and the bits once and
writes ``dx`` once. Composed of ATen operations the fitted slopes are about 80 passes over a
chunk (``branch._fitted_grad_cpu``: 29 ms at 8x197x1536 float32, one thread, against torch's
whole GELU backward at about 4 ms); Inductor's fused loop of the same math took 2-3x the
chunks' time (its vector code unpacks the bits per element). Numba (LLVM) vectorises a plain
loop over the elements when nothing in it branches, so everything below is written as
selections: both branches are formed on every element and one is kept, except that a chunk
with few left-branch elements (:data:`SPLIT`) forms the right branch on every element and the
left branch on its left elements alone, gathered into a buffer. Where the CPU has AVX-512 the
activations' backward runs :mod:`.vector_loops` instead: 16 lanes at a time over one table
of 32 cells of degree 7 for both branches (:mod:`.slope_cells`), a few operations an element
(1.0-1.1 ms at 8x197x1536 float32, one thread, where this loop took 2.5-5.5 ms).

The math is :mod:`.branch`'s, rearranged for one evaluation per element:

- the right branch's two pieces, ``h = F(-1) + (t - 1) Q(t)`` near the minimum and ``F(t)``
  beyond, are one Horner evaluation with the coefficients of ``Q`` or ``F`` chosen per
  element, then that one step more near the minimum;
- ``log(z* / z)`` on the left branch is ``log1p(u)``, ``u = (z - z*) / -z``, where ``u <= 1``
  (near the minimum, exact there) and ``log(-z*) - log(-z)`` beyond; both are
  ``2 atanh(s) = 2 s (1 + s^2/3 + ... + s^12/13)``, with ``s = u / (2 + u)`` (``|s| <= 1/3``)
  and, for ``log(-z) = e log 2 + log m``, ``s = (m - 1) / (m + 1)`` with ``m`` the mantissa
  taken to ``[sqrt(1/2), sqrt(2))`` (``|s| <= 0.172``); one division for both. The series'
  first omitted term is 1.4e-8 of the logarithm.

Numba is optional: without it (or numpy) :mod:`.branch` and :mod:`.row_norm` run their ATen
forms, the same values to within float32 rounding (tested). The loops are compiled on first
use into Numba's on-disk cache, once per machine and dtype (about 2.5 s; a later process
imports and loads them in about 0.5 s), and release the GIL: with ``torch.get_num_threads() >
1`` a large tensor is cut into that many ranges run on threads.
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

#: An activation's fitted slopes, as :mod:`.branch` holds them: ``(LEFT_SLOPE[name],
#: RIGHT_SLOPE[name], (z*_hi, z*_lo))`` (float32's two parts of ``z*``).
Slopes = tuple

#: Called as ``on_launch(name, reads, writes)`` with the loop's whole tensors before each
#: loop runs, where set: :mod:`iabn.measure.traffic` counts the loops as launches (they are not
#: ATen operators, which it sees by itself).
on_launch = None

#: Elements per thread below which a loop runs on the calling thread alone: handing a range
#: to the pool and waiting for it took 81 us (median, the 2-core VM); 2^17 elements of the
#: activations' backward take about 0.3 ms.
THREAD_GRAIN = 1 << 17

#: A chunk of the loops whose left-branch elements are at most this fraction of it takes the
#: right branch on every element, then the left branch on its left elements alone (gathered
#: and scattered back one at a time: finding them alone took 0.74 ms for 0.81M of 2.42M
#: elements, about 0.9 ns each); a chunk with more forms
#: both branches on every element. Where the two cost the same, measured (2-core VM, one
#: thread): the activations' backward 0.38-0.40 (silu, gelu at 8x197x1536), the recovery with
#: its float64 inverse 0.6 (8x64x56x56); docs/design.md has the figures.
SPLIT = {"activation_grad": 0.375, "invert_and_slope": 0.6}


@functools.cache
def available() -> bool:
    """Whether Numba (and numpy) import: without them :mod:`.branch` runs its ATen form."""
    try:
        import numba  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(*tensors: Tensor) -> bool:
    """Whether the loops can take ``tensors``: Numba importable, outside the compiler, plain
    CPU tensors (no subclass, no ``torch.func`` wrapper: their memory is not a numpy array's)."""
    if torch.compiler.is_compiling() or not available():  # the compiler reads no cache
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or t.device.type != "cpu" or _wrapped(t):
            return False
    return True


def _wrapped(t: Tensor) -> bool:
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


@functools.cache
def _constants(slopes: Slopes) -> tuple:
    """The fitted slopes as :func:`.numba_loops.slope` takes them, float32 scalars: the three
    pieces' coefficients (``a_0 .. a_16``, zeros above a piece's degree: the left branch ``R``,
    the right branch's ``Q`` near the minimum and ``F`` beyond), then the maps of ``v`` and
    ``s`` to ``[-1, 1]`` (``2 / V``, ``2 / E``, ``2 / (S - E)``, ``-(S + E) / (S - E)``),
    ``E``, ``S``, ``z*`` in two parts, ``log(-z*)`` and ``F(-1)``."""
    import numpy as np

    (v_max, left), (s_max, edge, q, f), (z_hi, z_lo) = slopes
    f_at_edge = sum(c * (-1) ** k for k, c in enumerate(f))
    degree = 16
    pad = lambda c: tuple(c) + (0.0,) * (degree + 1 - len(c))  # noqa: E731
    # the maps to [-1, 1] made in float64 and rounded once, as branch's ATen form has them
    width = s_max - edge
    scalars = (2 / v_max, 2 / edge, 2 / width, -(s_max + edge) / width, edge, s_max, z_hi, z_lo,
               math.log(-(z_hi + z_lo)), f_at_edge)
    return (*(tuple(np.float32(c) for c in pad(p)) for p in (left, q, f)),
            tuple(np.float32(x) for x in scalars))


@functools.cache
def _loops():
    """:mod:`.numba_loops`, imported on first use (it imports Numba, 0.2-1 s)."""
    from . import numba_loops

    return numba_loops


#: Whether the activations' backward takes :mod:`.vector_loops`' loop: None where the CPU
#: has AVX-512 (:func:`.vector_loops.supported`); True or False to choose (the tests run both).
VECTOR_LOOP: bool | None = None


def vector_loop_runs() -> bool:
    """Whether :func:`activation_grad` runs :mod:`.vector_loops` (:data:`VECTOR_LOOP`)."""
    if VECTOR_LOOP is not None:
        return VECTOR_LOOP
    return _vector_loops().supported()


@functools.cache
def _vector_loops():
    """:mod:`.vector_loops`, imported on first use (it imports Numba and llvmlite)."""
    from . import vector_loops

    return vector_loops


def _ranges(count: int, unit: int = 8) -> list[tuple[int, int]]:
    """``[0, count)`` cut into up to ``torch.get_num_threads()`` ranges of whole units of
    ``unit`` elements (whole bytes of bits; whole rows), none under :data:`THREAD_GRAIN`."""
    if count == 0:
        return []
    parts = max(1, min(torch.get_num_threads(), count // THREAD_GRAIN))
    step = (-(-count // parts) + unit - 1) // unit * unit
    return [(a, min(a + step, count)) for a in range(0, count, step)]


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="iabn-cpu-loops")


def _run(task, count: int) -> None:
    _run_ranges(task, _ranges(count))


def _run_ranges(task, ranges: list[tuple]) -> None:
    """``task(*r)`` for each ``r`` of ``ranges``: the first on the calling thread, the others
    one each on the pool's threads."""
    if not ranges:
        return
    futures = [_pool(len(ranges) - 1).submit(task, *r) for r in ranges[1:]]
    task(*ranges[0])
    for future in futures:
        future.result()


def activation_grad(z: Tensor, dz: Tensor, bits: Tensor, activation: str,
                    slopes: Slopes) -> Tensor:
    """``dx = phi'(y) dz`` for a CPU ``z`` of float32 or half (computed in float32), from the
    packed branch ``bits``: one pass over ``z`` and ``dz``. Where the CPU has AVX-512
    (:func:`vector_loop_runs`), :mod:`.vector_loops`' 16-lane loop over the ``activation``'s
    slope tables; elsewhere :mod:`.numba_loops`' loop over its fitted ``slopes``."""
    if vector_loop_runs():
        backward = _vector_loops().backward
        constants = _vector_loops().constants(activation, tuple(slopes[2]))
        split = ()
    else:
        backward = _loops().backward
        constants = _constants(slopes)
        split = (SPLIT["activation_grad"],)
    zf = z.detach().contiguous().view(-1)  # numpy() refuses a tensor that requires grad
    dzf = dz.detach().contiguous().view(-1)
    if zf.dtype != torch.float32:
        zf, dzf = zf.float(), dzf.float()
    out = torch.empty(zf.shape, dtype=torch.float32)
    za, dza, ba, oa = zf.numpy(), dzf.numpy(), bits.numpy(), out.numpy()

    def task(a: int, b: int) -> None:
        backward(za[a:b], dza[a:b], ba[a // 8:(b + 7) // 8], oa[a:b], *constants, *split)

    if on_launch is not None:
        on_launch("cpu_loops.activation_grad", [zf, dzf, bits], [out])
    _run(task, zf.numel())
    return out.to(z.dtype).view(z.shape)


def pack_below(x: Tensor, y_star: float) -> Tensor:
    """:func:`.branch.pack_bits` of ``x < y_star`` for a CPU float32 or float64 ``x``, in one
    pass."""
    pack = _loops().pack_below
    flat = x.detach().contiguous().view(-1)
    bits = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8)
    xa, ba = flat.numpy(), bits.numpy()
    threshold = xa.dtype.type(y_star)

    def task(a: int, b: int) -> None:
        pack(xa[a:b], threshold, ba[a // 8:(b + 7) // 8])

    if on_launch is not None:
        on_launch("cpu_loops.pack_below", [flat], [bits])
    _run(task, flat.numel())
    return bits


@functools.cache
def _inverse_constants(inverse: tuple, z_star: float) -> tuple:
    """A fitted inverse (:data:`.fitted_inverse.INVERSE`) as :func:`.numba_loops.invert_and_slope`
    takes it: per branch the three pieces' powers (padded to 17) and their maps to ``t``."""
    def branch_constants(pieces):
        powers = [tuple(p) + (0.0,) * (17 - len(p)) for _, _, p in pieces]
        maps = tuple(v for a, b, _ in pieces for v in (2 / (b - a), -(a + b) / (b - a)))
        return (*powers, maps)

    right, left = inverse
    return (branch_constants(right), branch_constants(left), float(z_star),
            math.log(-z_star), float(torch.finfo(torch.float32).tiny
                                     * torch.finfo(torch.float32).eps))


def invert_and_slope(z: Tensor, dz: Tensor, bits: Tensor, activation: str, slopes: Slopes,
                     inverse: tuple, z_star: float) -> tuple[Tensor, Tensor]:
    """``(y, dy)`` of a float32 CPU ``z`` on the branches its ``bits`` name: ``y`` the fitted
    ``inverse`` evaluated in float64, ``dy = phi'(y) dz`` from the fitted ``slopes``; one pass,
    both float32 and ``z``'s shape. Where :func:`vector_loop_runs`, two: ``y`` alone, then
    ``dy`` by :func:`activation_grad`'s vector loop (the one pass's slope cost more than the
    second read of ``z``: at 8x64x56x56, one thread, 5.2-6.4 ms against 3.3-4.3 ms for ``y``
    alone and 0.9-1.2 ms for ``dy``, measured with the vector loop's first form)."""
    loop = _loops().invert_and_slope
    constants = _constants(slopes)
    extra = _inverse_constants(inverse, z_star)
    zf = z.detach().contiguous().view(-1)
    dzf = dz.detach().float().contiguous().view(-1)
    split = vector_loop_runs()
    y = torch.empty(zf.shape, dtype=torch.float32)
    dy = None if split else torch.empty(zf.shape, dtype=torch.float32)
    # the loop's slope inputs and output: none where the vector loop makes dy afterwards
    slope_io = [] if split else [dzf, dy]
    za, ba, ya = (t.numpy() for t in (zf, bits, y))
    dza, dya = (t.numpy() for t in slope_io) if slope_io else (None, None)

    def task(a: int, b: int) -> None:
        part = (lambda t: t) if split else (lambda t: t[a:b])
        loop(za[a:b], part(dza), ba[a // 8:(b + 7) // 8], ya[a:b], part(dya), *constants,
             *extra, SPLIT["invert_and_slope"])

    if on_launch is not None:
        on_launch("cpu_loops.invert_and_slope", [zf, bits, *slope_io[:1]], [y, *slope_io[1:]])
    _run(task, zf.numel())
    if split:
        dy = activation_grad(zf, dzf, bits, activation, slopes)
    return y.view(z.shape), dy.view(z.shape)


def row_norm_backward(y: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                      rstd: Tensor, layer: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dw, db)`` of the output-only layer (``layer``) or RMS norm from its float32
    output rows ``y`` and ``dz`` (``(rows, D)``), ``rstd`` (``(rows, 1)``) and the flat
    ``(D,)`` weight and bias (``None``: 1 and 0), every feature rebuilt from ``y``: one loop
    that reads each row of ``y`` and ``dz`` from memory once and writes ``dx`` (3 passes of
    bytes; ATen's operations make 7). The parameter gradients are summed in float64 and
    returned in float32."""
    loop = _loops().row_norm_backward
    m, d = y.shape
    y, dz = y.detach().contiguous(), dz.detach().contiguous()
    w = (torch.ones(d) if weight is None else weight.detach().float()).contiguous()
    shift = torch.zeros(d) if bias is None else (-bias.detach().float() / w).contiguous()
    r = rstd.detach().float().reshape(m).contiguous()
    dx = torch.empty((m, d), dtype=torch.float32)
    ranges = _ranges(m * d, unit=max(d, 1))  # whole rows
    # each range's own float64 sums of dz xhat and dz, added at the end
    partial = torch.zeros((max(len(ranges), 1), 2, d), dtype=torch.float64)
    ya, dza, wa, sa, ra, dxa, pa = (t.numpy() for t in (y, dz, w, shift, r, dx, partial))

    def task(part: int, a: int, b: int) -> None:
        rows = slice(a // d, b // d)
        loop(ya[rows], dza[rows], wa, sa, ra[rows], layer, dxa[rows], pa[part, 0], pa[part, 1])

    if on_launch is not None:
        on_launch("cpu_loops.row_norm_backward", [y, dz], [dx])
    _run_ranges(task, [(k, a, b) for k, (a, b) in enumerate(ranges)])
    total = partial.sum(0).float()
    return dx, total[0], total[1]


__all__ = ["activation_grad", "available", "invert_and_slope", "pack_below",
           "row_norm_backward"]
