"""Run the Triton kernels (under the CPU interpreter) on elements past 2**31, without 2**31
elements of memory.

Each case allocates a tensor of more than 2**31 elements but writes (so the OS backs with
memory) only the few tiles the launch touches, and launches a sub-grid that reaches those far
tiles directly: program ids are fixed at 0.., so the arguments are chosen to put the far
elements into the first programs (a huge channel count with one channel block, or a
one-program grid over a few huge rows). The kernels' address arithmetic is exactly the real
one: the interpreter computes 32-bit integers with wrap-around as a GPU does (the negative
control, a kernel with 32-bit row offsets, crashes on the same launch), so an offset that
overflowed would address memory 4 GiB away: a crash or wrong values.

Usage: ``python far_offsets.py kernels`` prints one JSON line, case -> error relative to the
largest expected value; ``python far_offsets.py control`` runs the 32-bit kernel (expected
to crash). Run by tests/kernels/test_triton.py in a subprocess, because a wrong address kills the
process. Where the system refuses the address space (up to 8 GiB per tensor, never touched) it
prints ``{"skip": reason}``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

from iabn.kernels import triton_kernels as k

F32 = tl.float32
#: The constexprs of the SiLU/GELU path, off (the kernels here run other activations).
NO_BRANCH = {"BRANCH": False, "NEWTON": 0, "CHEB": 0, "TAYLOR": False}
LIMIT = 2**31
ROWS_PAST = 2**30 + 64  # row length: row 2 starts past 2**31


def _huge(*shape: int) -> torch.Tensor:
    """Uninitialised float16: only pages that are written get memory."""
    return torch.empty(shape, dtype=torch.float16)


def _fill(view: torch.Tensor) -> torch.Tensor:
    view.copy_(torch.randn(view.shape, dtype=torch.float32))
    return view.float()


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).abs().max() / expected.abs().max()).item()


def _far(t: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``view`` (of ``t``) reaches past element 2**31 of ``t``."""
    extent = sum((s - 1) * st for s, st in zip(view.shape, view.stride(), strict=True))
    last = view.storage_offset() + extent
    return last - t.storage_offset() >= LIMIT


def normalize_act() -> float:
    """Rows of ``ROWS_PAST`` elements, channel per row (C=1); 3 one-row programs."""
    x = _huge(3, ROWS_PAST)
    block = x[:, :128]
    assert _far(x, block)
    before = _fill(block)
    coeffs = torch.tensor([1.5, -0.25])
    k.normalize_act_kernel[(3,)](x, coeffs, 3, ROWS_PAST, 1, 1, 0.01, CHANNEL_ON_ROWS=True,
                                 ACT=k.LEAKY_RELU, BLOCK_R=1, BLOCK_K=128, ACC=F32)
    expected = torch.nn.functional.leaky_relu(1.5 * before - 0.25, 0.01)
    return _relative(block, expected)


def input_grad() -> float:
    z, dz, dx = _huge(3, ROWS_PAST), _huge(3, ROWS_PAST), _huge(3, ROWS_PAST)
    zb, dzb = _fill(z[:, :128]), _fill(dz[:, :128])
    assert _far(dx, dx[:, :128])
    coeffs = torch.tensor([0.5, -2.0, 0.125])
    k.input_grad_kernel[(3,)](z, dz, dx, coeffs, 3, ROWS_PAST, 1, 1, 0.0, 1e-30, coeffs, coeffs,
                              CHANNEL_ON_ROWS=True, ACT=k.IDENTITY, **NO_BRANCH, BLOCK_R=1,
                              BLOCK_K=128, ACC=F32)
    expected = 0.5 * dzb - 2.0 * zb + 0.125
    return _relative(dx[:, :128], expected)


def _moments_error(parts: torch.Tensor, channels: int, values: torch.Tensor) -> float:
    """``values``: (elements, channels) read by one program; parts ``[3, 1, C]``."""
    count, mean, m2 = parts[0, 0, :channels], parts[1, 0, :channels], parts[2, 0, :channels]
    centred = values - values.mean(0)
    return max(_relative(count, torch.full_like(count, values.shape[0])),
               _relative(mean, values.mean(0)),
               _relative(m2, centred.square().sum(0)))


def moments_mc() -> float:
    """Channels-last: 5 rows of 2**29+64 channels; one program, channel block 0."""
    channels = 2**29 + 64
    x = _huge(5, channels)
    assert _far(x, x[:, :64])
    values = _fill(x[:, :64])
    parts = torch.empty(3, 1, channels, dtype=torch.float64)
    k.moments_mc_kernel[(1, 1)](x, parts, 5, channels, 5, BLOCK_R=8, BLOCK_C=64, ACC=F32)
    return _moments_error(parts, 64, values)


def moments_ncs() -> float:
    """NCHW: 2 samples of 2**29+1 channels of 4 positions; one program, channel 0."""
    channels = 2**29 + 1
    x = _huge(2, channels, 4)
    assert _far(x, x[:, 0, :])
    values = _fill(x[:, 0, :]).reshape(-1, 1)
    parts = torch.empty(3, 1, channels, dtype=torch.float64)
    k.moments_ncs_kernel[(1, 1)](x, parts, 2, channels, 4, 1, BLOCK_N=2, BLOCK_S=4, ACC=F32)
    return _moments_error(parts, 1, values)


def _grad_sums_error(parts: torch.Tensor, channels: int, z: torch.Tensor,
                     dz: torch.Tensor) -> float:
    sum_dy, sum_dy_y = parts[0, 0, :channels], parts[1, 0, :channels]
    return max(_relative(sum_dy, dz.sum(0)), _relative(sum_dy_y, (dz * z).sum(0)))


def grad_sums_mc() -> float:
    channels = 2**29 + 64
    z, dz = _huge(5, channels), _huge(5, channels)
    assert _far(z, z[:, :64])
    zv, dzv = _fill(z[:, :64]), _fill(dz[:, :64])
    parts = torch.empty(2, 1, channels)
    k.grad_sums_mc_kernel[(1, 1)](z, dz, parts, parts, 5, channels, 5, 0.0, 1e-30, parts,
                                  parts, HAS_BIAS=False, ACT=k.IDENTITY, **NO_BRANCH,
                                  BLOCK_R=8, BLOCK_C=64, ACC=F32)
    return _grad_sums_error(parts, 64, zv, dzv)


def grad_sums_ncs() -> float:
    channels = 2**29 + 1
    z, dz = _huge(2, channels, 4), _huge(2, channels, 4)
    assert _far(z, z[:, 0, :])
    zv, dzv = _fill(z[:, 0, :]).reshape(-1, 1), _fill(dz[:, 0, :]).reshape(-1, 1)
    parts = torch.empty(2, 1, channels)
    k.grad_sums_ncs_kernel[(1, 1)](z, dz, parts, parts, 2, channels, 4, 1, 0.0, 1e-30, parts,
                                   parts, HAS_BIAS=False, ACT=k.IDENTITY, **NO_BRANCH,
                                   BLOCK_N=2, BLOCK_S=4, ACC=F32)
    return _grad_sums_error(parts, 1, zv, dzv)


CASES = {f.__name__: f for f in (normalize_act, input_grad, moments_mc, moments_ncs,
                                 grad_sums_mc, grad_sums_ncs)}


@triton.jit
def int32_rows_kernel(x_ptr, K, BLOCK: tl.constexpr):
    """The negative control: ``x[row, :] *= 2`` with the row offset in 32 bits."""
    offsets = tl.program_id(0) * K + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) * 2.0)


def control() -> float:
    x = _huge(3, ROWS_PAST)
    before = _fill(x[:, :128])
    int32_rows_kernel[(3,)](x, ROWS_PAST, BLOCK=128)
    return _relative(x[:, :128], 2 * before)


def main() -> None:
    torch.manual_seed(0)  # the same data on every run: a failure reproduces
    run = {"control": control} if sys.argv[1:] == ["control"] else CASES
    try:
        print(json.dumps({name: case() for name, case in run.items()}))
    except RuntimeError as error:
        if "can't allocate memory" not in str(error):
            raise
        # this system does not overcommit address space (the largest reservation is 8 GiB)
        print(json.dumps({"skip": f"cannot reserve the address space: {error}"}))


if __name__ == "__main__":
    main()
