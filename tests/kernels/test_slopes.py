"""Input gradients at the activation's kink, counted against float64 (iabn.tools.bench.slopes).

The Triton backward once took the other LeakyReLU slope at single elements of channels with
100k+ values (seen on an H100): its batch mean was off by up to 6e-7 standard deviations, enough to
move values near 0 across the kink. These tests count, at such sizes, the elements whose
input gradient disagrees with a float64 ``nn.BatchNorm2d`` + ``leaky_relu`` beyond the dtype's
resolution, for the Triton kernels, iabn's reference backend and PyTorch's own layers on the
same input, and require Triton's count to be no larger than PyTorch's.

Under the CPU interpreter a case of 6.4M elements takes 30-45 s, so every interpreted case is
``slow``: CI runs (``-m "slow and not sweep"``) the case that failed before the fix
(32x64x56x56, float32, channels-last, seed 0: one element on the other side of the kink); the
other five are also ``sweep`` (about 4 min on 2 cores; ``-m sweep``). On a CUDA machine every
case runs on the compiled kernels (``gpu``), with the sizes of the GPU sweep.
"""

import pytest
import torch

from iabn.tools.bench import slopes

from helpers import INTERPRET, TRITON_DEVICE, runs_triton

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

#: (shape, dtype, channels_last, seed); the first is the case that failed before the fix.
INTERPRETED = [
    ((32, 64, 56, 56), F32, True, 0),
    ((32, 64, 56, 56), F32, False, 1),
    ((32, 64, 56, 56), F32, True, 2),
    ((8, 64, 128, 128), F32, True, 0),
    ((32, 64, 56, 56), BF16, False, 0),
    ((32, 64, 56, 56), F16, True, 0),
]
#: The shapes of the GPU sweep (100k to 524k values per channel), several seeds.
ON_GPU = [
    *((shape, F32, layout, seed)
      for shape in ((32, 64, 56, 56), (8, 64, 128, 128), (8, 256, 128, 128), (16, 64, 128, 128),
                    (2, 64, 512, 512))
      for layout in (False, True) for seed in (0, 1, 2)),
    *((shape, dtype, layout, 0)
      for shape in ((32, 256, 56, 56), (8, 256, 128, 128)) for dtype in (BF16, F16)
      for layout in (False, True)),
]


def _cases():
    if not INTERPRET:
        return [pytest.param(*case, id=_id(*case)) for case in ON_GPU]
    first, *rest = INTERPRETED
    return [pytest.param(*first, id=_id(*first), marks=pytest.mark.slow),
            *(pytest.param(*case, id=_id(*case), marks=(pytest.mark.slow, pytest.mark.sweep))
              for case in rest)]


def _id(shape, dtype, channels_last, seed):
    layout = "channels_last" if channels_last else "nchw"
    return f"{'x'.join(map(str, shape))}-{str(dtype).removeprefix('torch.')}-{layout}-{seed}"


@runs_triton
@pytest.mark.parametrize("shape,dtype,channels_last,seed", _cases())
def test_triton_takes_the_other_slope_no_more_often_than_torch(shape, dtype, channels_last,
                                                               seed):
    pytest.importorskip("triton")
    row = slopes.study(shape, dtype, channels_last, seed, TRITON_DEVICE)
    assert row["per_channel"] >= 100_000
    assert row["triton"]["mismatched"] <= row["torch"]["mismatched"], row


def test_a_kink_moved_by_a_mean_error_is_counted():
    """The counter's negative control: float64 gradients of an activation whose kink sits at
    ``delta`` instead of 0 -- what a batch mean off by ``delta`` standard deviations does --
    are counted at the elements in between, except where the output gradient is too small
    for the wrong slope to exceed the tolerance."""
    torch.manual_seed(0)
    x, dz = torch.randn(2, 2, 8, 256, 256, dtype=torch.float64).unbind(0)
    y64, dx64, _ = slopes.input_grads(x, dz, providers=())
    delta = 1e-4
    x_moved = x.clone().requires_grad_()
    y = torch.nn.BatchNorm2d(8).double()(x_moved)
    (torch.nn.functional.leaky_relu(y - delta, slopes.SLOPE) + delta).backward(dz)
    between = (y64 > 0) & (y64 < delta)
    counted = slopes.mismatches(x_moved.grad, dx64)
    assert between.sum() >= 30  # about 0.4 * delta of the 524k values
    assert not (counted & ~between).any()
    assert counted.sum() >= 0.9 * between.sum(), (int(counted.sum()), int(between.sum()))
