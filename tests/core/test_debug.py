"""iabn.debug.poison_overwritten: misuse of an in-place layer's input raises, correct code
computes what the torch.nn reference computes, and nothing changes outside the mode.

The references are ``nn.BatchNorm2d`` + ``nn.LeakyReLU`` in float64; the poisoned input is
read with torch function handling disabled, the way a read the mode cannot see would get it.
"""

import gc
import os
import socket
import subprocess
import sys
import warnings
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import iabn
import iabn.compat
import iabn.compat.functions
from iabn import debug
from iabn.debug import OverwrittenTensorError, poison_overwritten

import dist_workers

SLOPE = 0.01
C = 4


def _unchecked(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` made where the mode cannot see it (the NaNs a C extension would read)."""
    with torch._C.DisableTorchFunction():
        return t.detach().clone()


def _randomised(layer: nn.Module) -> nn.Module:
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.7, 0.9, 2.0], dtype=layer.weight.dtype))
        layer.bias.copy_(torch.tensor([0.1, -0.3, 0.5, 0.0], dtype=layer.bias.dtype))
    return layer


def _reference(layer: nn.Module) -> nn.Sequential:
    """``nn.BatchNorm2d`` + ``nn.LeakyReLU`` with ``layer``'s parameters, float64."""
    bn = nn.BatchNorm2d(C, dtype=torch.float64)
    bn.load_state_dict(layer.state_dict())
    bn.train(layer.training)
    return nn.Sequential(bn, nn.LeakyReLU(SLOPE))


class Residual(nn.Module):
    """The issue's block: the norm's input is the shortcut, ``norm(h) + h``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.conv = nn.Conv2d(C, C, 3, padding=1, dtype=torch.float64)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.norm(h) + h


def _input(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(3, C, 5, 5, dtype=torch.float64) * 2 + 0.5


def test_residual_misuse_is_silent_without_the_mode_and_raises_inside_it():
    """The issue's case. Without the mode the in-place block adds the norm's output to itself:
    no error, yet the output and the gradients differ from the BatchNorm reference (measured
    max abs: output 4.0, input gradient 8.9, conv weight gradient 291, of loss sum(out**2);
    with norm(h.clone()) instead the differences are 0 and 2.7e-15)."""
    x = _input()
    block = Residual(_randomised(iabn.InPlaceABN(C, dtype=torch.float64)))
    reference = Residual(_reference(block.norm))
    xi, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, out_ref = block(xi), reference(xr)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    assert (out - out_ref).abs().max() > 0.1
    assert (xi.grad - xr.grad).abs().max() > 0.1
    assert (block.conv.weight.grad - reference.conv.weight.grad).abs().max() > 0.1

    model = nn.Sequential(nn.Identity(), block)
    with poison_overwritten(), pytest.raises(OverwrittenTensorError) as caught:
        model(x)
    message = str(caught.value)
    assert "InPlaceABN '1.norm'" in message and "(3, 4, 5, 5)" in message
    assert "x.clone()" in message and "iabn.ABN" in message


def test_the_poison_is_nan_where_the_mode_cannot_see():
    layer = iabn.InPlaceABN(C, dtype=torch.float64)
    h = _input()
    with poison_overwritten():
        out = layer(h)
        with torch._C.DisableTorchFunction():  # the misuse, unchecked
            misuse = out + h
        assert _unchecked(h).isnan().all()
        assert _unchecked(misuse).isnan().all()
        assert not _unchecked(out).isnan().any()


@pytest.mark.parametrize("training", [True, False])
def test_correct_use_matches_the_normal_path_and_the_reference(training):
    """Outputs, input/weight/bias gradients and running statistics: bit-equal to the normal
    in-place path (the same kernels on a copy), and within 2e-13, ~50x the measured float64
    difference from nn.BatchNorm2d + nn.LeakyReLU (4.4e-15 max, the weight gradient)."""
    def run(layer, debugging):
        leaf = _input().requires_grad_()
        grad = _input(seed=5)
        if debugging:
            with poison_overwritten():
                out = layer(leaf.clone())
                out.backward(grad)
        else:
            out = layer(leaf.clone())
            out.backward(grad)
        return out.detach(), leaf.grad, layer.weight.grad, layer.bias.grad, layer

    def make():
        layer = _randomised(iabn.InPlaceABN(C, dtype=torch.float64)).train(training)
        torch.manual_seed(3)
        with torch.no_grad():
            layer.running_mean.uniform_(-0.5, 0.5)
            layer.running_var.uniform_(0.5, 2.0)
        return layer

    normal, debugged = run(make(), False), run(make(), True)
    for a, b in zip(normal[:4], debugged[:4], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(normal[4].running_mean, debugged[4].running_mean)
    assert torch.equal(normal[4].running_var, debugged[4].running_var)

    reference = _reference(make())
    leaf = _input().requires_grad_()
    out = reference(leaf)
    out.backward(_input(seed=5))
    bn = reference[0]
    expected = (out, leaf.grad, bn.weight.grad, bn.bias.grad)
    for got, want in zip(debugged[:4], expected, strict=True):
        torch.testing.assert_close(got, want, atol=2e-13, rtol=0)
    torch.testing.assert_close(debugged[4].running_var, bn.running_var, atol=2e-13, rtol=0)


def test_outside_the_mode_the_layer_returns_its_input():
    layer = iabn.InPlaceABN(C)
    x = torch.randn(2, C, 3, 3)
    assert layer(x) is x
    with poison_overwritten():
        y = torch.randn(2, C, 3, 3)
        assert layer(y) is not y
    assert debug._ACTIVE == 0
    x = torch.randn(2, C, 3, 3)
    before = x.clone()
    out = layer(x)
    assert out is x and not torch.equal(out, before)


def _sync_quietly(layer):
    """InPlaceABNSync without a process group warns once per process that it runs locally."""
    def call(x):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "InPlaceABNSync runs without", UserWarning)
            return layer(x)
    return call


def _functional(x):
    return iabn.functional.inplace_abn(x, None, None, training=True, activation_param=SLOPE)


def _compat_functional(x):
    return iabn.compat.functions.inplace_abn(x, None, None, None, None,
                                             activation_param=SLOPE)


def _sync_functional(x):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "InPlaceABNSync runs without", UserWarning)
        return iabn.distributed.inplace_abn_sync(x, None, None, training=True,
                                                 activation_param=SLOPE)


MODEL = nn.Sequential(nn.Sequential(nn.Identity(), iabn.InPlaceABN(C, dtype=torch.float64)))


LAYERS = {
    "functional": (_functional, "iabn.functional.inplace_abn"),
    "compat functional": (_compat_functional, "iabn.functional.inplace_abn"),
    "sync functional": (_sync_functional, "iabn.functional.inplace_abn"),
    "module in a model": (MODEL, "InPlaceABN '0.1'"),
    "compat module": (lambda x: iabn.compat.InPlaceABN(C).double()(x), "InPlaceABN"),
    "sync module": (lambda x: _sync_quietly(iabn.InPlaceABNSync(C).double())(x),
                    "InPlaceABNSync"),
    "compat sync module": (
        lambda x: _sync_quietly(iabn.compat.InPlaceABNSync(C).double())(x), "InPlaceABNSync"),
}


@pytest.mark.parametrize("name", LAYERS)
def test_every_in_place_layer_poisons(name):
    """The result equals the batch-norm reference (2e-14: ~50x the measured float64 difference,
    4.4e-16 max), the input is NaN and reading it raises with the layer's name."""
    call, label = LAYERS[name]
    leaf = _input().requires_grad_()
    with poison_overwritten():
        h = leaf.clone()
        out = call(h)
        assert out is not h
        assert _unchecked(h).isnan().all()
        with pytest.raises(OverwrittenTensorError, match=label.replace("'", ".")):
            h.sum()
        out.sum().backward()
    bn = nn.BatchNorm2d(C, affine=False, track_running_stats=False, dtype=torch.float64)
    expected = nn.LeakyReLU(SLOPE)(bn(_input()))
    if name in ("compat module", "compat sync module"):  # scale |weight| + eps, weight 1
        expected = nn.LeakyReLU(SLOPE)(bn(_input()) * (1 + 1e-5))
    torch.testing.assert_close(out.detach(), expected, atol=2e-14, rtol=0)
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


def test_views_and_bases_of_an_overwritten_tensor_are_caught_other_halves_are_not():
    layer_a, layer_b = iabn.InPlaceABN(2), iabn.InPlaceABN(2)
    with poison_overwritten():
        h = torch.randn(3, 4, 2, 2, requires_grad=True).clone()
        first, second = h[:, :2], h[:, 2:]
        layer_a(first)
        out_b = layer_b(second)  # the other channels: no overlap, no error
        assert not _unchecked(out_b).isnan().any()
        with pytest.raises(OverwrittenTensorError, match=r"shape \(3, 4, 2, 2\) shares memory"):
            torch.relu(h)
        with pytest.raises(OverwrittenTensorError):
            torch.cat([first[:, :1], out_b], 1)
        assert first.shape == (3, 2, 2, 2) and first.requires_grad  # metadata is no read


def test_a_saved_input_still_fails_at_backward():
    """The NaN fill moves the version counter, as the layer's own write does."""
    layer = iabn.InPlaceABN(C)
    with poison_overwritten():
        h = torch.randn(2, C, 3, 3, requires_grad=True).clone()
        saved = h.sin()  # sin saves h for its backward
        out = layer(h)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (out.sum() + saved.sum()).backward()


def test_leaves_are_still_rejected():
    with poison_overwritten(), pytest.raises(RuntimeError, match="leaf"):
        iabn.InPlaceABN(C)(torch.randn(2, C, 3, 3, requires_grad=True))


def test_no_reference_to_the_input_is_kept():
    layer = iabn.InPlaceABN(C)
    with poison_overwritten():
        h = torch.randn(2, C, 3, 3)
        out = layer(h)
        ref = weakref.ref(h)
        del h
        gc.collect()
        assert ref() is None
        assert not debug._poisoned
        kept = torch.randn(2, C, 3, 3)
        layer(kept)
        assert debug._poisoned
    assert not debug._poisoned and debug._ACTIVE == 0
    ref = weakref.ref(kept)
    del kept
    gc.collect()
    assert ref() is None and out.shape == (2, C, 3, 3)


def test_nested_and_decorator_use():
    layer = iabn.InPlaceABN(C)

    @poison_overwritten()
    def misuse():
        h = torch.randn(2, C, 3, 3)
        return layer(h) + h

    with poison_overwritten():
        with poison_overwritten():
            assert debug._ACTIVE == 2
        with pytest.raises(OverwrittenTensorError):
            misuse()
        assert debug._ACTIVE == 1
        h = torch.randn(2, C, 3, 3)
        layer(h)
        with pytest.raises(OverwrittenTensorError):
            h.mean()
    assert debug._ACTIVE == 0
    x = torch.randn(2, C, 3, 3)
    assert layer(x) is x


ENV_SCRIPT = """
import torch, iabn
layer = iabn.InPlaceABN(4)
h = torch.randn(2, 4, 3, 3)
try:
    layer(h) + h
except iabn.debug.OverwrittenTensorError:
    print("raised")
"""


def test_environment_variable_turns_the_mode_on():
    env = dict(os.environ, IABN_DEBUG_INPLACE="1")
    result = subprocess.run([sys.executable, "-c", ENV_SCRIPT], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "raised"


def test_environment_variable_values(monkeypatch):
    for value, expected in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(debug.ENV, value)
        assert debug._enabled_by_environment() is expected
    monkeypatch.setenv(debug.ENV, "yes")
    with pytest.raises(ValueError, match="IABN_DEBUG_INPLACE='yes'"):
        debug._enabled_by_environment()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_synchronised_layer_poisons_with_a_process_group():
    mp.spawn(dist_workers.run, args=(2, _free_port(), "debug_poisons"), nprocs=2, join=True)


def test_compiled_code_runs_unchecked_inside_the_mode():
    """Dynamo would trace the mode's hooks and registry; under torch.compile the layer runs in
    place as normal, with the eager layer's result (float64; measured difference 0, the same
    kernels run, so 1e-12 only absorbs a change of summation order)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(C, C, 1, dtype=torch.float64),
                          iabn.InPlaceABN(C, dtype=torch.float64))
    compiled = torch.compile(model, backend="eager")
    x = _input().requires_grad_()
    with warnings.catch_warnings():
        # torch warns that global module hooks (the mode's) fire for the compiled wrapper too
        warnings.filterwarnings("ignore", "Using `torch.compile", UserWarning)
        with poison_overwritten():
            out = compiled(x)
            out.sum().backward()
    expected = model(x.detach().clone())
    torch.testing.assert_close(out.detach(), expected.detach(), atol=1e-12, rtol=0)
    assert torch.isfinite(x.grad).all()
