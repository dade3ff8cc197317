"""torch.library registration: opcheck, and compiled training steps against eager."""

import copy

import pytest
import torch
from torch import nn

import iabn
from iabn import ops


def _on(device, args):
    """The operator's arguments with every tensor moved to ``device``."""
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def _forward_samples():
    c = 5
    weight, bias = torch.rand(c) + 0.5, torch.randn(c)
    for training in (True, False):
        for shape, fmt in (((3, c, 4, 6), torch.contiguous_format),
                           ((3, c, 4, 6), torch.channels_last), ((4, c), None)):
            x = torch.randn(shape)
            if fmt is not None:
                x = x.contiguous(memory_format=fmt)
            yield (x, weight, bias, torch.zeros(c), torch.ones(c), training, 0.1, 1e-5,
                   "leaky_relu", 0.01, "signed")
    yield (torch.randn(2, c, 3, dtype=torch.bfloat16), None, None, None, None, True, 0.1,
           1e-5, "elu", 1.0, "abs")


@pytest.mark.parametrize("args", list(_forward_samples()), ids=lambda a: str(tuple(a[0].shape)))
def test_opcheck_forward(args, backend, device):
    torch.library.opcheck(ops.inplace_abn_forward_, _on(device, args))


def _backward_samples():
    c = 4
    z = torch.nn.functional.leaky_relu(torch.randn(3, c, 5, 2), 0.01)
    for training in (True, False):
        for variant in (1, 2):
            for mask in ([True, True, True], [False, True, False], [True, False, False]):
                weight = torch.rand(c) + 0.5
                yield (z, torch.randn_like(z), weight, torch.randn(c), torch.rand(c) + 0.5,
                       weight.clone(), training, 1e-5, "leaky_relu", 0.01, "signed", variant,
                       mask)
    yield (z, torch.randn_like(z), None, None, torch.rand(c) + 0.5, torch.ones(c), True, 1e-5,
           "identity", 0.0, "signed", 2, [True, False, False])


@pytest.mark.parametrize("args", list(_backward_samples()))
def test_opcheck_backward(args, backend, device):
    torch.library.opcheck(ops.inplace_abn_backward, _on(device, args))


# Compiled against eager, float32, after SGD steps: Inductor reorders the sums of the
# convolutions and reductions. Largest difference measured on CPU (torch 2.14.1; reference and
# Triton-interpreter backends; every comparison below): 2.4e-7, so the CPU tolerance 4e-6 is ~17x
# that. CUDA is not measured yet (no GPU was lent to the sessions that wrote this); it keeps the
# earlier 1e-4 until a GPU run measures it.
def _tolerance(device):
    bound = 4e-6 if torch.device(device).type == "cpu" else 1e-4
    return {"atol": bound, "rtol": bound}


def _model(norm_act):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), norm_act(8), nn.Conv2d(8, 8, 3, padding=1),
        norm_act(8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def _train(model, forward, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("channels_last", [False, True])
def test_compiled_training_matches_eager(channels_last, backend, device):
    torch._dynamo.reset()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    eager = _model(lambda c: iabn.InPlaceABN(c)).to(device, memory_format=fmt)
    compiled = copy.deepcopy(eager)
    batches = [
        (torch.randn(6, 3, 8, 8).to(device).contiguous(memory_format=fmt),
         torch.randint(0, 4, (6,)).to(device))
        for _ in range(3)
    ]
    losses_eager = _train(eager, eager, batches)
    losses_compiled = _train(compiled, torch.compile(compiled, fullgraph=True), batches)
    torch.testing.assert_close(losses_compiled, losses_eager, **_tolerance(device))
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(b, a, **_tolerance(device), msg=name)


def test_compile_has_no_graph_breaks():
    torch._dynamo.reset()
    model = _model(lambda c: iabn.InPlaceABN(c, activation="elu", activation_param=1.0))
    explanation = torch._dynamo.explain(model)(torch.randn(2, 3, 8, 8))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_graphs_call_the_registered_operators():
    """Forward and backward graphs contain our opaque operators, not decomposed aten ops."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    model = _model(lambda c: iabn.InPlaceABN(c))
    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                             fullgraph=True)
    compiled(torch.randn(4, 3, 8, 8)).sum().backward()
    forward_graph, backward_graph = graphs
    assert forward_graph.count("iabn.inplace_abn_forward_") == 2
    assert backward_graph.count("iabn.inplace_abn_backward") == 2


@pytest.mark.parametrize("training", [True, False])
def test_inductor_compiles_layers_on_1x1_feature_maps(training, backend, device):
    """A regression test: at 1x1 spatial size Inductor gives a convolution's output strides
    that differ from the traced tensor's only in size-1 dimensions. Under the default
    fixed-stride-order constraint Inductor copied the mutated input to the traced strides and
    its scheduler then failed (``KeyError: 'op5'``, torch 2.13) -- every ResNet-18 with a 32x32
    input reaches 1x1 maps. The forward operator is tagged ``flexible_layout`` (its kernels take
    any strides), which this test checks through a compiled run against eager. Inductor's
    caches are off: their keys do not include the operator's tags, so code compiled after the
    fix made this test pass with the fix reverted (seen)."""
    from iabn.models.norm_act import norm_act_factory
    from iabn.models.resnet import BasicBlock

    torch._dynamo.reset()
    torch.manual_seed(0)
    make = norm_act_factory("iabn", "leaky_relu", 0.01)
    eager = nn.Sequential(
        BasicBlock(8, 8, 1, make, "leaky_relu", 0.01), nn.Flatten(), nn.Linear(8, 4)
    ).train(training).to(device)
    compiled = copy.deepcopy(eager)
    batches = [(torch.randn(6, 8, 1, 1).to(device), torch.randint(0, 4, (6,)).to(device))
               for _ in range(2)]
    with torch._inductor.config.patch(force_disable_caches=True):
        losses_eager, losses_compiled = _eager_and_compiled(eager, compiled, batches, training)
    torch.testing.assert_close(losses_compiled, losses_eager, **_tolerance(device))
    for (name, a), b in zip(eager.state_dict().items(), compiled.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(b, a, **_tolerance(device), msg=name)


def _eager_and_compiled(eager, compiled, batches, training):
    """Losses of training steps (or outputs in eval mode) of both models on the batches."""
    if training:
        losses_eager = _train(eager, eager, batches)
        losses_compiled = _train(compiled, torch.compile(compiled, fullgraph=True), batches)
    else:
        with torch.no_grad():
            losses_eager = torch.stack([eager(x) for x, _ in batches])
            losses_compiled = torch.stack([torch.compile(compiled)(x) for x, _ in batches])
    return losses_eager, losses_compiled


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compiled_layer_on_a_graph_input_has_eager_gradients(compiler, backend, device):
    """A regression test: when the tensor the layer overwrites is an input of the compiled
    graph (the layer compiled alone, a graph break just before it, a compiled pre-activation
    block), torch 2.13's compiler loses ``ctx.mark_dirty`` and backward passed ``dz`` through
    as ``dx`` (pytorch/pytorch#184113; measured error 3.9 here). Float64, against eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = iabn.InPlaceABN(5).double().to(device)
    data = torch.randn(3, 5, 4, 4, dtype=torch.float64).to(device)

    def gradients(run):
        layer.zero_grad(set_to_none=True)
        leaf = data.clone().requires_grad_()
        run(leaf * 1.5).square().sum().backward()
        return leaf.grad, layer.weight.grad, layer.bias.grad

    def with_break(x):
        torch._dynamo.graph_break()
        return layer(x)

    expected = gradients(layer)
    with torch._inductor.config.patch(force_disable_caches=True):
        for run in (torch.compile(layer, backend=compiler),
                    torch.compile(with_break, backend=compiler)):
            for got, want in zip(gradients(run), expected, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_dynamic_shapes_and_export():
    """``torch.compile(dynamic=True)`` trains over changing batch and image sizes as eager
    does, and ``torch.export`` of an eval-mode model reproduces its outputs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _model(lambda c: iabn.InPlaceABN(c))
    compiled = copy.deepcopy(eager)
    forward = torch.compile(compiled, dynamic=True)
    for batch, size in ((6, 8), (5, 10), (7, 6)):
        x, y = torch.randn(batch, 3, size, size), torch.randint(0, 4, (batch,))
        torch.testing.assert_close(_train(compiled, forward, [(x, y)]),
                                   _train(eager, eager, [(x, y)]), **_tolerance("cpu"))
    eager.eval()
    x = torch.randn(2, 3, 8, 8)
    exported = torch.export.export(eager, (x.clone(),))
    torch.testing.assert_close(exported.module()(x.clone()), eager(x.clone()))
