"""Offloading saved activations to host memory: exact gradients, pool reuse, accounting.

Without CUDA the "device" is the CPU too: the same code path runs with plain copies (no CUDA
streams), so these tests check the logic. They model such a machine (``without_gpu``); the
CUDA path with streams and pinned memory is tested in tests/memory/test_offload_cuda.py.
"""

import pytest
import torch
from torch import nn

import iabn
from iabn.memory import saved_storages
from iabn.memory.offloading import DEFAULT_LAYERS, Offloader, OffloadModel, offload
from iabn.models import create

# where CUDA exists the offloader copies only device memory; these check its host-copy path
# (the CUDA path: tests/memory/test_offload_cuda.py).
pytestmark = pytest.mark.without_gpu


class Net(nn.Module):
    """conv -> InPlaceABN -> conv (+ skip) -> InPlaceABN -> maxpool -> conv -> mean."""

    def __init__(self, norm=lambda c: iabn.InPlaceABN(c)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.norm1 = norm(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.norm2 = norm(8)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        a = self.norm1(self.conv1(x))
        b = self.conv2(a) + a.clone()  # a skip connection (clone: a is overwritten next)
        return self.conv3(self.pool(self.norm2(b))).mean((2, 3))


def _grads(model, x, run):
    model.zero_grad()
    loss = run(x).square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _reference(seed=0):
    torch.manual_seed(seed)
    return Net()


X = torch.randn(4, 3, 16, 16)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_model_wrapper_gradients_are_bit_identical(prefetch):
    model = _reference()
    expected = _grads(model, X, model)
    wrapped = OffloadModel(model, min_bytes=0, prefetch=prefetch)
    for _ in range(3):  # pool allocated in the first iteration, reused later
        loss, grads = _grads(model, X, wrapped)
        assert torch.equal(loss, expected[0])
        for g, e in zip(grads, expected[1], strict=True):
            assert torch.equal(g, e)
    assert wrapped.stats.host_allocations == 0  # steady state: no new host buffers


def test_wrapper_offloads_exactly_the_conv_and_pool_inputs():
    model = _reference()
    wrapped = OffloadModel(model, min_bytes=0)
    wrapped(X).sum().backward()
    n = X.shape[0]
    conv_pool_inputs = [
        X,                                 # conv1 input (a leaf: offloaded, it is not a param)
        torch.empty(n, 8, 16, 16),         # conv2 input = norm1 output
        torch.empty(n, 8, 16, 16),         # pool input = norm2 output
        torch.empty(n, 8, 8, 8),           # conv3 input
    ]
    assert wrapped.stats.offloaded_bytes == sum(t.nbytes for t in conv_pool_inputs)
    # norm1's output is saved by InPlaceABN and conv2: transferred once
    assert wrapped.stats.transferred_bytes == wrapped.stats.offloaded_bytes


def test_context_manager_with_predicate_and_shared_pool():
    model = _reference()
    expected = _grads(model, X, model)
    off = Offloader(predicate=lambda t: t.dim() == 4, min_bytes=0)
    for _ in range(2):
        def run(x):
            with offload(offloader=off):
                return model(x)
        loss, grads = _grads(model, X, run)
        assert torch.equal(loss, expected[0])
        assert all(torch.equal(g, e) for g, e in zip(grads, expected[1], strict=True))
    assert off.stats.host_allocations == 0 and off.stats.offloaded_bytes > 0


def test_parameters_and_small_tensors_stay():
    model = _reference()
    off = Offloader(min_bytes=10**9)  # nothing is large enough
    with offload(offloader=off):
        out = model(X)
    assert off.stats.offloaded_bytes == 0 and off.stats.kept_bytes > 0
    out.sum().backward()

    # The convolutions save their weights, so parameters do reach the hooks...
    saved_shapes = {s.shape for s in saved_storages(lambda x: model(x), X)}
    assert {tuple(p.shape) for p in model.parameters() if p.dim() == 4} <= saved_shapes
    # ...but no parameter is ever even offered to the predicate, whatever its size.
    offered = []
    with offload(predicate=lambda t: offered.append(t) or True, min_bytes=0) as off2:
        model(X)
    assert off2.stats.offloaded_bytes > 0 and offered
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not parameters & {t.untyped_storage().data_ptr() for t in offered}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compression_halves_traffic_and_stays_close(dtype):
    model = _reference()
    expected = _grads(model, X, model)
    wrapped = OffloadModel(model, min_bytes=0, compress=dtype)
    loss, grads = _grads(model, X, wrapped)
    assert wrapped.stats.transferred_bytes * 2 == wrapped.stats.offloaded_bytes
    torch.testing.assert_close(loss, expected[0])  # forward is not affected
    # Every offloaded activation carries one rounding of the compressed dtype (relative
    # resolution eps); the gradient as a whole, measured as one vector, must stay within a
    # few of those. (Per tensor this is meaningless for gradients that are ~0 up to noise,
    # e.g. a conv bias followed by batch norm.)
    got = torch.cat([g.flatten() for g in grads])
    ref = torch.cat([e.flatten() for e in expected[1]])
    relative = ((got - ref).norm() / ref.norm()).item()
    assert 0 < relative <= 4 * torch.finfo(dtype).eps, relative


def test_shape_change_grows_pool_with_warning_and_stays_exact():
    model = _reference()
    wrapped = OffloadModel(model, min_bytes=0)
    wrapped(X).sum().backward()
    bigger = torch.randn(6, 3, 16, 16)
    expected = _grads(model, bigger, model)
    with pytest.warns(UserWarning, match="offload pool"):
        _, grads = _grads(model, bigger, wrapped)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected[1], strict=True))


def test_two_forwards_before_backward_do_not_share_buffers():
    model = _reference()
    wrapped = OffloadModel(model, min_bytes=0)
    wrapped(X).sum().backward()  # first iteration sizes the pool
    x2 = torch.randn_like(X)
    with pytest.warns(UserWarning, match="still held by a graph"):
        loss1 = wrapped(X).square().sum()
        loss2 = wrapped(x2).square().sum()
    model.zero_grad()
    (loss1 + loss2).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (model(X).square().sum() + model(x2).square().sum()).backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, model.parameters(), strict=True))


def test_offloaded_activations_free_device_memory_in_forward():
    """On CPU the "device" memory is the process heap: offloaded tensors are not kept."""
    model = _reference()
    off = Offloader(min_bytes=0)
    with offload(offloader=off):
        out = model(X)
    # every offloaded storage is now held only as a host copy in the pool
    live = [h() for h in off._order]
    assert all(h is not None and h.on_device is None for h in live)
    out.sum().backward()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"compress=torch\.float32"):
        Offloader(compress=torch.float32)
    with pytest.raises(ValueError, match="prefetch=-1"):
        Offloader(prefetch=-1)


def test_select_layers_by_name_and_counts_exclude_parameters():
    model = _reference()
    wrapped = OffloadModel(model, layers=lambda name, module: name == "conv3", min_bytes=0)
    wrapped(X).sum().backward()
    assert wrapped.stats.offloaded_bytes == X.shape[0] * 8 * 8 * 8 * 4  # conv3's input only
    eager = sum(s.nbytes for s in saved_storages(model, X))
    # kept + offloaded activations = what eager training keeps (parameters counted nowhere)
    assert wrapped.stats.kept_bytes + wrapped.stats.offloaded_bytes == eager


def test_wrapper_leaves_no_cycle_and_no_hooks_behind():
    import gc
    import weakref

    model = _reference()
    wrapped = OffloadModel(model, min_bytes=0)
    wrapped(X).sum().backward()
    pool = weakref.ref(wrapped.offloader.pool)
    gc.disable()
    try:
        del wrapped  # freed by reference counting alone: no cycle through the model's hooks
        assert pool() is None
    finally:
        gc.enable()
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_freed_and_reused_memory_is_not_mistaken_for_the_same_tensor():
    """An offloaded temporary is freed at once; the next one of the same size often gets the
    same address. It must still be saved as a tensor of its own."""
    leaf = torch.randn(64, 1024, requires_grad=True)
    expected = torch.autograd.grad(sum((leaf * k).sin().sum() for k in range(1, 6)), leaf)[0]
    with offload(min_bytes=0) as off:
        outs = [(leaf * k).sin() for k in range(1, 6)]  # each temporary dies right after sin
    got = torch.autograd.grad(sum(o.sum() for o in outs), leaf)[0]
    assert torch.equal(got, expected)
    assert off.stats.offloaded_bytes == 5 * leaf.nbytes


def test_no_reference_cycle_keeps_a_dropped_graph_alive():
    """A node that saves its own output (in-place LeakyReLU, InPlaceABN) must not be kept
    alive through the hooks' packed value once the graph is dropped."""
    import gc
    import weakref

    for run in (lambda m, x: OffloadModel(m, min_bytes=0)(x),
                lambda m, x: saved_storages(m, x) and None):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), iabn.InPlaceABN(8), nn.Conv2d(8, 8, 3),
                              nn.BatchNorm2d(8), nn.LeakyReLU(0.01, inplace=True))
        outputs = []  # weak references to every layer's output
        for layer in model:
            layer.register_forward_hook(
                lambda m, a, out, outputs=outputs: outputs.append(weakref.ref(out))
            )
        x = torch.randn(2, 3, 12, 12, requires_grad=True)
        gc.disable()
        try:
            result = run(model, x.clone())
            del result
            # freed by reference counting alone, i.e. no cycle holds the graph
            assert outputs and all(ref() is None for ref in outputs)
        finally:
            gc.enable()



def test_wrapper_counts_equal_the_rule_on_a_whole_network():
    """Kept/offloaded bytes of a ResNet-18 equal the rule (saved storages that are conv/pool
    inputs go) evaluated independently, with every conv/pool input held alive so that no
    address is reused. The wrapper sees freed conv inputs whose addresses later tensors get
    (allocator-dependent; this size showed it on the project's machine): it must not take
    those tensors for conv inputs."""
    torch.manual_seed(0)
    model = create("resnet18", norm_act="bn")
    x = torch.randn(2, 3, 40, 48)
    wrapped = OffloadModel(model, min_bytes=0)
    wrapped(x)
    held = []
    hooks = [m.register_forward_pre_hook(lambda _, args: held.append(args[0]))
             for m in model.modules() if isinstance(m, DEFAULT_LAYERS)]
    try:
        storages = {}
        state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in state:
                storages[key] = t.untyped_storage().nbytes()
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        inputs = {t.untyped_storage().data_ptr() for t in held}
        offloaded = sum(n for key, n in storages.items() if key in inputs)
        kept = sum(n for key, n in storages.items() if key not in inputs)
        del out
    finally:
        for hook in hooks:
            hook.remove()
    assert (wrapped.stats.offloaded_bytes, wrapped.stats.kept_bytes) == (offloaded, kept)


@pytest.mark.slow  # 11 s on 2 cores (compiling); the eager hooks are tested in the default run
def test_offload_context_moves_what_a_compiled_graph_saves():
    """Around a torch.compile'd model the hooks see the compiled graph's saved tensors at run
    time (the compiler does not trace Python hooks): they are offloaded, the host pool is
    reused, and gradients equal the compiled model's without offloading, bit for bit."""
    torch._dynamo.reset()
    model = _reference()
    compiled = torch.compile(model)
    expected = _grads(model, X, compiled)
    off = Offloader(min_bytes=0)

    def run(x):
        with offload(offloader=off):
            return compiled(x)

    for _ in range(2):
        loss, grads = _grads(model, X, run)
        assert torch.equal(loss, expected[0])
        assert all(torch.equal(g, e) for g, e in zip(grads, expected[1], strict=True))
        assert off.stats.offloaded_bytes > 0
    assert off.stats.host_allocations == 0  # second iteration: the pool is reused


@pytest.mark.slow
def test_offload_model_with_compiled_layers_and_compiled_wrapper():
    """OffloadModel picks layers with module hooks that run outside the compiler (a graph
    break each): a layer compiled inside the wrapped model, or the compiled wrapper, offload
    as in eager mode with eager gradients, bit for bit. A compiled model is refused when
    wrapped: hooks added after it compiled would be ignored (torch does not guard on them),
    silently."""
    eager_model = _reference()
    eager = OffloadModel(eager_model, min_bytes=0)
    expected = _grads(eager_model, X, eager)
    eager_stats = eager.stats

    torch._dynamo.reset()
    model = _reference()
    model.conv2.compile(backend="aot_eager")
    wrapped = OffloadModel(model, min_bytes=0)
    loss, grads = _grads(model, X, wrapped)
    assert torch.equal(loss, expected[0])
    assert all(torch.equal(g, e) for g, e in zip(grads, expected[1], strict=True))
    assert wrapped.stats == eager_stats and eager_stats.offloaded_bytes > 0

    torch._dynamo.reset()
    model = _reference()
    compiled_wrapper = torch.compile(OffloadModel(model, min_bytes=0), backend="aot_eager")
    loss, grads = _grads(model, X, compiled_wrapper)
    # aot_eager runs the same aten kernels, so bit for bit (Inductor's fusions would round
    # differently: measured, not bitwise)
    assert torch.equal(loss, expected[0])
    assert all(torch.equal(g, e) for g, e in zip(grads, expected[1], strict=True))
    assert compiled_wrapper.stats.offloaded_bytes > 0

    with pytest.raises(TypeError, match=r"model is torch.compile'd.*iabn\.offload\(\)"):
        OffloadModel(torch.compile(_reference()))
