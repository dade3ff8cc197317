"""The layer under use its authors did not plan for, against ``torch.nn`` in float64: empty
inputs (every backend), ``eps`` that is not a positive number, inputs whose elements share
memory, options assigned after construction, forward-mode AD and ``torch.func``, TorchScript.
Each case either matches ``nn.BatchNorm*`` + the activation or fails with a clear error before
anything is modified; none crashes the interpreter or returns NaN."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

import iabn
from iabn import compat, functional
from iabn.distributed import ABNSync, InPlaceABNSync

from helpers import (
    ACTIVATION_PARAMS,
    INVERTIBLE,
    randomise_,
    torch_activation,
    torch_batchnorm,
)

TESTS = Path(__file__).resolve().parent
SUPPORT = TESTS.parent / "support"
SRC = str(Path(iabn.__file__).resolve().parents[1])
LAYERS = (iabn.InPlaceABN, iabn.ABN, InPlaceABNSync, ABNSync)


def _run_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (so that a crash below Python fails one test, not the
    run) with this test's folder, tests/support and this source tree importable and this
    environment (the backend chosen by ``IABN_BACKEND``, ``TRITON_INTERPRET``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(SUPPORT), SRC])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


# ---- empty inputs ---------------------------------------------------------------------------

EMPTY_SHAPES = [(0, 3), (0, 3, 4), (0, 3, 2, 2), (2, 3, 0, 2), (2, 3, 0), (0, 3, 2, 2, 2),
                (2, 3, 2, 0, 2)]


def check_empty_inputs_in_eval(device: str) -> None:
    """Every layer and the functionals, eval mode, float64/float32/bfloat16, each empty shape
    (channels_last too): outputs, input gradients and parameter gradients (zeros: sums over
    no values) equal nn.BatchNorm + activation's, running statistics untouched. Run in a
    subprocess by the test below."""
    for shape, dtype, layer_cls in itertools.product(
        EMPTY_SHAPES, (torch.float64, torch.float32, torch.bfloat16), LAYERS
    ):
        for channels_last in (False, True) if len(shape) >= 4 else (False,):
            bn = randomise_(torch_batchnorm(len(shape), 3)).eval().to(device)
            layer = layer_cls(3).eval().to(device)
            layer.load_state_dict(bn.state_dict())
            if dtype == torch.float64:
                bn, layer = bn.double(), layer.double()
            fmt = ({4: torch.channels_last, 5: torch.channels_last_3d}[len(shape)]
                   if channels_last else torch.contiguous_format)
            x = torch.empty(shape, dtype=dtype, device=device).contiguous(memory_format=fmt)
            x.requires_grad_()
            ref_x = x.detach().clone().requires_grad_()
            out = layer(x.clone())
            ref = F.leaky_relu(bn(ref_x), 0.01)
            assert out.shape == ref.shape and out.dtype == ref.dtype, (shape, layer_cls)
            out.sum().backward()
            ref.sum().backward()
            assert x.grad.shape == shape
            for name in ("weight", "bias"):
                got, want = getattr(layer, name).grad, getattr(bn, name).grad
                assert torch.equal(got, want), (shape, dtype, layer_cls, name, got, want)
            for name in ("running_mean", "running_var"):
                assert torch.equal(getattr(layer, name), getattr(bn, name))
    for shape in EMPTY_SHAPES:
        w = torch.randn(3, device=device, requires_grad=True)
        stats = torch.zeros(3, device=device), torch.ones(3, device=device)
        x = torch.empty(shape, device=device, requires_grad=True)
        out = functional.inplace_abn(x.clone(), *stats, w, None, training=False)
        out.sum().backward()
        assert x.grad.shape == shape and torch.equal(w.grad, torch.zeros(3, device=device))
    print("checked", len(EMPTY_SHAPES), "shapes")


def test_empty_inputs_in_eval_match_batchnorm(backend, device):
    result = _run_python(f"""
        import test_hostile_use
        test_hostile_use.check_empty_inputs_in_eval({str(device)!r})
    """)
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    assert f"checked {len(EMPTY_SHAPES)} shapes" in result.stdout


# ---- eps --------------------------------------------------------------------------------------

BAD_EPS = [0, 0.0, -1e-5, float("nan"), float("inf"), "1e-5", None, torch.tensor(1e-5), True]


@pytest.mark.parametrize("eps", BAD_EPS, ids=repr)
@pytest.mark.parametrize("layer_cls", [*LAYERS, compat.InPlaceABN, compat.ABN])
def test_bad_eps_is_refused_at_construction(layer_cls, eps):
    with pytest.raises((ValueError, TypeError), match="eps="):
        layer_cls(4, eps=eps)


@pytest.mark.parametrize("eps", BAD_EPS, ids=repr)
@pytest.mark.parametrize("function", [functional.inplace_abn, functional.abn,
                                      functional.inplace_abn_sync])
def test_bad_eps_is_refused_by_the_functionals_before_writing(function, eps):
    x = torch.randn(4, 3, 2, 2)
    before = x.clone()
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    with pytest.raises((ValueError, TypeError), match="eps="):
        function(x, running_mean, running_var, training=True, eps=eps)
    assert torch.equal(x, before) and torch.equal(running_mean, torch.zeros(3))


def test_eps_zero_with_a_constant_channel_was_nan_and_is_refused():
    """The reported case: eps=-1e-5 on a constant channel made every output NaN."""
    x = torch.ones(8, 2, 5, 5)
    with pytest.raises(ValueError, match="eps=-1e-05"):
        iabn.InPlaceABN(2, eps=-1e-5)(x)
    assert torch.equal(x, torch.ones(8, 2, 5, 5))


@pytest.mark.parametrize("num_features", [-1, 0, 2.5, True, "4", None])
@pytest.mark.parametrize("layer_cls", LAYERS)
def test_bad_num_features_is_named(layer_cls, num_features):
    with pytest.raises((ValueError, TypeError), match="num_features="):
        layer_cls(num_features)


# ---- inputs whose elements share memory ---------------------------------------------------------


def _shares_memory(shape, stride) -> bool:
    """Independent answer: do two index tuples land on one storage offset?"""
    offsets = [sum(i * s for i, s in zip(index, stride, strict=True))
               for index in itertools.product(*map(range, shape))]
    return len(set(offsets)) < len(offsets)


def test_reported_partial_overlap_is_refused():
    base = torch.randn(4 * 3 * 9)
    x = base.as_strided((4, 3, 3, 3), (9, 3, 3, 1))  # rows of one channel share elements
    assert torch._debug_has_internal_overlap(x) == 2  # ATen: "too hard", not "yes"
    before = base.clone()
    layer = iabn.InPlaceABN(3)
    with pytest.raises(ValueError, match="share memory"):
        layer(x)
    assert torch.equal(base, before) and int(layer.num_batches_tracked) == 0


def test_strided_inputs_are_refused_exactly_when_elements_share_memory():
    """Random sizes and strides (incl. 0 and strides that interleave without overlapping):
    the layer refuses an input exactly when two of its elements share memory, and otherwise
    computes nn.BatchNorm2d + LeakyReLU on its values."""
    rng = random.Random(0)
    refused = accepted = 0
    for _ in range(300):
        shape = (rng.randint(2, 3), 2, rng.randint(1, 3), rng.randint(1, 3))
        stride = tuple(rng.randint(0, 9) for _ in shape)
        storage = torch.randn(200, dtype=torch.float64)
        x = storage.as_strided(shape, stride)
        values = x.clone()
        layer, bn = iabn.InPlaceABN(2).double(), nn.BatchNorm2d(2).double()
        if _shares_memory(shape, stride):
            with pytest.raises(ValueError, match="share memory"):
                layer(x)
            refused += 1
            continue
        out = layer(x)
        assert out is x
        # 10x the largest measured difference, 1.0e-15
        torch.testing.assert_close(out, F.leaky_relu(bn(values), 0.01), rtol=0, atol=1e-14)
        accepted += 1
    assert refused > 50 and accepted > 50, (refused, accepted)


# ---- tensors of other kinds --------------------------------------------------------------------


def _sparse():
    return torch.randn(2, 3, 4, 4).to_sparse()


def _nested():
    return torch.nested.nested_tensor([torch.randn(3, 4, 4), torch.randn(3, 5, 5)])


@pytest.mark.parametrize("make", [_sparse, _nested], ids=["sparse", "nested"])
@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, iabn.ABN])
def test_sparse_and_nested_inputs_are_named(layer_cls, make):
    """Were: "elements that share memory" (sparse) and torch's internal error (nested)."""
    layer = layer_cls(3)
    layer(torch.randn(2, 3, 4, 4))  # a valid call first: its signature is cached
    with pytest.raises(TypeError, match=r"sparse|nested"):
        layer(make())
    assert int(layer.num_batches_tracked) == 1


def test_inference_tensor_outside_inference_mode_is_refused_before_counting():
    """Was torch's in-place error from inside the kernel, after the batch was counted."""
    with torch.inference_mode():
        x = torch.randn(2, 3, 4, 4)
    layer = iabn.InPlaceABN(3)
    with pytest.raises(ValueError, match="inference tensor"):
        layer(x)
    assert int(layer.num_batches_tracked) == 0
    with torch.inference_mode():  # inside inference mode it is an ordinary in-place call
        ref = F.leaky_relu(nn.BatchNorm2d(3)(x.clone()), 0.01)
        torch.testing.assert_close(layer(x), ref, rtol=0, atol=0)  # measured: bitwise equal


# ---- options assigned after construction -----------------------------------------------------

BAD_OPTIONS = [
    ("activation", "relu"), ("activation", "swish"), ("activation_param", 0),
    ("activation_param", -1.0), ("activation_param", "a"), ("eps", 0), ("eps", -1e-5),
    ("momentum", "0.1"), ("gamma_mode", "absolute"), ("variant", 3), ("variant", 0),
    ("variant", True), ("num_features", 0),
]


@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS)
def test_bad_option_assigned_is_refused_like_the_constructor(name, value):
    with pytest.raises((ValueError, TypeError)) as at_construction:
        iabn.InPlaceABN(**{"num_features": 4, name: value})
    layer = iabn.InPlaceABN(4)
    before = getattr(layer, name)
    with pytest.raises(type(at_construction.value)) as on_assignment:
        setattr(layer, name, value)
    assert str(on_assignment.value) == str(at_construction.value)
    assert getattr(layer, name) == before


@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, ABNSync])
def test_relu_assigned_to_a_layer_that_inverts_is_refused(layer_cls):
    layer = layer_cls(4)
    with pytest.raises(ValueError, match="relu"):
        layer.activation = "relu"
    assert layer.activation == "leaky_relu"


@pytest.mark.parametrize("layer_cls", [iabn.InPlaceABN, iabn.ABN])
@pytest.mark.parametrize("training", [True, False])
def test_options_assigned_after_construction_take_effect(layer_cls, training):
    """A built layer switched to ELU(0.5) with eps=1e-3 and momentum=0.3 computes, and
    trains, exactly as BatchNorm2d(eps=1e-3, momentum=0.3) + ELU(0.5)."""
    torch.manual_seed(0)
    bn = randomise_(nn.BatchNorm2d(3, eps=1e-3, momentum=0.3)).double().train(training)
    layer = layer_cls(3).double().train(training)
    layer.load_state_dict(bn.state_dict())
    layer.activation, layer.activation_param = "elu", 0.5
    layer.eps, layer.momentum = 1e-3, 0.3
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    out, ref = layer(x.clone()), F.elu(bn(ref_x), 0.5)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    tol = dict(rtol=0, atol=2e-14)  # 11x the largest measured difference, 1.8e-15
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(x.grad, ref_x.grad, **tol)
    torch.testing.assert_close(layer.weight.grad, bn.weight.grad, **tol)
    torch.testing.assert_close(layer.running_var, bn.running_var, **tol)


@pytest.mark.parametrize("training", [True, False])
def test_one_running_statistic_set_to_none_is_refused_before_counting(training):
    layer = iabn.InPlaceABN(3).train(training)
    layer.running_mean = None
    x = torch.randn(4, 3, 2, 2)
    before = x.clone()
    with pytest.raises(ValueError, match="running_mean is None but running_var is not"):
        layer(x)
    assert int(layer.num_batches_tracked) == 0 and torch.equal(x, before)


# ---- forward-mode AD and torch.func -------------------------------------------------------------


def _pair(activation, training, track=True):
    torch.manual_seed(0)
    param = ACTIVATION_PARAMS[activation]
    bn = randomise_(nn.BatchNorm2d(3, track_running_stats=track)).double().train(training)
    layer = iabn.InPlaceABN(3, activation=activation, activation_param=param,
                            track_running_stats=track).double().train(training)
    layer.load_state_dict(bn.state_dict())
    return layer, nn.Sequential(bn, torch_activation(activation, param))


TOL = dict(rtol=0, atol=1e-14)  # 11x the largest measured difference, 8.9e-16 (float64)


@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("training", [True, False])
def test_forward_mode_ad_matches_batchnorm(activation, training):
    layer, reference = _pair(activation, training)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    tangent = torch.randn_like(x)
    with forward_ad.dual_level():
        out = layer(forward_ad.make_dual(x.clone(), tangent.clone()))
        ref = reference(forward_ad.make_dual(x.clone(), tangent.clone()))
        got, want = forward_ad.unpack_dual(out), forward_ad.unpack_dual(ref)
        torch.testing.assert_close(got.primal, want.primal, **TOL)
        torch.testing.assert_close(got.tangent, want.tangent, **TOL)
    torch.testing.assert_close(layer.running_mean, reference[0].running_mean, **TOL)


@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("training", [True, False])
def test_torch_func_jvp_and_grad_match_batchnorm(activation, training):
    """torch.func needs buffers it may not write in training, as for nn.BatchNorm:
    track_running_stats=False there. Tangents and gradients w.r.t. input and weight."""
    layer, reference = _pair(activation, training, track=not training)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    weight, bias = layer.weight.detach(), layer.bias.detach()

    def ours(x, w):
        return torch.func.functional_call(layer, {"weight": w, "bias": bias}, (x.clone(),))

    def theirs(x, w):
        return torch.func.functional_call(reference, {"0.weight": w, "0.bias": bias}, (x,))

    tangents = (torch.randn_like(x), torch.randn_like(weight))
    out, jvp = torch.func.jvp(ours, (x, weight), tangents)
    ref_out, ref_jvp = torch.func.jvp(theirs, (x, weight), tangents)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(jvp, ref_jvp, **TOL)
    grads = torch.func.grad(lambda x, w: ours(x, w).pow(2).sum(), argnums=(0, 1))(x, weight)
    ref_grads = torch.func.grad(lambda x, w: theirs(x, w).pow(2).sum(), argnums=(0, 1))(x, weight)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_vmap_in_eval_matches_batchnorm():
    layer, reference = _pair("leaky_relu", training=False)
    x = torch.randn(5, 4, 3, 2, 2, dtype=torch.float64)
    out = torch.func.vmap(lambda sample: layer(sample.clone()))(x)
    torch.testing.assert_close(out, reference(x.reshape(20, 3, 2, 2)).reshape(x.shape), **TOL)


@pytest.mark.parametrize("gamma_mode", ["signed", "abs"])
def test_gradcheck_forward_and_backward_mode(gamma_mode):
    """Against finite differences: the forward-mode derivatives (by composition) and the
    backward ones (the in-place Function) of the same function, a weight inside the clamp
    |w| < eps excluded (its derivative is a convention, not a limit)."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.tensor([1.3, -0.7], dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):
        return functional.inplace_abn(x.clone(), None, None, w, b, training=True,
                                      activation="elu", activation_param=0.8,
                                      gamma_mode=gamma_mode)

    assert torch.autograd.gradcheck(f, (x, w, b), check_forward_ad=True)


# ---- TorchScript --------------------------------------------------------------------------------


@pytest.mark.slow
def test_timm_inplace_abn_scripts_with_the_compat_layer():
    """timm's create_norm_act_layer(..., jit=True): the scripted layer calls iabn's compat
    function as Python, computes what the unscripted layer computes, and refuses export."""
    pytest.importorskip("timm")
    result = _run_python("""
        import io, warnings
        import torch
        warnings.simplefilter("ignore")
        import iabn.compat.enable  # noqa: F401
        from timm.layers import create_norm_act_layer
        torch.manual_seed(0)
        scripted = create_norm_act_layer("inplaceabn", 8, act_layer="leaky_relu", jit=True)
        plain = create_norm_act_layer("inplaceabn", 8, act_layer="leaky_relu", jit=False)
        assert isinstance(scripted, torch.jit.ScriptModule)
        x = torch.randn(2, 8, 3, 3, dtype=torch.float64)
        scripted.double(), plain.double()
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        (scripted(a * 1) ** 2).sum().backward()
        (plain(b * 1) ** 2).sum().backward()
        assert torch.equal(a.grad, b.grad) and torch.equal(scripted.running_var, plain.running_var)
        try:
            torch.jit.save(scripted, io.BytesIO())
        except RuntimeError as error:
            assert "Python function" in str(error)
        else:
            raise AssertionError("export of a Python call succeeded")
        print("scripted")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scripted" in result.stdout


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("layer_cls", LAYERS)
def test_scripting_iabn_layers_names_the_alternatives(layer_cls):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), layer_cls(4))
    with pytest.raises(RuntimeError, match=r"TorchScript.*torch\.compile"):
        torch.jit.script(model)
