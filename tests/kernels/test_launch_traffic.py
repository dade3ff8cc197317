"""The launch and traffic counter (``iabn.measure.traffic``) and what it says about the layers.

Every expected figure below is derived by hand from the operators a step calls and the rules
of ``iabn/traffic.py`` (comments give the derivation), in units of ``A``, the bytes of one
activation; nothing is taken from the counter itself. The step is
``layer(leaf.clone()).backward(grad)``, with float32 parameters (half inputs as under
``torch.autocast``).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import iabn
from iabn.kernels import common as cutting
from iabn.kernels.backends import use_backend
from iabn.measure import traffic

from helpers import INTERPRET, INVERTIBLE, randomise_

SHAPE = (4, 8, 6, 5)
SLOPE = 0.01


def _layers():
    bn = randomise_(nn.BatchNorm2d(SHAPE[1]))
    layers = {
        "bn": nn.Sequential(bn, nn.LeakyReLU(SLOPE, inplace=True)),
        "abn": iabn.ABN(SHAPE[1], activation_param=SLOPE),
        "reference": iabn.InPlaceABN(SHAPE[1], activation_param=SLOPE),
        "triton": iabn.InPlaceABN(SHAPE[1], activation_param=SLOPE),
    }
    for name, layer in layers.items():
        if name != "bn":
            layer.load_state_dict(bn.state_dict())
    return layers


def _count(name, layer, dtype=torch.float32, channels_last=False, training=True):
    if name == "triton":
        pytest.importorskip("triton")
        if not INTERPRET:
            pytest.skip("counts Triton under its CPU interpreter")
    layer.train(training)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    leaf = torch.randn(SHAPE).to(dtype).contiguous(memory_format=fmt).requires_grad_()
    grad = torch.randn(SHAPE).to(dtype).contiguous(memory_format=fmt)
    backend = {"reference": "reference", "triton": "triton"}.get(name)
    if backend is None:
        return traffic.count_step(layer, leaf, grad), leaf
    with use_backend(backend):
        return traffic.count_step(layer, leaf, grad), leaf


def _activations(counter, leaf):
    """(bytes read, bytes written) in activations."""
    a = leaf.numel() * leaf.element_size()
    return counter.read / a, counter.written / a


# ---- the counter's rules, on single operators ------------------------------------------------


def test_views_and_allocations_launch_nothing_and_in_place_reads_and_writes():
    x = torch.randn(SHAPE)
    a = x.numel() * 4
    with traffic.TrafficCounter(x.numel()) as counter:
        v = x.view(-1).as_strided(SHAPE, x.stride()).detach()
        e = torch.empty_like(x)
        e.copy_(v)            # copy_: reads the source, writes self without reading it
        e.mul_(2)             # in place: reads and writes self
        s = x.sum()           # reads x; writes a scalar (not full-size)
        torch.mul(x, x)       # x passed twice: read once; a new result written
        torch.abs(x, out=e)   # out=: written, not read
        torch.mul(s, s)       # scalars: a launch that moves no full-size bytes
    assert counter.names() == ["aten.copy_", "aten.mul_", "aten.sum", "aten.mul",
                               "aten.abs", "aten.mul"]
    assert [(launch.read, launch.written) for launch in counter.launches] == [
        (a, a), (a, a), (a, 0), (a, a), (a, a), (0, 0),
    ]


def test_batch_norm_passes():
    x, dy = torch.randn(SHAPE), torch.randn(SHAPE)
    w, b, m, v = torch.rand(8) + 0.5, torch.randn(8), torch.randn(8), torch.rand(8) + 0.5
    a = x.numel() * 4
    with traffic.TrafficCounter(x.numel()) as counter:
        torch.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)   # statistics, normalise
        torch.native_batch_norm(x, w, b, m, v, False, 0.1, 1e-5)       # normalise only
        backward = torch.ops.aten.native_batch_norm_backward
        backward(dy, x, w, None, None, m, v, True, 1e-5, [True, True, True])  # reduce + dx
        backward(dy, x, w, m, v, m, v, False, 1e-5, [True, False, False])     # dx = dy * k
        backward(dy, x, w, None, None, m, v, True, 1e-5, [False, True, True])  # reduce only
    assert [(launch.read, launch.written) for launch in counter.launches] == [
        (2 * a, a), (a, a), (4 * a, a), (a, a), (2 * a, 0),
    ]


def test_memory_peak_and_dtypes_of_allocations():
    x = torch.randn(SHAPE, dtype=torch.bfloat16)
    a = x.numel() * 2
    with traffic.TrafficCounter(x.numel()) as counter:
        y = x * 2            # +A
        z = y.float()        # +2A: a float32 copy
        del y                # -A
        w = torch.empty_like(x)  # +A (an allocation: no launch)
        del z, w
        torch.empty(3)       # not full-size
    assert counter.peak_bytes == 3 * a and counter.live_bytes == 0
    assert [(t.op, t.dtype) for t in counter.allocations] == [
        ("aten.mul", torch.bfloat16), ("aten._to_copy", torch.float32),
        ("aten.empty_like", torch.bfloat16),
    ]


def test_peak_of_every_allocation():
    """peak_all_bytes counts tensors of any size (slices of an activation, per-channel ones),
    peak_bytes and the traffic only full-size ones."""
    x = torch.randn(SHAPE)
    piece = x[:1, 2:5]   # 3 x 30 of 960 elements
    with traffic.TrafficCounter(x.numel()) as counter:
        p = piece.double()           # +720 bytes, not full-size
        q = torch.randn(8).mul(2)    # +32 bytes
        r = x * 2                    # +3840 bytes, full-size
        del p, q, r
    assert counter.peak_all_bytes == 720 + 32 + 3840 and counter.live_all_bytes == 0
    assert counter.peak_bytes == 3840 and counter.moved == 2 * 3840
    assert [(t.op, t.nbytes) for t in counter.allocations] == [("aten.mul", 3840)]


# ---- exact counts of whole steps -------------------------------------------------------------


def test_batch_norm_leaky_relu_step():
    """Forward: native_batch_norm reads x twice, writes y; leaky_relu_ reads and writes y:
    read 3A, written 2A. Backward: leaky_relu_backward reads dz and y, writes dy; the batch-norm
    backward reads dy and x for its sums and again for dx, writes dx: read 6A, written 2A.
    Allocated in backward: dy and dx, both alive at the batch-norm backward: peak 2A."""
    for name in ("bn", "abn"):
        step, leaf = _count(name, _layers()[name])
        # nn.BatchNorm2d counts the batch before computing, iabn.ABN after (so that a call
        # that fails is not counted): the same three launches.
        counted = ["aten.native_batch_norm", "aten.leaky_relu_"]
        counted.insert(0 if name == "bn" else 2, "aten.add_")
        assert step.forward.names() == counted
        assert step.backward.names() == ["aten.leaky_relu_backward",
                                         "aten.native_batch_norm_backward"]
        assert _activations(step.forward, leaf) == (3, 2)
        assert _activations(step.backward, leaf) == (6, 2)
        assert step.backward.peak_bytes == 2 * leaf.numel() * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_in_place_reference_step(dtype, channels_last):
    """Forward: native_batch_norm into x (x read twice, written), leaky_relu_ (read, write):
    read 3A, written 2A, plus the scale g's three per-channel operations. Backward: y =
    leaky_relu(z, 1/a) (read z, write y), leaky_relu_backward (read dz, z; write dy), 1/g and
    g^2 invstd, and the batch-norm backward (read dy and y twice, write dx): read 7A, written
    3A; y, dy and dx alive at once: peak 3A, all in the input's dtype."""
    step, leaf = _count("reference", _layers()["reference"], dtype, channels_last)
    # The layer counts the batch (add_) once the computation has succeeded.
    assert step.forward.names() == ["aten.abs", "aten.clamp_", "aten.copysign_",
                                    "aten.native_batch_norm", "aten.leaky_relu_", "aten.add_"]
    assert step.backward.names() == ["aten.leaky_relu", "aten.leaky_relu_backward",
                                     "aten.reciprocal", "aten.mul", "aten.mul_",
                                     "aten.native_batch_norm_backward"]
    assert _activations(step.forward, leaf) == (3, 2)
    assert _activations(step.backward, leaf) == (7, 3)
    assert step.backward.peak_bytes == 3 * leaf.numel() * leaf.element_size()


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_in_place_triton_step(channels_last):
    """Forward: moments (read x), finalize (per-channel), normalize_act (read and write x):
    read 2A, written 1A. Backward: grad_sums (read z, dz), finalize, input_grad (read z, dz;
    write dx): read 4A, written 1A; only dx is allocated: peak A."""
    step, leaf = _count("triton", _layers()["triton"], channels_last=channels_last)
    layout = "mc" if channels_last else "ncs"
    assert step.forward.names() == [f"triton.moments_{layout}_kernel",
                                    "triton.finalize_forward_kernel",
                                    "triton.normalize_act_kernel", "aten.add_"]
    assert step.backward.names() == [f"triton.grad_sums_{layout}_kernel",
                                     "triton.finalize_backward_kernel",
                                     "triton.input_grad_kernel"]
    assert _activations(step.forward, leaf) == (2, 1)
    assert _activations(step.backward, leaf) == (4, 1)
    assert step.backward.peak_bytes == leaf.numel() * 4


# ---- the targets -----------------------------------------------------------------------------


def _moved(step):
    return step.forward.moved + step.backward.moved


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
@pytest.mark.parametrize("activation,variant", [("elu", 2), ("leaky_relu", 1)])
@pytest.mark.parametrize("shape", [SHAPE, (32, 8, 3, 3), (40, 5)], ids=["n4", "n32", "2d"])
def test_float32_backward_of_half_inputs_works_in_pieces(
    dtype, training, channels_last, activation, variant, shape, monkeypatch,
):
    """elu and variant I compute a half input's y and dy in float32 (reference.full_dtype):
    no full-size float32 tensor is made, and the backward holds at most one activation (in
    the input's dtype) more than BatchNorm + the activation's, counting every allocation (the
    float32 slices it works on included)."""
    if channels_last and len(shape) != 4:
        pytest.skip("channels_last needs 4 dims")
    monkeypatch.setattr(cutting, "MIN_PIECE", 1)  # pieces at this tiny shape
    bn = randomise_(nn.BatchNorm2d(shape[1]) if len(shape) == 4 else nn.BatchNorm1d(shape[1]))
    act = nn.ELU(1.0, inplace=True) if activation == "elu" else nn.LeakyReLU(SLOPE, True)
    layer = iabn.InPlaceABN(shape[1], activation=activation,
                            activation_param=1.0 if activation == "elu" else SLOPE,
                            variant=variant)
    layer.load_state_dict(bn.state_dict())
    steps = {}
    for name, module in (("bn", nn.Sequential(bn, act)), ("iabn", layer)):
        module.train(training)
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        leaf = torch.randn(shape).to(dtype).contiguous(memory_format=fmt).requires_grad_()
        grad = torch.randn(shape).to(dtype).contiguous(memory_format=fmt)
        with use_backend("reference"):
            steps[name] = traffic.count_step(module, leaf, grad)
    a = leaf.numel() * leaf.element_size()
    backward = steps["iabn"].backward
    assert all(t.dtype == dtype for t in backward.allocations), backward.allocations
    assert backward.peak_all_bytes <= steps["bn"].backward.peak_all_bytes + a


@pytest.mark.parametrize("shape,parts,expected", [
    ((40, 3, 5), 16, [(slice(a, a + 2),) for a in range(0, 40, 2)]),      # along N, 2 each
    ((2, 3, 4, 5), 8, [(slice(i, i + 1), slice(None), slice(a, a + 5))   # N < parts: and L
                       for i in range(2) for a in range(0, 20, 5)]),
    ((3, 2, 2), 16, [(slice(i, i + 1), slice(None), slice(a, a + 1))     # 1 position each
                     for i in range(3) for a in range(2)]),
])
def test_pieces_cut_whole_channels_into_at_most_one_part_in(shape, parts, expected,
                                                             monkeypatch):
    monkeypatch.setattr(cutting, "MIN_PIECE", 1)
    x = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
    (view,), index = cutting.pieces(x, parts=parts)
    assert index == expected
    assert all(view[at].numel() <= max(x.numel() // parts, shape[1]) for at in index)
    covered = torch.zeros_like(view)
    for at in index:
        covered[at] += 1
    assert torch.equal(covered, torch.ones_like(view))   # every element once


def test_pieces_leave_small_activations_whole():
    """Each part repeats its operations' launches: below PIECES * MIN_PIECE elements fewer
    parts, one below twice MIN_PIECE (the layer's launches stay those of one pass)."""
    small = torch.empty(2 * cutting.MIN_PIECE - 1, 1)
    assert len(cutting.pieces(small)[1]) == 1
    assert len(cutting.pieces(torch.empty(5 * cutting.MIN_PIECE, 1))[1]) == 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_half_inputs_make_no_float32_copies(dtype, training, channels_last):
    """No full-size float32 tensor in the reference layer's step, and its backward holds at
    most one activation (in the input's dtype) more than BatchNorm + LeakyReLU's backward."""
    layers = _layers()
    base, _ = _count("bn", layers["bn"], dtype, channels_last, training)
    step, leaf = _count("reference", layers["reference"], dtype, channels_last, training)
    allocated = step.forward.allocations + step.backward.allocations
    assert allocated and all(a.dtype == dtype for a in allocated), allocated
    assert (step.backward.peak_bytes
            <= base.backward.peak_bytes + leaf.numel() * leaf.element_size())
    # the same tensor-sizes as float32 (15 A training: see test_in_place_reference_step)
    assert _moved(step) / (leaf.numel() * leaf.element_size()) == (15 if training else 13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_triton_moves_at_most_065_of_batch_norm(dtype, training):
    layers = _layers()
    base, _ = _count("bn", layers["bn"], dtype, training=training)
    step, _ = _count("triton", layers["triton"], dtype, training=training)
    assert _moved(step) <= 0.65 * _moved(base)


def test_reference_training_float32_against_batch_norm():
    """15 A against 13 A (1.154x): the inversion y = phi^-1(z) is one write and one read more
    than BatchNorm + LeakyReLU, and no ATen kernel fuses it into the batch-norm backward.
    Launches: 12 against 5 (the scale's 3 and the identity's 3 per-channel operations, and
    the inversion)."""
    layers = _layers()
    base, _ = _count("bn", layers["bn"])
    step, _ = _count("reference", layers["reference"])
    assert _moved(step) * 13 == _moved(base) * 15
    launches = len(step.forward.launches) + len(step.backward.launches)
    assert launches == len(base.forward.launches) + len(base.backward.launches) + 7


# ---- the declarations of the Triton kernels --------------------------------------------------


def _bits(t):
    return t.detach().reshape(-1).view(torch.uint8)


def test_triton_kernels_write_only_what_they_declare():
    """Every tensor argument a kernel changes is declared written, and every full-size one
    declared written is changed (TRAFFIC is what the counter's bytes come from)."""
    pytest.importorskip("triton")
    if not INTERPRET:
        pytest.skip("checks the kernels under Triton's CPU interpreter")
    from iabn.kernels import triton_kernels

    changed: dict[str, set[str]] = {}
    numel = torch.Size(SHAPE).numel()

    def checked(name, kernel):
        original = type(kernel).run.__get__(kernel)
        written = set(triton_kernels.TRAFFIC[name].writes)

        def run(*args, grid, warmup, **kwargs):
            values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
            tensors = {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}
            before = {n: _bits(t).clone() for n, t in tensors.items()}
            out = original(*args, grid=grid, warmup=warmup, **kwargs)
            # placeholders may alias a written argument (parts = coeffs in eval mode)
            written_memory = {tensors[n].data_ptr() for n in written if n in tensors}
            for n, t in tensors.items():
                if not torch.equal(_bits(t), before[n]):
                    assert n in written or t.data_ptr() in written_memory, (name, n)
                    if n in written:
                        changed.setdefault(name, set()).add(n)
                elif n in written and t.numel() == numel:
                    raise AssertionError(f"{name} declares {n} written, left it unchanged")
            return out

        return run

    kernels = [getattr(triton_kernels, name) for name in triton_kernels.TRAFFIC]
    try:
        for name, kernel in zip(triton_kernels.TRAFFIC, kernels, strict=True):
            kernel.run = checked(name, kernel)
        for channels_last, training, activation in itertools.product(
                (False, True), (True, False), ("leaky_relu", "silu")):
            layer = _layers()["triton"].train(training)
            layer.activation = activation
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            x = torch.randn(SHAPE).contiguous(memory_format=fmt).requires_grad_()
            grad = torch.randn(SHAPE).contiguous(memory_format=fmt)
            with use_backend("triton"):
                layer(x.clone()).backward(grad)
        # the activation layers without a norm: their backward's one kernel
        x = torch.randn(SHAPE).requires_grad_()
        with use_backend("triton"):
            iabn.InPlaceSiLU()(x.clone()).backward(torch.randn(SHAPE))
        # the output-only layer norm's backward: its one kernel
        x = torch.randn(SHAPE).requires_grad_()
        with use_backend("triton"):
            iabn.InPlaceLayerNorm(SHAPE[-1])(x.clone()).backward(torch.randn(SHAPE))
    finally:
        for kernel in kernels:
            kernel.__dict__.pop("run", None)
    assert changed["normalize_act_kernel"] == {"x_ptr"}
    assert changed["normalize_branch_kernel"] == {"x_ptr", "bits_ptr"}
    assert changed["input_grad_kernel"] == {"dx_ptr"}
    assert changed["activation_grad_kernel"] == {"dx_ptr"}
    assert changed["row_norm_grad_kernel"] == {"dx_ptr", "parts_ptr"}
    assert set(changed) == set(triton_kernels.TRAFFIC)


def test_nested_counters_stay_distinct():
    """Leaving an inner counter leaves the outer one active, even with equal figures (Triton
    launches are recorded to the innermost active counter)."""
    with traffic.TrafficCounter(10) as outer:
        with traffic.TrafficCounter(10):
            pass
        assert len(traffic._ACTIVE) == 1 and traffic._ACTIVE[0] is outer
    assert traffic._ACTIVE == []


def test_undeclared_full_size_argument_is_refused():
    counter = traffic.TrafficCounter(10)
    with pytest.raises(ValueError, match="declare it"):
        counter.record_triton("k", [], [], [torch.zeros(10)])


# ---- numerics of the backward paths these counts changed ------------------------------------


def _grads(layer, x, grad, frozen):
    for p in layer.parameters():
        p.requires_grad_(not frozen)
    leaf = x.clone().requires_grad_()
    layer(leaf.clone() if isinstance(layer, iabn.InPlaceABN) else leaf).backward(grad)
    params = [] if frozen else [p.grad.double() for p in layer.parameters()]
    return [leaf.grad.double(), *params]


@pytest.mark.parametrize("activation", INVERTIBLE)
@pytest.mark.parametrize("variant", [1, 2])
@pytest.mark.parametrize("frozen", [False, True], ids=["with_param_grads", "frozen"])
def test_eval_mode_gradients_match_torch_float64(activation, variant, frozen, backend,
                                                 device):
    """Eval mode: dx = dy * g * invstd from the eval-mode batch-norm backward, with or without
    parameter gradients (frozen: neither y nor the sums are computed)."""
    from helpers import ACTIVATION_PARAMS, torch_activation

    param = ACTIVATION_PARAMS[activation] or 0.01
    bn = randomise_(nn.BatchNorm2d(6)).double().to(device).eval()
    layer = iabn.InPlaceABN(6, activation=activation, activation_param=param,
                            variant=variant).double().to(device).eval()
    layer.load_state_dict(bn.state_dict())
    reference = nn.Sequential(bn, torch_activation(activation, param))
    for channels_last in (False, True):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        x = (torch.randn(4, 6, 5, 3, dtype=torch.float64) * 2).to(device).contiguous(
            memory_format=fmt)
        grad = torch.randn_like(x)
        for ours, want in zip(_grads(layer, x, grad, frozen), _grads(reference, x, grad, frozen),
                              strict=True):
            torch.testing.assert_close(ours, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("frozen", [False, True], ids=["with_param_grads", "frozen"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels_last"])
def test_half_eval_mode_within_twice_torch_error(dtype, frozen, channels_last):
    """As tests/core/test_dtypes.py, in eval mode: the input and bias gradients within twice the
    error of PyTorch's own BatchNorm2d + LeakyReLU in ``dtype`` (float32 parameters), both
    against float64 (the weight gradient has test_dtypes' documented exception)."""
    bn = randomise_(nn.BatchNorm2d(6)).eval()
    layer = iabn.InPlaceABN(6, activation_param=SLOPE).eval()
    layer.load_state_dict(bn.state_dict())
    bn64 = randomise_(nn.BatchNorm2d(6)).double().eval()
    bn64.load_state_dict(bn.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(4, 6, 7, 5) * 3 + 1).to(dtype).contiguous(memory_format=fmt)
    grad = torch.randn(4, 6, 7, 5).to(dtype).contiguous(memory_format=fmt)
    want = _grads(nn.Sequential(bn64, nn.LeakyReLU(SLOPE)), x.double(), grad.double(), frozen)
    theirs = _grads(nn.Sequential(bn, nn.LeakyReLU(SLOPE)), x, grad, frozen)
    ours = _grads(layer, x, grad, frozen)
    for index in (0, 2) if not frozen else (0,):  # dx, dbias
        allowed = (theirs[index] - want[index]).abs().max().item()
        error = (ours[index] - want[index]).abs().max().item()
        assert error <= 2 * allowed + 1e-6, (index, error, allowed)


def test_script_writes_its_rows(tmp_path):
    """benchmarks/launch_traffic.py at a tiny shape, float32 only: the rows and their ratios."""
    import json
    from pathlib import Path

    from helpers import load_script

    script = load_script(Path(__file__).parents[2] / "benchmarks" / "launch_traffic.py")
    path = tmp_path / "traffic.json"
    assert script.main(["--shape", "2", "4", "3", "3", "--quick", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["shape"] == [2, 4, 3, 3] and report["machine"]["torch_version"]
    rows = {(r["provider"], r["layout"], r["mode"]): r for r in report["rows"]}
    assert rows["bn", "nchw", "train"]["activations_moved"] == 13
    assert rows["iabn_reference", "channels_last", "train"]["bytes_vs_bn"] == 15 / 13
    assert rows["iabn_reference", "nchw", "eval"]["launches_vs_bn"] == 9
    assert script.main(["--shape", "2", "0", "3", "3"]) == 2
