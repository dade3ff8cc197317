"""The Triton kernels beyond the shared parity tests (which run them through ``backend``):
reductions over many partial results, numerics with ``|mean| >> std``, determinism, gradients
that must not be written, dispatch and its errors, and compilation for a real GPU target.

The kernels run on ``TRITON_DEVICE`` (see conftest.py): under ``TRITON_INTERPRET=1`` on CPU
tensors on machines without CUDA, compiled on CUDA tensors where it is visible.
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
from iabn.kernels import backends, reference
from iabn.kernels.common import LayerConfig

from helpers import TRITON_DEVICE, randomise_, runs_triton

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from iabn.kernels import triton_backend, triton_kernels  # noqa: E402

COMPILE_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "compile_for_gpu.py"

#: The default layer in training mode, momentum 0.1, as the kernels take it.
LEAKY = LayerConfig(True, 0.1, 1e-5, "leaky_relu", 0.01, "signed")


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


@runs_triton
@pytest.mark.parametrize("shape,channels_last", [
    ((5, 3, 7, 6), False),   # NCS: tiles over samples and positions, odd sizes
    ((5, 3, 7, 6), True),    # channels-last: tiles over rows
    ((37, 5), False),        # (N, C): rows of channels
    ((2, 3, 50), False),     # long rows: several column blocks
], ids=str)
def test_many_partials_match_torch_float64(tiny_tiles, monkeypatch, shape, channels_last):
    monkeypatch.setenv("IABN_BACKEND", "triton")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 1).to(TRITON_DEVICE)
    x = x.contiguous(memory_format=fmt)
    layout = triton_backend.layout_of(x)
    assert triton_backend._reduction_config(layout, x.device).programs > 1
    bn = randomise_(torch.nn.BatchNorm1d(shape[1]) if len(shape) < 4
                    else torch.nn.BatchNorm2d(shape[1])).double().to(TRITON_DEVICE)
    layer = iabn.InPlaceABN(shape[1], activation_param=0.1).double().to(TRITON_DEVICE)
    layer.load_state_dict(bn.state_dict())
    grad = torch.randn(shape, dtype=torch.float64).to(TRITON_DEVICE)
    expected = _torch_reference(x, bn, 0.1, grad)
    leaf = x.clone().requires_grad_()
    out = layer(leaf.clone())
    out.backward(grad)
    for got, want in zip((out, leaf.grad, layer.weight.grad, layer.bias.grad), expected,
                         strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(layer.running_var, bn.running_var, atol=1e-12, rtol=0)


@runs_triton
@pytest.mark.parametrize("channels_last", [False, True])
def test_statistics_are_exact_when_the_mean_dwarfs_the_spread(tiny_tiles, channels_last):
    """Sum and sum of squares in float32 would lose every digit here (mean/std = 1e5); the
    float32 tile means alone are off by ~1e-5 std. The corrected two-pass tile summaries
    merged in float64 give the mean to float32 rounding of its value (|mean| = 1000: 3e-5,
    i.e. 3e-3 std), the variance to 1e-4."""
    x = (1000.0 + 0.01 * torch.randn(4, 3, 6, 6, dtype=torch.float64)).float()
    x = x.to(TRITON_DEVICE)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    exact_mean = x.double().mean((0, 2, 3))
    exact_var = x.double().var((0, 2, 3), unbiased=True)
    running_mean, running_var = torch.zeros(3, device=x.device), torch.zeros(3, device=x.device)
    triton_backend.forward_(x.clone(), None, None, running_mean, running_var,
                            LayerConfig(True, 1.0, 1e-5, "identity", 0.0, "signed"))
    torch.testing.assert_close(running_var.double(), exact_var, rtol=1e-4, atol=0)
    ulp = torch.finfo(torch.float32).eps * 1000.0
    torch.testing.assert_close(running_mean.double(), exact_mean, rtol=0, atol=ulp)


@runs_triton
def test_results_are_bitwise_deterministic(tiny_tiles):
    x = torch.randn(6, 5, 9, 7).to(TRITON_DEVICE)
    grad = torch.randn_like(x)
    weight, bias = (torch.rand(5) + 0.5).to(x.device), torch.randn(5).to(x.device)
    runs = []
    for _ in range(2):
        z = x.clone()
        stats = torch.zeros(5, device=x.device), torch.ones(5, device=x.device)
        invstd, scale = triton_backend.forward_(z, weight, bias, *stats, LEAKY)
        grads = triton_backend.backward(z, grad, weight, bias, invstd, scale, LEAKY,
                                        [True, True, True])
        runs.append((z, *stats, *grads))
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


def test_shared_incoming_gradient_is_not_written(backend, device):
    """``a + b`` hands one gradient tensor to both branches; overwriting it in one branch's
    backward (the original package's bug) would corrupt the other's gradient."""
    layer = iabn.InPlaceABN(3, device=device)
    x = torch.randn(2, 3, 4, 4, device=device, requires_grad=True)
    skip = torch.randn(2, 3, 4, 4, device=device, requires_grad=True)
    grad = torch.randn(2, 3, 4, 4, device=device)
    (layer(x.clone()) + skip).backward(grad)
    torch.testing.assert_close(skip.grad, grad, atol=0, rtol=0)


@runs_triton
def test_bfloat16_stores_round_like_torch():
    """Kernel stores of bfloat16 round like PyTorch: on a GPU (``cvt.rn``), and under the
    interpreter thanks to conftest's fix of its conversion (see
    tests/support/triton_interpreter.py)."""

    @triton.jit
    def store_bf16(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask).to(tl.bfloat16), mask=mask)

    special = [0.0, -0.0, 3.0e38]
    if TRITON_DEVICE.type == "cpu":
        # a float32 subnormal: the interpreter's conversion is numpy's; a GPU compile may flush
        # subnormals to zero, which matters for no value a layer stores in practice
        special.append(1e-40)
    values = torch.cat([torch.randn(1000) * 5, torch.tensor(special)]).to(TRITON_DEVICE)
    out = torch.empty_like(values, dtype=torch.bfloat16)
    store_bf16[(1,)](values, out, values.numel(), BLOCK=1024 * 2)
    assert torch.equal(out, values.to(torch.bfloat16))


# --- dispatch ----------------------------------------------------------------------------------


def test_auto_uses_the_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("IABN_BACKEND", raising=False)
    assert backends.backend_for(torch.zeros(1)) is reference


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
    monkeypatch.setattr(backends, "has_triton", lambda: False)  # (backend_for reads it there)
    with pytest.raises(RuntimeError, match="pip install triton"):
        backends.backend_for(torch.zeros(1))


# --- compilation for a real GPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def hopper_builds():
    """Every kernel compiled for sm_90 by tests/support/compile_for_gpu.py, in a process without the
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
        # momentum, eps, slopes, tiny and counts arrive as float64 (the GPU would get them
        # rounded to float32 otherwise: a float64 layer then misses PyTorch by 1e-8)
        assert build["f32_params"] == 0, build
    assert sum(build["f64_params"] for build in hopper_builds) > 0


FAR_OFFSETS_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "far_offsets.py"


def _far_offsets(mode):
    """Run tests/support/far_offsets.py in its own process (a wrong address crashes it)."""
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


@pytest.mark.slow
def test_far_offsets_negative_control_fails():
    """The same launch with 32-bit row offsets must crash or write the wrong elements: shows
    that the test above can fail (the interpreter does wrap 32-bit products)."""
    done, result = _far_offsets("control")
    assert done.returncode != 0 or result["control"] > 0.1, (done.returncode, result)


# --- on a GPU ------------------------------------------------------------------------------


def test_auto_uses_the_reference_for_cuda_tensors_too(monkeypatch):
    """Until a GPU run of the whole suite is green with Triton, ``auto`` picks the reference
    kernels on CUDA as well; Triton is opt-in. A stand-in for a CUDA tensor: the
    choice reads only ``is_cuda``."""
    from types import SimpleNamespace

    monkeypatch.delenv("IABN_BACKEND", raising=False)
    assert backends.backend_for(SimpleNamespace(is_cuda=True)) is reference
    monkeypatch.setenv("IABN_BACKEND", "triton")
    assert backends.backend_for(SimpleNamespace(is_cuda=True)) is triton_backend


@pytest.mark.gpu
def test_auto_uses_the_reference_for_real_cuda_tensors(monkeypatch):
    monkeypatch.delenv("IABN_BACKEND", raising=False)
    assert backends.backend_for(torch.zeros(1, device="cuda")) is reference


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_triton_matches_reference_at_a_paper_shape(dtype, channels_last):
    """Output, running statistics and parameter gradients of both backends at ResNeXt-101's
    first stage (32x256x56x56). The input gradient is compared with float64 element by
    element in tests/kernels/test_slopes.py, where a value near the kink may take the other slope in
    either backend: here it would fail a comparison of the two."""
    if TRITON_DEVICE.type != "cuda":
        pytest.skip("26M elements: minutes under the interpreter; tests/kernels/test_slopes.py has "
                    "the interpreted large shapes")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(32, 256, 56, 56, device="cuda").to(dtype).contiguous(memory_format=fmt)
    grad = torch.randn_like(x)
    weight, bias = torch.rand(256, device="cuda") + 0.5, torch.randn(256, device="cuda")
    results = []
    for backend in (reference, triton_backend):
        z = x.clone()
        stats = torch.zeros(256, device="cuda"), torch.ones(256, device="cuda")
        invstd, scale = backend.forward_(z, weight, bias, *stats, LEAKY)
        _, dweight, dbias = backend.backward(z, grad, weight, bias, invstd, scale, LEAKY,
                                             [False, True, True])
        results.append((z.float(), *stats, dweight, dbias))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for ref, ours in zip(*results, strict=True):
        torch.testing.assert_close(ours, ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.gpu
@runs_triton
def test_more_than_2_31_elements_are_addressed():
    """64-bit indexing: a bfloat16 tensor of 2**31 + 2**20 elements (4.3 GB); the last
    channel's values lie beyond 2**31 and must be normalised like the first's."""
    n, c, hw = 2 ** 11 + 1, 2, 2 ** 19
    x = torch.empty(n, c, hw, device="cuda", dtype=torch.bfloat16)
    pattern = torch.arange(hw, device="cuda", dtype=torch.float32).remainder_(7)
    x.copy_(pattern.to(torch.bfloat16).expand_as(x))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("IABN_BACKEND", "triton")
        iabn.functional.inplace_abn(x, None, None, training=True, activation="identity")
    expected = (pattern - pattern.mean()) / pattern.var(unbiased=False).add(1e-5).sqrt()
    for sample in (0, n - 1):
        for channel in range(c):
            torch.testing.assert_close(x[sample, channel].float(), expected, atol=2e-2,
                                       rtol=1e-2)


def test_use_backend_scopes_the_choice_and_restores_it(monkeypatch):
    monkeypatch.delenv("IABN_BACKEND", raising=False)
    with backends.use_backend("triton"):
        assert backends.requested_backend() == "triton"
    assert "IABN_BACKEND" not in os.environ
    monkeypatch.setenv("IABN_BACKEND", "reference")
    with pytest.raises(KeyError), backends.use_backend("triton"):
        raise KeyError  # restored on the way out of an error too
    assert os.environ["IABN_BACKEND"] == "reference"
