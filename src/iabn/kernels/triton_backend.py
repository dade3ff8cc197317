"""Launches of the Triton kernels: the same ``forward_`` and ``backward`` as :mod:`.reference`.

Forward is three launches: per-channel partial moments, a ``finalize`` that merges them (and
updates the running statistics, and computes ``invstd``, ``g`` and the normalisation's
coefficients), and the in-place normalise + activate pass. Backward is three as well: partial
sums with the activation's inversion fused in (reads ``z`` and ``dz`` once), ``finalize``
(parameter gradients and the coefficients of ``dx``), and the elementwise ``dx`` pass. That is
the traffic of docs/design.md, "Kernels: numerics and launch plan": about 3 tensor-sizes
forward and 5 backward.

Both variants of the paper compute the same quantities; the kernels implement them with one
formulation (``sum(dy * (y - beta))`` for ``dg``, which does not cancel when ``|beta|`` is
large), so ``variant`` only selects the reference path's arithmetic.

``dx`` always gets its own buffer. Writing it into ``dz`` would save an allocation, but the
incoming gradient may be shared (``a + b`` hands the same tensor to both branches) or expanded
(``x.sum().backward()``), and overwriting it corrupts other gradients.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import activations as act
from . import triton_kernels as k
from .backend import from_reference
from .branch import ITERATIONS
from .common import (
    ABS,
    LAYER_NORM,
    LayerConfig,
    RowConfig,
    compute_dtype,
    dx_coefficients,
    effective_g,
    empty_grads,
    empty_invstd,
    stat_dtype,
)

#: Activation name -> its code in the kernels (the registry's, for those the kernels run).
_ACTIVATION_CODES = {name: a.code for name, a in act.ACTIVATIONS.items() if a.code is not None}
#: The activations these kernels run (a registry record with a code); the reference runs the
#: others (:func:`.backends.backend_for`).
KNOWN_ACTIVATIONS = frozenset(_ACTIVATION_CODES)

#: Chebyshev coefficients of ``(1 + 2t) exp(t^2) erfc(t)`` in ``s = (t - K) / (t + K)``,
#: ``K = 3.75`` (:func:`.triton_kernels._erfcx`): interpolation at 25 Chebyshev nodes of the
#: first kind, from mpmath's ``erfc`` at 40 digits (tests/kernels/test_triton_branch.py recomputes
#: them). Float64 layers use all 25, float32 (and half) the first 16.
ERFCX_SERIES = (
    1.1775789345674017, -0.004590054580646478, -0.08424913336651792, 0.05920993999819189,
    -0.026658668435305753, 0.009074997670705265, -0.002413163540417608,
    0.0004907758365258086, -6.916973302501207e-05, 4.13902798607301e-06,
    7.74038306619849e-07, -2.1886401049234397e-07, 1.076499946567091e-08,
    4.521959811218287e-09, -7.754400208831352e-10, -6.318088340886467e-11,
    2.8687950109312828e-11, 1.9455868542480252e-13, -9.654696750202875e-13,
    3.2525481894915335e-14, 3.3478123773154764e-14, -1.8645662019034036e-15,
    -1.2508924186828822e-15, 7.415558623884118e-17, 5.286883199226413e-17,
)
_ERFCX_TERMS = {torch.float32: 16, torch.float64: 25}
#: The ``constexpr`` SiLU/GELU arguments of the backward kernels for the other activations.
_NO_BRANCH = {"BRANCH": False, "NEWTON": 0, "CHEB": 0, "TAYLOR": False}


class Branch(NamedTuple):
    """What the kernels of an activation with a branch bit take besides the tensors of the
    layer: the packed branch bits (``ceil(numel / 8)`` bytes; forward writes them, backward
    reads them), the table of constants (:func:`branch_constants`), the Newton steps and
    whether the Taylor series is used."""

    bits: Tensor
    consts: Tensor
    newton: int
    taylor: bool


def _branch(z: Tensor, activation: str, bits: Tensor | None) -> Branch | None:
    """The :class:`Branch` of a layer whose output is (or will be) ``z``, or ``None`` for an
    activation without a branch bit: ``bits`` (a new buffer where forward is given none:
    the fused pass writes them anyway), the constants of ``activation`` in the compute dtype
    and :mod:`.branch`'s Newton steps."""
    minimum = act.ACTIVATIONS[activation].minimum
    if minimum is None:
        return None
    if bits is None:
        bits = torch.empty((z.numel() + 7) // 8, dtype=torch.uint8, device=z.device)
    compute = compute_dtype(z.dtype)
    consts = branch_constants((minimum.y_star, minimum.z_star, minimum.curvature),
                              minimum.taylor, compute, z.dtype, z.device,
                              minimum.exponential_tail)
    return Branch(bits, consts, ITERATIONS[compute], compute == torch.float32)


@functools.cache
def branch_constants(minimum: tuple[float, float, float], taylor: tuple[float, ...],
                     compute: torch.dtype, stored: torch.dtype, device: torch.device,
                     exponential_tail: bool = False) -> Tensor:
    """The table the SiLU/GELU kernels read their constants from (indices in
    :mod:`.triton_kernels`), in the compute dtype: the minimum ``(y*, z*, c)`` and the Taylor
    series of the registry's :class:`~.activations.Minimum`, what :func:`.branch.invert`
    derives from them, and :data:`ERFCX_SERIES`. ``stored``: the dtype of ``z``;
    ``exponential_tail``: the registry's :attr:`~.activations.Minimum.exponential_tail`."""
    y_star, z_star, c = minimum
    info = torch.finfo(compute)

    def rounded(value: float) -> float:
        return float(torch.tensor(value, dtype=compute))

    values = [0.0] * int(k.CHEB_FIRST)
    values[k.Y_STAR], values[k.Z_HI] = rounded(y_star), rounded(z_star)
    values[k.Z_LO] = z_star - rounded(z_star)
    values[k.Y_LO] = y_star - rounded(y_star)
    values[k.SLOPE_RIGHT] = math.sqrt(c / 2)
    values[k.SLOPE_LEFT] = math.sqrt(c / (2 * -z_star))
    values[k.LOG_STAR] = math.log(-z_star)
    values[k.FLOOR] = 4 * math.sqrt(info.eps)
    values[k.SMALLEST] = torch.finfo(stored).tiny * torch.finfo(stored).eps
    values[k.TINY] = info.tiny
    values[k.SQRT1_2] = math.sqrt(0.5)
    values[k.LOG_SQRT_2PI] = 0.5 * math.log(2 * math.pi)
    values[k.LOG_HALF] = math.log(0.5)
    values[k.EXP_TAIL] = 1.0 if exponential_tail else 0.0
    values[k.TANH_BETA2] = 2 * math.sqrt(2 / math.pi)  # the tanh GELU's, as ATen's
    values[k.TANH_KAPPA] = 0.044715
    values[int(k.TAYLOR_FIRST):int(k.CHEB_FIRST)] = taylor
    values += ERFCX_SERIES
    return torch.tensor(values, dtype=compute, device=device)

#: Elements per tile of every kernel; with 4 warps, 16 per thread.
_TILE = 2048
#: Cap on the number of partial results per channel (the finalize kernels merge them serially).
_MAX_PARTIALS = 1024
_FINALIZE_BLOCK = 128
#: Launch options: fused multiply-adds, asked for explicitly (Triton 3.9 warns when a launch
#: relies on its default, which is to change).
_LAUNCH = {"enable_fp_fusion": True}


class Layout(NamedTuple):
    """A dense ``(N, C, *spatial)`` tensor as an ``R x K`` row-major matrix (see
    :mod:`.triton_kernels`). ``channel_on_rows``: contiguous NCS; else channels-last."""

    channel_on_rows: bool
    n: int
    c: int
    s: int

    @property
    def rows(self) -> int:
        return self.n * self.c if self.channel_on_rows else self.n * self.s

    @property
    def cols(self) -> int:
        return self.s if self.channel_on_rows else self.c


def layout_of(x: Tensor) -> Layout | None:
    """The kernels' view of ``x``, or ``None`` when ``x`` is not densely packed in one of the
    two layouts (then a dense copy is used)."""
    n, c = x.shape[0], x.shape[1]
    s = x.numel() // (n * c) if n * c else 0
    if x.is_contiguous():
        # With one value per (sample, channel) the contiguous layout is also channels-last,
        # whose rows are long (C) instead of one element.
        return Layout(s != 1, n, c, s)
    if x.dim() > 2 and x.movedim(1, -1).is_contiguous():
        return Layout(False, n, c, s)
    return None


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs a reduction should spread over: a few waves of the device's multiprocessors
    (the interpreter runs programs one by one, so few and large ones are best there)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def _elementwise_config(layout: Layout) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_K)``: long rows get wide tiles, short rows many rows per tile."""
    cap = 1024 if layout.channel_on_rows else 256
    block_k = min(_pow2(layout.cols), cap)
    block_r = min(max(1, _TILE // block_k), _pow2(layout.rows))
    return block_r, block_k


# The launch configurations depend only on the layout (and device): computed once per shape
# and cached, so that a layer call does not redo them. Bounded: a model sees a
# handful of shapes per layer, and a sweep of input sizes must not grow the caches forever.
@functools.lru_cache(maxsize=1024)
def _elementwise_grid(layout: Layout) -> tuple[int, int, int, int]:
    """``(grid, k_blocks, BLOCK_R, BLOCK_K)`` of a 1-D grid over all tiles (the second and third
    grid axes of CUDA are limited to 65535, the first is not)."""
    block_r, block_k = _elementwise_config(layout)
    k_blocks = triton.cdiv(layout.cols, block_k)
    return triton.cdiv(layout.rows, block_r) * k_blocks, k_blocks, block_r, block_k


class _Reduction(NamedTuple):
    """Launch configuration of the per-channel partial reductions."""

    grid: tuple[int, int]
    programs: int
    per_program: int
    block_a: int
    block_b: int


@functools.lru_cache(maxsize=1024)
def _reduction_config(layout: Layout, device: torch.device) -> _Reduction:
    target = _target_programs(device)
    if layout.channel_on_rows:
        # grid (C, P); tiles of BLOCK_N samples x BLOCK_S spatial positions of one channel
        block_s = min(_pow2(layout.s), 1024)
        block_n = min(max(1, _TILE // block_s), _pow2(layout.n))
        tiles = triton.cdiv(layout.n, block_n) * triton.cdiv(layout.s, block_s)
        wanted = min(triton.cdiv(target, layout.c), tiles, _MAX_PARTIALS)
        per_program = triton.cdiv(tiles, wanted)
        programs = triton.cdiv(tiles, per_program)
        return _Reduction((layout.c, programs), programs, per_program, block_n, block_s)
    # grid (C blocks, P); tiles of BLOCK_R rows x BLOCK_C channels
    block_c = min(_pow2(layout.c), 64)
    block_r = min(max(1, _TILE // block_c), _pow2(layout.rows))
    c_blocks = triton.cdiv(layout.c, block_c)
    row_tiles = triton.cdiv(layout.rows, block_r)
    wanted = min(triton.cdiv(target, c_blocks), row_tiles, _MAX_PARTIALS)
    per_program = triton.cdiv(row_tiles, wanted) * block_r
    programs = triton.cdiv(layout.rows, per_program)
    return _Reduction((c_blocks, programs), programs, per_program, block_r, block_c)


def _dense(x: Tensor) -> tuple[Tensor, Layout]:
    layout = layout_of(x)
    if layout is not None:
        return x, layout
    dense = x.contiguous()
    return dense, layout_of(dense)  # type: ignore[return-value]


def forward_(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    config: LayerConfig,
    bits: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """As :func:`.reference.forward_`: overwrite ``x`` with the layer's output, update the
    running statistics in training, return ``(invstd, g)``. An activation with one minimum
    writes its branch bits into ``bits`` (``ceil(numel / 8)`` bytes) in the order of ``x``'s
    memory, which only this backend's backward reads (``y`` compared in the compute dtype)."""
    training, momentum, eps, activation, activation_param, gamma_mode, _ = config
    if x.numel() == 0:
        sdtype = stat_dtype(x, weight, running_mean)
        g = effective_g(weight, eps, gamma_mode, x.shape[1], sdtype, x.device)
        return empty_invstd(training, running_var, eps, x.shape[1], sdtype, x.device), g
    branch = _branch(x, activation, bits)
    work, layout = _dense(x)
    channels = layout.c
    sdtype = stat_dtype(x, weight, running_mean)
    adtype = accumulation_dtype(x.dtype)
    acc = _TL_DTYPES[adtype]
    device = x.device
    invstd = torch.empty(channels, dtype=sdtype, device=device)
    scale = torch.empty(channels, dtype=sdtype, device=device)
    coeffs = torch.empty(2, channels, dtype=adtype, device=device)
    parts, programs = coeffs, 0  # unread placeholders in eval mode
    if training:
        reduction = _reduction_config(layout, device)
        programs = reduction.programs
        parts = torch.empty(3, programs, channels, dtype=torch.float64, device=device)
        if layout.channel_on_rows:
            k.moments_ncs_kernel[reduction.grid](
                work, parts, layout.n, channels, layout.s, reduction.per_program,
                BLOCK_N=reduction.block_a, BLOCK_S=reduction.block_b, ACC=acc, **_LAUNCH,
            )
        else:
            k.moments_mc_kernel[reduction.grid](
                work, parts, layout.rows, channels, reduction.per_program,
                BLOCK_R=reduction.block_a, BLOCK_C=reduction.block_b, ACC=acc, **_LAUNCH,
            )
    update_running = training and running_mean is not None
    dummy = invstd
    k.finalize_forward_kernel[(triton.cdiv(channels, _FINALIZE_BLOCK),)](
        parts, programs,
        weight if weight is not None else dummy, bias if bias is not None else dummy,
        running_mean if running_mean is not None else dummy,
        running_var if running_var is not None else dummy,
        invstd, scale, coeffs, channels, float(momentum), float(eps),
        TRAINING=training, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        UPDATE_RUNNING=update_running, GAMMA_ABS=gamma_mode == ABS,
        BLOCK_C=_FINALIZE_BLOCK, ACC=acc, **_LAUNCH,
    )
    if branch is not None:
        numel, block_bytes = work.numel(), _TILE // 8  # a tile of elements, 8 to a byte
        k.normalize_branch_kernel[(triton.cdiv(numel, _TILE),)](
            work, branch.bits, coeffs, branch.consts, numel, layout.cols, channels,
            CHANNEL_ON_ROWS=layout.channel_on_rows, ACT=_ACTIVATION_CODES[activation],
            CHEB=_ERFCX_TERMS[adtype], BLOCK_BYTES=block_bytes, ACC=acc, **_LAUNCH,
        )
    else:
        grid, k_blocks, block_r, block_k = _elementwise_grid(layout)
        k.normalize_act_kernel[(grid,)](
            work, coeffs, layout.rows, layout.cols, channels, k_blocks, float(activation_param),
            CHANNEL_ON_ROWS=layout.channel_on_rows, ACT=_ACTIVATION_CODES[activation],
            BLOCK_R=block_r, BLOCK_K=block_k, ACC=acc, **_LAUNCH,
        )
    if work is not x:
        x.copy_(work)
    return invstd, scale


def _branch_arguments(branch: Branch | None, unread: Tensor, adtype: torch.dtype) -> tuple[
    tuple[Tensor, Tensor], dict
]:
    """The SiLU/GELU arguments of the backward kernels: ``(bits, consts)`` and the
    ``constexpr`` ones (unread placeholders for the other activations)."""
    if branch is None:
        return (unread, unread), _NO_BRANCH
    return (branch.bits, branch.consts), dict(BRANCH=True, NEWTON=branch.newton,
                                              CHEB=_ERFCX_TERMS[adtype], TAYLOR=branch.taylor)


def _grad_partials(z: Tensor, dz: Tensor, bias: Tensor | None, layout: Layout,
                   activation: str, activation_param: float,
                   branch: Branch | None = None) -> tuple[Tensor, int]:
    """``(parts, P)``: per-program partial ``[sum(dy), sum(dy * (y - beta))]``, ``(2, P, C)``."""
    channels = layout.c
    adtype = accumulation_dtype(z.dtype)
    config = _reduction_config(layout, z.device)
    parts = torch.empty(2, config.programs, channels, dtype=adtype, device=z.device)
    pointers, constants = _branch_arguments(branch, parts, adtype)
    common = dict(HAS_BIAS=bias is not None, ACT=_ACTIVATION_CODES[activation],
                  BLOCK_R=config.block_a, BLOCK_C=config.block_b, ACC=_TL_DTYPES[adtype],
                  **constants, **_LAUNCH)
    bias_arg = bias if bias is not None else parts
    tiny = torch.finfo(adtype).eps
    if layout.channel_on_rows:
        common["BLOCK_N"], common["BLOCK_S"] = common.pop("BLOCK_R"), common.pop("BLOCK_C")
        k.grad_sums_ncs_kernel[config.grid](
            z, dz, bias_arg, parts, layout.n, channels, layout.s, config.per_program,
            float(activation_param), tiny, *pointers, **common,
        )
    else:
        k.grad_sums_mc_kernel[config.grid](
            z, dz, bias_arg, parts, layout.rows, channels, config.per_program,
            float(activation_param), tiny, *pointers, **common,
        )
    return parts, config.programs


def _input_grad(z: Tensor, dz: Tensor, coeffs: Tensor, layout: Layout, activation: str,
                activation_param: float, branch: Branch | None = None) -> Tensor:
    """``dx = k1 * dy + k2 * y + k3`` with ``coeffs = (k1, k2, k3)``, ``(3, C)``."""
    dx = torch.empty_like(z)
    grid, k_blocks, block_r, block_k = _elementwise_grid(layout)
    pointers, constants = _branch_arguments(branch, coeffs, coeffs.dtype)
    k.input_grad_kernel[(grid,)](
        z, dz, dx, coeffs, layout.rows, layout.cols, layout.c, k_blocks,
        float(activation_param), torch.finfo(coeffs.dtype).eps, *pointers,
        CHANNEL_ON_ROWS=layout.channel_on_rows, ACT=_ACTIVATION_CODES[activation],
        BLOCK_R=block_r, BLOCK_K=block_k, ACC=_TL_DTYPES[coeffs.dtype], **constants, **_LAUNCH,
    )
    return dx


def dense_pair(z: Tensor, dz: Tensor) -> tuple[Tensor, Tensor, Layout]:
    """``z`` and ``dz`` densely packed in the same layout (copies only where needed)."""
    z, layout = _dense(z)
    if dz.stride() != z.stride():
        # Expanded, transposed or otherwise differently laid-out gradients are read through
        # a copy in z's layout; they are never written.
        dz = torch.empty_like(z).copy_(dz)
    return z, dz, layout


def backward(
    z: Tensor,
    dz: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    invstd: Tensor,
    scale: Tensor,
    config: LayerConfig,
    output_mask: list[bool],
    bits: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """As :func:`.reference.backward` (``config.variant`` does not change the kernels'
    arithmetic), with the ``bits`` forward wrote for an activation with one minimum."""
    if z.numel() == 0:
        return empty_grads(z, weight, bias, output_mask)
    training, _, _, activation, activation_param, gamma_mode, _ = config
    branch = _branch(z, activation, bits)
    want_dx = output_mask[0]
    want_dgamma = output_mask[1] and weight is not None
    want_dbeta = output_mask[2] and bias is not None
    z, dz, layout = dense_pair(z, dz)
    channels = layout.c
    adtype = accumulation_dtype(z.dtype)
    coeffs = torch.empty(3, channels, dtype=adtype, device=z.device)
    parts, programs = coeffs, 0  # no reductions needed: finalize only forms k1 = g * invstd
    if want_dgamma or want_dbeta or (want_dx and training):
        parts, programs = _grad_partials(z, dz, bias, layout, activation, activation_param,
                                         branch)
    dgamma = torch.empty_like(weight) if want_dgamma else None
    dbeta = torch.empty_like(bias) if want_dbeta else None
    k.finalize_backward_kernel[(triton.cdiv(channels, _FINALIZE_BLOCK),)](
        parts, programs,
        weight if weight is not None else coeffs, bias if bias is not None else coeffs,
        invstd, scale,
        dgamma if dgamma is not None else coeffs, dbeta if dbeta is not None else coeffs,
        coeffs, channels, float(layout.n * layout.s),
        TRAINING=training, HAS_BIAS=bias is not None, WANT_DGAMMA=want_dgamma,
        WANT_DBETA=want_dbeta, GAMMA_ABS=gamma_mode == ABS,
        BLOCK_C=_FINALIZE_BLOCK, ACC=_TL_DTYPES[adtype], **_LAUNCH,
    )
    dx = (_input_grad(z, dz, coeffs, layout, activation, activation_param, branch)
          if want_dx else None)
    return dx, dgamma, dbeta


# --- activations without a norm ------------------------------------------------------------


def activation_grad(z: Tensor, dz: Tensor, bits: Tensor | None, activation: str,
                    activation_param: Any = 0.0) -> Tensor:
    """``dx`` of an activation layer without a norm in one launch
    (:meth:`.backend.KernelBackend.activation_grad`): the Newton steps of :func:`.branch.invert`
    in registers, where the reference runs each as ATen operations over the tensor. An
    invertible activation (``bits`` ``None``) is left to the reference."""
    if bits is None:
        return _reference_activation_grad(z, dz, bits, activation, activation_param)
    branch_ = _branch(z, activation, bits)
    z_dense, dz_dense = z.contiguous(), dz.contiguous()  # the bits' (logical) order
    dx = torch.empty_like(z_dense)
    numel = z.numel()
    if numel:
        adtype = accumulation_dtype(z.dtype)
        k.activation_grad_kernel[(triton.cdiv(numel, _TILE),)](
            z_dense, dz_dense, dx, branch_.bits, branch_.consts, numel,
            ACT=_ACTIVATION_CODES[activation], NEWTON=branch_.newton,
            CHEB=_ERFCX_TERMS[adtype], TAYLOR=branch_.taylor, ACC=_TL_DTYPES[adtype],
            BLOCK=_TILE,
            **_LAUNCH,
        )
    return dx.view_as(z) if z.is_contiguous() else torch.empty_like(z).copy_(dx)


# --- the synchronised layer's backward (the two halves of .backend.KernelBackend) ---------


def local_sums(
    z: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor, config: LayerConfig,
    bits: Tensor | None = None,
) -> tuple[tuple, Tensor]:
    """``(saved, sums)``: this rank's ``sums = [sum(dy * xhat), sum(dy)]`` ``(2, C)``, and
    what :func:`input_grad` needs (``z`` and ``dz``, read again there; nothing full-size is
    materialised)."""
    activation, activation_param = config.activation, config.activation_param
    branch = _branch(z, activation, bits)
    if z.numel() == 0:  # a rank without samples contributes zeros
        sums = torch.zeros(2, z.shape[1], dtype=accumulation_dtype(z.dtype), device=z.device)
        return (z, dz, None, activation, activation_param, branch), sums
    z, dz, layout = dense_pair(z, dz)
    parts, _ = _grad_partials(z, dz, bias, layout, activation, activation_param, branch)
    sum_dy, sum_dy_centred = parts.sum(1)
    sums = torch.stack([sum_dy_centred / scale.to(parts.dtype), sum_dy])
    return (z, dz, layout, activation, activation_param, branch), sums


def input_grad(
    saved: tuple, bias: Tensor | None, scale: Tensor, invstd: Tensor, global_sums: Tensor,
    total: Tensor, out_dtype: torch.dtype,
) -> Tensor:
    """``dx`` from the sums over all ranks (see :func:`.reference.input_grad`)."""
    z, dz, layout, activation, activation_param, branch = saved
    if layout is None:
        return torch.empty_like(z, dtype=out_dtype)
    coeffs = dx_coefficients(scale, invstd, bias, global_sums, total, global_sums.dtype)
    return _input_grad(z, dz, coeffs, layout, activation, activation_param,
                       branch).to(out_dtype)


# The norms' functions of the contract without Triton kernels: the reference's (the row norms'
# forward is PyTorch's kernel there; their backward, below, falls back to it in some cases).
group_norm_forward_, group_norm_backward, row_norm_forward, _reference_row_norm_backward = (
    from_reference("group_norm_forward_", "group_norm_backward", "row_norm_forward",
                   "row_norm_backward"))
# The invertible activations without a norm (no branch bit): the reference's.
(_reference_activation_grad,) = from_reference("activation_grad")


# --- the output-only layer and RMS norms' backward ------------------------------------------

#: The longest row (``D``, the normalised values) :func:`row_norm_backward` runs as one tile;
#: longer rows go to the reference.
ROW_NORM_MAX_D = 8192
#: Elements of a tile of :func:`.triton_kernels.row_norm_grad_kernel` (``BLOCK_M * BLOCK_D``)
#: where a row is shorter.
_ROW_NORM_TILE = 4096


def row_norm_backward(y: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
                      rstd: Tensor, kept: Tensor | None, index: Tensor | None,
                      config: RowConfig, output_mask: list[bool],
                      ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """As :func:`.row_norm.row_norm_backward`, in one launch of
    :func:`.triton_kernels.row_norm_grad_kernel` (``dx`` and per-program column sums, ``xhat``
    rebuilt in registers) and one ``sum`` of the partials for the weight and bias gradients.
    The reference runs the cases the kernel does not take: kept ``xhat`` columns (zero, tiny
    or non-finite weights, outputs that may overflow), empty tensors and rows longer than
    :data:`ROW_NORM_MAX_D`."""
    shape, _, kind, channels = config
    v = y.movedim(1, -1) if channels else y
    dv = dz.movedim(1, -1) if channels else dz
    d = math.prod(shape)
    m = v.numel() // d if d else 0
    if index is not None or m == 0 or d == 0 or d > ROW_NORM_MAX_D:
        return _reference_row_norm_backward(y, dz, weight, bias, rstd, kept, index, config,
                                            output_mask)
    y2, dz2 = v.reshape(m, d).contiguous(), dv.reshape(m, d).contiguous()
    want_dx = output_mask[0]
    want_dw = output_mask[1] and weight is not None
    want_db = output_mask[2] and bias is not None
    adtype = accumulation_dtype(y.dtype)
    block_d = _pow2(d)
    block_m = max(1, min(_ROW_NORM_TILE // block_d, _pow2(m)))
    programs = min(_target_programs(y.device), triton.cdiv(m, block_m))
    rows_per_program = triton.cdiv(triton.cdiv(m, programs), block_m) * block_m
    programs = triton.cdiv(m, rows_per_program)
    dx = torch.empty((m, d), dtype=y.dtype, device=y.device) if want_dx else None
    parts = (torch.empty((2, programs, d), dtype=adtype, device=y.device)
             if want_dw or want_db else None)
    k.row_norm_grad_kernel[(programs,)](
        y2, dz2, dx if dx is not None else y2, rstd.reshape(m),
        weight.reshape(d) if weight is not None else y2,
        bias.reshape(d) if bias is not None else y2,
        parts if parts is not None else y2, m, d, rows_per_program,
        LAYER=kind == LAYER_NORM, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        WANT_DX=want_dx, WANT_SUMS=parts is not None,
        BLOCK_M=block_m, BLOCK_D=block_d, ACC=_TL_DTYPES[adtype], **_LAUNCH,
    )
    dw = db = None
    if parts is not None:
        sums = parts.sum(1)
        dw = sums[0].view(shape).to(weight.dtype) if want_dw else None
        db = sums[1].view(shape).to(bias.dtype) if want_db else None
    if dx is not None:
        dx = dx.view(v.shape)
        dx = dx.movedim(-1, 1) if channels else dx
    return dx, dw, db
