"""The Triton kernels beyond the shared parity tests (which run them through ``backend``):
reductions over many partial results, numerics with ``|mean| >> std``, determinism, gradients
that must not be written, dispatch and its errors, and compilation for a real GPU target.

On machines without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set in conftest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import iabn
from iabn.kernels import dispatch, reference

from helpers import randomise_

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from iabn.kernels import triton_backend, triton_kernels  # noqa: E402

COMPILE_SCRIPT = Path(__file__).with_name("compile_for_gpu.py")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def tiny_tiles(monkeypatch):
    """Tiles of 16 elements and up to 8 partial results per channel, so that small tensors
    exercise the multi-tile loops and the merge of partials."""
    monkeypatch.setattr(triton_backend, "_TILE", 16)
    monkeypatch.setattr(triton_backend, "_target_programs", lambda device: 8)


def _torch_reference(x, bn, slope, grad):
    x = x.detach().clone().requires_grad_()
    out = torch.nn.functional.leaky_relu(bn(x), slope)
    out.backward(grad)
    return out.detach(), x.grad, bn.weight.grad, bn.bias.grad


@pytest.mark.parametrize("shape,channels_last", [
    ((5, 3, 7, 6), False),   # NCS: tiles over samples and positions, odd sizes
    ((5, 3, 7, 6), True),    # channels-last: tiles over rows
    ((37, 5), False),        # (N, C): rows of channels
    ((2, 3, 50), False),     # long rows: several column blocks
], ids=str)
def test_many_partials_match_torch_float64(tiny_tiles, monkeypatch, shape, channels_last):
    monkeypatch.setenv("IABN_BACKEND", "triton")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 1).contiguous(memory_format=fmt)
    layout = triton_backend.layout_of(x)
    assert triton_backend._reduction_config(layout, x.device).programs > 1
    bn = randomise_(torch.nn.BatchNorm1d(shape[1]) if len(shape) < 4
                    else torch.nn.BatchNorm2d(shape[1])).double()
    layer = iabn.InPlaceABN(shape[1], activation_param=0.1).double()
    layer.load_state_dict(bn.state_dict())
    grad = torch.randn(shape, dtype=torch.float64)
    expected = _torch_reference(x, bn, 0.1, grad)
    leaf = x.clone().requires_grad_()
    out = layer(leaf.clone())
    out.backward(grad)
    for got, want in zip((out, leaf.grad, layer.weight.grad, layer.bias.grad), expected,
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(layer.running_var, bn.running_var, atol=1e-12, rtol=0)


@pytest.mark.parametrize("channels_last", [False, True])
def test_variance_is_exact_when_the_mean_dwarfs_the_spread(tiny_tiles, channels_last):
    """Sum and sum of squares in float32 would lose every digit here (mean/std = 1e5)."""
    x = (1000.0 + 0.01 * torch.randn(4, 3, 6, 6, dtype=torch.float64)).float()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    exact_var = x.double().var((0, 2, 3), unbiased=True)
    running_mean, running_var = torch.zeros(3), torch.zeros(3)
    triton_backend.forward_(x.clone(), None, None, running_mean, running_var, True, 1.0, 1e-5,
                            "identity", 0.0, "signed")
    torch.testing.assert_close(running_var.double(), exact_var, rtol=1e-4, atol=0)


def test_results_are_bitwise_deterministic(tiny_tiles):
    x = torch.randn(6, 5, 9, 7)
    grad = torch.randn_like(x)
    weight, bias = torch.rand(5) + 0.5, torch.randn(5)
    runs = []
    for _ in range(2):
        z = x.clone()
        stats = torch.zeros(5), torch.ones(5)
        invstd, scale = triton_backend.forward_(z, weight, bias, *stats, True, 0.1, 1e-5,
                                                "leaky_relu", 0.01, "signed")
        grads = triton_backend.backward(z, grad, weight, bias, invstd, scale, True, 1e-5,
                                        "leaky_relu", 0.01, "signed", 2, [True, True, True])
        runs.append((z, *stats, *grads))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_shared_incoming_gradient_is_not_written(backend):
    """``a + b`` hands one gradient tensor to both branches; overwriting it in one branch's
    backward (the original package's bug) would corrupt the other's gradient."""
    layer = iabn.InPlaceABN(3)
    x = torch.randn(2, 3, 4, 4, requires_grad=True)
    skip = torch.randn(2, 3, 4, 4, requires_grad=True)
    grad = torch.randn(2, 3, 4, 4)
    (layer(x.clone()) + skip).backward(grad)
    torch.testing.assert_close(skip.grad, grad, atol=0, rtol=0)


def test_interpreter_bfloat16_conversion_rounds_like_torch():
    """The conftest fix of the interpreter's float32 -> bfloat16 conversion (see
    tests/triton_interpreter.py): kernel stores must round like PyTorch (and a GPU)."""

    @triton.jit
    def store_bf16(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask).to(tl.bfloat16), mask=mask)

    values = torch.cat([torch.randn(1000) * 5, torch.tensor([0.0, -0.0, 1e-40, 3.0e38])])
    if not values.is_cuda and not dispatch.triton_interpreting():
        pytest.skip("needs CUDA or the interpreter")
    out = torch.empty_like(values, dtype=torch.bfloat16)
    store_bf16[(1,)](values, out, values.numel(), BLOCK=1024 * 2)
    assert torch.equal(out, values.to(torch.bfloat16))


# --- dispatch ----------------------------------------------------------------------------------


def test_auto_uses_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("IABN_BACKEND", raising=False)
    assert dispatch.backend_for(torch.zeros(1)) is reference


def test_unknown_backend_name_is_rejected(monkeypatch):
    monkeypatch.setenv("IABN_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"IABN_BACKEND='cuda'.*reference, triton"):
        iabn.InPlaceABN(2)(torch.randn(3, 2))


def test_triton_on_cpu_without_the_interpreter_fails_clearly(monkeypatch):
    monkeypatch.setenv("IABN_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(3, 2)
    before = x.clone()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        iabn.functional.inplace_abn(x, None, None, training=True)
    assert torch.equal(x, before)


def test_triton_requested_but_not_installed_fails_clearly(monkeypatch):
    monkeypatch.setenv("IABN_BACKEND", "triton")
    monkeypatch.setattr(dispatch, "has_triton", lambda: False)
    with pytest.raises(RuntimeError, match="pip install triton"):
        dispatch.backend_for(torch.zeros(1))


# --- compilation for a real GPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def hopper_builds():
    """Every kernel compiled for sm_90 by tests/compile_for_gpu.py, in a process without the
    interpreter (the interpreter accepts programs that a GPU compiler rejects)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(COMPILE_SCRIPT)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_kernel_compiles_for_a_hopper_gpu(hopper_builds):
    kernels = {name for name in dir(triton_kernels) if name.endswith("_kernel")}
    assert {build["kernel"] for build in hopper_builds} == kernels
    for build in hopper_builds:
        assert build["cubin_bytes"] > 0, build


FAR_OFFSETS_SCRIPT = Path(__file__).with_name("far_offsets.py")


def _far_offsets(mode):
    """Run tests/far_offsets.py in its own process (a wrong address crashes it)."""
    done = subprocess.run([sys.executable, str(FAR_OFFSETS_SCRIPT), mode], capture_output=True,
                          text=True, timeout=300)
    result = json.loads(done.stdout) if done.returncode == 0 else None
    if result is not None and "skip" in result:
        pytest.skip(result["skip"])
    return done, result


def test_kernels_address_elements_past_2_31():
    """Every kernel that walks full-size tensors, launched on tiles past element 2**31 of a
    tensor with more than 2**31 elements (only the touched pages get memory), under the
    interpreter, whose 32-bit integers wrap as a GPU's do. Written values are float16
    (relative rounding <= 2**-11: bound 2**-10); partial sums stay float32 (bound 1e-6)."""
    done, errors = _far_offsets("kernels")
    assert done.returncode == 0, (done.returncode, done.stdout[-500:], done.stderr[-3000:])
    for case, error in errors.items():
        bound = 2.0**-10 if case in ("normalize_act", "input_grad") else 1e-6
        assert error <= bound, (case, error)
    assert len(errors) == 6


def test_far_offsets_negative_control_fails():
    """The same launch with 32-bit row offsets must crash or write the wrong elements: shows
    that the test above can fail (the interpreter does wrap 32-bit products)."""
    done, result = _far_offsets("control")
    assert done.returncode != 0 or result["control"] > 0.1, (done.returncode, result)


# --- on a GPU ------------------------------------------------------------------------------


@needs_cuda
def test_auto_uses_triton_for_cuda_tensors(monkeypatch):
    monkeypatch.delenv("IABN_BACKEND", raising=False)
    assert dispatch.backend_for(torch.zeros(1, device="cuda")) is triton_backend


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gpu_matches_reference_at_a_paper_shape(dtype, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(32, 256, 56, 56, device="cuda").to(dtype).contiguous(memory_format=fmt)
    grad = torch.randn_like(x)
    weight, bias = torch.rand(256, device="cuda") + 0.5, torch.randn(256, device="cuda")
    results = []
    for backend in (reference, triton_backend):
        z = x.clone()
        stats = torch.zeros(256, device="cuda"), torch.ones(256, device="cuda")
        invstd, scale = backend.forward_(z, weight, bias, *stats, True, 0.1, 1e-5,
                                         "leaky_relu", 0.01, "signed")
        grads = backend.backward(z, grad, weight, bias, invstd, scale, True, 1e-5,
                                 "leaky_relu", 0.01, "signed", 2, [True, True, True])
        results.append((z.float(), *stats, *(g.float() for g in grads)))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for ref, ours in zip(*results, strict=True):
        torch.testing.assert_close(ours, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@needs_cuda
def test_more_than_2_31_elements_are_addressed():
    """64-bit indexing: a bfloat16 tensor of 2**31 + 2**20 elements (4.3 GB); the last
    channel's values lie beyond 2**31 and must be normalised like the first's."""
    n, c, hw = 2 ** 11 + 1, 2, 2 ** 19
    x = torch.empty(n, c, hw, device="cuda", dtype=torch.bfloat16)
    pattern = torch.arange(hw, device="cuda", dtype=torch.float32).remainder_(7)
    x.copy_(pattern.to(torch.bfloat16).expand_as(x))
    iabn.functional.inplace_abn(x, None, None, training=True, activation="identity")
    expected = (pattern - pattern.mean()) / pattern.var(unbiased=False).add(1e-5).sqrt()
    for sample in (0, n - 1):
        for channel in range(c):
            torch.testing.assert_close(x[sample, channel].float(), expected, atol=2e-2,
                                       rtol=1e-2)
