"""The planner's time model: operations counted, the device's speed measured once.

Each ATen operation a forward (or backward) runs is counted with a ``TorchDispatchMode``: its
floating-point operations by PyTorch's own formulas (``torch.utils.flop_counter``'s registry:
convolutions, matrix products, attention; other operations count 0) and its bytes moved as
the sizes of its tensor inputs and outputs (views, which move nothing, are not counted;
allocations count no bytes). An operation's predicted time is a roofline:

    t = overhead + max(flops / compute rate, bytes / bandwidth)

(or, for the products and the elementwise transcendental functions, :data:`COMPUTE_BOUND`,
the call's time measured on the device: :func:`product_seconds`) with the device's rates
measured by a short calibration (a square matrix product; the
memory-bound operations of a convolutional network's layer, batch norm in training, ReLU in
place and a residual addition, whose bytes are counted as above; a tiny operation repeated;
the fastest of a few runs each), once per process for each device, dtype and CPU thread
count. The memory-bound rate is taken from those operations rather than from a copy because
they are what a recomputation runs: on the 2-core CPU used for development batch norm + ReLU
moved their counted bytes at 8.3 GB/s where a copy moved 27 (a copy's rate predicted a third
of their time). A recomputed run also costs host time that no operation's roofline has:
``torch.utils.checkpoint``'s Python hooks for every saved tensor, the save and restore of the
run's buffers, and for selective recomputation its dispatch modes; the calibration measures it
per forward operation on a training step of tiny layers (on the 2-core CPU: 32 us for
recomputation, 78 us for selective recomputation) and the prediction of a recomputed run adds
it per operation the run's forward runs. On CUDA the host-device copy bandwidth (pinned memory) is
measured too, for offloading. Counting needs shapes only, so it works on the ``meta``
device; the rates come from a real device. The predictions are a model:
``benchmarks/plan_anchors.py`` compares them with measured step times.
"""

from __future__ import annotations

import platform
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import caches
from .selective import is_expansion, is_product, product_flops

REST = -1  # operations outside every unit

_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default}


@dataclass(frozen=True)
class DeviceSpeed:
    """Measured rates of one device for one dtype."""

    device: str
    name: str
    dtype: str
    threads: int
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float
    pcie_bytes_per_s: float | None = None  # CUDA: pinned host <-> device copies
    #: extra host time per forward operation of a recomputed run, beyond the operations' own
    #: time: checkpoint's saved-tensor hooks and the buffers' save and restore
    recompute_overhead_s: float = 0.0
    #: the same for a selectively recomputed run, whose operations also run under a Python
    #: dispatch mode in forward and in the recomputation
    selective_overhead_s: float = 0.0
    #: whether a product with a recorded call (:class:`ProductCall`) takes its measured time
    #: on this device (:func:`product_seconds`) instead of the roofline's; :func:`calibrate`
    #: sets it, a speed made by hand (fixed figures, for a decision that must not follow the
    #: wall clock) leaves it off
    measures_products: bool = False

    def seconds(self, flops: float, nbytes: float) -> float:
        return self.op_overhead_s + max(flops / self.flops_per_s, nbytes / self.bytes_per_s)

    def op_seconds(self, op: Op) -> float:
        """One counted operation's predicted time: a product's measured time where this speed
        measures products and the product could run here, else the roofline."""
        if self.measures_products and op.call is not None:
            measured = product_seconds(op.call, self)
            if measured is not None:
                return measured
        return self.seconds(op.flops, op.bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SPEEDS: dict[tuple, DeviceSpeed] = {}


def _seconds_once(fn: Callable[[], Any], device: torch.device) -> float:
    """One run of ``fn``, timed to its end on the device (CUDA: synchronised)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _best_seconds(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` runs after one untimed: the device's speed, least disturbed
    by other work on the machine."""
    _seconds_once(fn, device)
    return min(_seconds_once(fn, device) for _ in range(repeats))


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def calibrate(device: torch.device | str, dtype: torch.dtype = torch.float32) -> DeviceSpeed:
    """The rates of ``device`` for ``dtype`` (measured on first use, then remembered for the
    process; about half a second on a CPU)."""
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("calibrate: the meta device has no speed; give a real device")
    if not dtype.is_floating_point:
        dtype = torch.float32
    threads = torch.get_num_threads()
    key = (str(device), _device_name(device), dtype, threads)
    if key in _SPEEDS:
        return _SPEEDS[key]
    n = 1024 if device.type == "cuda" else 384
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    mm = _best_seconds(lambda: torch.mm(a, b, out=out), device, 15)
    flops = 2 * n**3 / mm
    bandwidth = _memory_bound_rate(device, dtype)
    tiny_a = torch.ones(1, device=device, dtype=dtype)
    tiny_out = torch.empty_like(tiny_a)
    count = 200

    def tiny() -> None:
        for _ in range(count):
            torch.add(tiny_a, tiny_a, out=tiny_out)

    overhead = _best_seconds(tiny, device, 15) / count

    pcie = None
    if device.type == "cuda":
        src = torch.ones(64 * 2**20, device=device, dtype=torch.float32)
        host = torch.empty(src.numel(), dtype=torch.float32, pin_memory=True)
        pcie = src.numel() * 4 / _best_seconds(
            lambda: host.copy_(src, non_blocking=True), device, 5)
    speed = DeviceSpeed(str(device), _device_name(device), str(dtype).removeprefix("torch."),
                        threads, flops, bandwidth, overhead, pcie, measures_products=True)
    speed = replace(speed, **_recompute_overheads(speed, device, dtype))
    _SPEEDS[key] = speed
    return speed


def _recompute_overheads(speed: DeviceSpeed, device: torch.device,
                         dtype: torch.dtype) -> dict[str, float]:
    """``recompute_overhead_s`` and ``selective_overhead_s``: a training step of twelve tiny
    conv + batch norm + ReLU layers (host cost only) timed plainly, recomputed and recomputed
    selectively; what each costs beyond the plain step and the roofline's prediction of the
    operations it runs again, per forward operation."""
    from .wrappers import recomputed

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[m for _ in range(12) for m in (
        torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True))])
    layers = layers.to(device=device, dtype=dtype).train()
    x = torch.ones(2, 4, 2, 2, device=device, dtype=dtype, requires_grad=True)
    modules = list(layers)
    counter = OpCounter()
    with counter, torch.no_grad():
        layers(x)
    ops = counter.counts[REST]
    steps = {"plain": lambda: layers(x).sum().backward(),
             "recompute": lambda: recomputed(layers, modules, x).sum().backward(),
             "selective": lambda: recomputed(layers, modules, x,
                                             selective=True).sum().backward()}
    seconds = {name: _best_seconds(step, device, 10) for name, step in steps.items()}
    again = {"recompute": ops.seconds(speed),
             "selective": ops.seconds(speed, lambda op: not op.product)}
    return {f"{name}_overhead_s": max(0.0, (seconds[name] - seconds["plain"] - again[name])
                                      / len(ops.ops)) for name in again}


def _memory_bound_rate(device: torch.device, dtype: torch.dtype) -> float:
    """Bytes per second of batch norm (training) + ReLU in place + a residual addition on one
    layer-sized activation (32 MiB in float32 on CUDA, 4 MiB on a CPU), the bytes counted as
    :class:`OpCounter` counts them."""
    shape = (32, 64, 64, 64) if device.type == "cuda" else (4, 64, 64, 64)
    x = torch.randn(shape, device=device, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.ones(shape[1], device=device, dtype=torch.float32)
    bias = torch.zeros_like(weight)

    def layer() -> None:
        with torch.no_grad():
            y = torch.nn.functional.batch_norm(x, None, None, weight.to(dtype),
                                               bias.to(dtype), True)
            y.relu_().add_(residual)

    counter = OpCounter()
    with counter:
        layer()
    nbytes = sum(count.bytes for count in counter.counts.values())
    return nbytes / _best_seconds(layer, device, 10)


class _TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _frozen(value: Any) -> Any:
    """``value`` (an argument of an ATen operation) hashable: tensors as their shape, strides
    and dtype, lists as tuples."""
    if isinstance(value, Tensor):
        return _TensorSpec(tuple(value.shape), tuple(value.stride()), value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _random_like(spec: _TensorSpec, device: torch.device) -> Tensor:
    """A tensor of ``spec``'s shape, strides and dtype on ``device``, its storage filled with
    normal values (floating point) or zeros: uninitialised memory may hold NaNs or denormals,
    which would time a slower path (expanded strides share one storage element)."""
    size = 0 if 0 in spec.shape else 1 + sum(
        (n - 1) * st for n, st in zip(spec.shape, spec.stride, strict=True))
    base = torch.zeros(size, dtype=spec.dtype, device=device)
    if spec.dtype.is_floating_point:
        base.normal_()
    return base.as_strided(spec.shape, spec.stride)


class ProductCall(NamedTuple):
    """One product (or :data:`COMPUTE_BOUND` operation) as the count saw it (the operation
    and its arguments, tensors as their shape, strides and dtype): what
    :func:`product_seconds` runs again on a real device."""

    func: Any
    args: tuple
    kwargs: tuple  # (name, value) pairs

    @classmethod
    def of(cls, func: Any, args: tuple, kwargs: dict) -> ProductCall | None:
        call = cls(func, _frozen(args), tuple(sorted((k, _frozen(v)) for k, v in kwargs.items())))
        try:
            hash(call)
        except TypeError:  # an argument that cannot be a key: the roofline times it
            return None
        return call

    def run_on(self, device: torch.device) -> Callable[[], Any]:
        """The call on ``device`` with random inputs of the recorded layouts."""
        def build(value: Any) -> Any:
            if isinstance(value, _TensorSpec):
                return _random_like(value, device)
            if isinstance(value, tuple):
                return [build(v) for v in value]
            return value

        args = tuple(build(a) for a in self.args)
        kwargs = {k: build(v) for k, v in self.kwargs}
        return lambda: self.func(*args, **kwargs)


#: Elementwise operations that evaluate a transcendental function: compute-bound on a CPU,
#: where the roofline, counting their bytes only, predicted a fraction of their time (ViT-S/16,
#: batch 2, one thread: GELU's forward and backward 12 ms against 25 ms measured). Timed as
#: the products are.
COMPUTE_BOUND = frozenset(
    getattr(torch.ops.aten, name) for name in (
        "gelu", "gelu_backward", "silu", "silu_backward", "mish", "mish_backward", "sigmoid",
        "sigmoid_backward", "tanh", "tanh_backward", "exp", "erf", "log", "_softmax",
        "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data")
    if hasattr(torch.ops.aten, name))
#: ``(device, device name, threads, call) -> seconds`` (``None``: it did not run there).
_PRODUCT_SECONDS: dict[tuple, float | None] = {}
#: Calls of a product per timed run on CUDA (a run's launches queue behind each other, as a
#: model's do; one call alone between synchronisations would also time the launch latency).
#: On a CPU a run is one call, so that every timed call starts from emptied caches.
PRODUCT_CALLS = 3
#: A call whose first run takes longer than this is timed once more and the faster of the two
#: kept: its launch and host costs are a small part of it, and the 18 runs of the short calls'
#: scheme would add seconds a call to a plan (a large convolution's backward on a CPU).
LONG_CALL_S = 0.01


def _fastest_cold(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn``, each after the caches were emptied
    (:func:`.caches.evict`, not timed)."""
    return min(caches.timed_cold(fn, device)[0] for _ in range(repeats))


def product_seconds(call: ProductCall, speed: DeviceSpeed) -> float | None:
    """The measured time of one product on ``speed``'s device: ``call`` run again with random
    inputs of its recorded shapes, strides and dtypes, the fastest of 5 runs each from emptied
    caches (:mod:`.caches`: inside a step the product's weights and inputs come from memory),
    one call a run on a CPU, :data:`PRODUCT_CALLS` on CUDA; a call longer than
    :data:`LONG_CALL_S` the faster of two runs of one call. Once per process for each distinct
    call. ``None`` where it cannot run there (out of memory, an unsupported layout): the
    roofline times it. Why measured: a roofline's single rate misses how a matrix product's
    speed follows its shape (timm's ViT-S/16, batch 2, one CPU thread: its products took 24 %
    longer than the 384x384 calibration product's rate predicted)."""
    device = torch.device(speed.device)
    key = (str(device), speed.name, speed.threads, call)
    if key not in _PRODUCT_SECONDS:
        try:
            with torch.no_grad():
                run = call.run_on(device)
                first = _seconds_once(run, device)
                if first > LONG_CALL_S:
                    seconds = min(first, _fastest_cold(run, device, 1))
                else:
                    count = PRODUCT_CALLS if device.type == "cuda" else 1

                    def calls() -> None:
                        for _ in range(count):
                            run()

                    seconds = _fastest_cold(calls, device, 5) / count
                _PRODUCT_SECONDS[key] = seconds
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            _PRODUCT_SECONDS[key] = None
    return _PRODUCT_SECONDS[key]


class Op(NamedTuple):
    """One counted operation. ``product``: it has a FLOP formula (selective recomputation
    keeps its output, :mod:`.selective`); ``expansion``: a product whose output is larger than
    its input (lean selective recomputation runs it again); ``call``: the call of a product
    or of a :data:`COMPUTE_BOUND` operation, to time it (:func:`product_seconds`)."""

    flops: float
    bytes: int
    product: bool
    expansion: bool = False
    call: ProductCall | None = None


@dataclass
class OpCount:
    """Operations counted for one owner, in order.

    The recomputation times have two models. Eager (the default): what runs again costs its
    roofline time plus a host cost per forward operation (checkpoint's hooks, the dispatch
    modes of selective recomputation). ``compiled``: under ``torch.compile`` the recomputed
    operations other than products are fused into the backward graph's kernels, which read
    the saved tensors anyway, and no Python hook runs: only the products that run again
    cost their time. (CPU, 4x3x64x64, median step: ResNet-50 as one lean selective run,
    compiled, 218.2 ms against 218.9 ms compiled plainly; VGG-19-BN as one selective run
    456 ms against 469.)"""

    ops: list[Op]

    @property
    def flops(self) -> float:
        return float(sum(op.flops for op in self.ops))

    @property
    def bytes(self) -> int:
        return sum(op.bytes for op in self.ops)

    def seconds(self, speed: DeviceSpeed,
                which: Callable[[Op], bool] = lambda op: True) -> float:
        """Predicted time of the operations (those ``which`` picks)."""
        return sum(speed.op_seconds(op) for op in self.ops if which(op))

    def recompute_seconds(self, speed: DeviceSpeed, compiled: bool = False) -> float:
        """Predicted extra time of recomputing these (forward) operations in backward."""
        if compiled:
            return self.seconds(speed, lambda op: op.product)
        return self.seconds(speed) + len(self.ops) * speed.recompute_overhead_s

    def selective_seconds(self, speed: DeviceSpeed, lean: bool = False,
                          compiled: bool = False) -> float:
        """Predicted extra time of recomputing them selectively: those other than products
        run again (:mod:`.selective`); ``lean``: the expansions too."""
        again = self.seconds(speed, lambda op: op.expansion) if lean else 0.0
        if compiled:
            return again
        return (again + self.seconds(speed, lambda op: not op.product)
                + len(self.ops) * speed.selective_overhead_s)

    @property
    def has_expansion(self) -> bool:
        return any(op.expansion for op in self.ops)


class OpCounter(TorchDispatchMode):
    """Counts every operation run under it for ``owner()`` (a unit index or :data:`REST`)."""

    def __init__(self, owner: Callable[[], int] = lambda: REST) -> None:
        super().__init__()
        self.owner = owner
        self.counts: dict[int, OpCount] = defaultdict(lambda: OpCount([]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view:
            return out
        product = is_product(func)
        flops = product_flops(func, args, kwargs, out) if product else 0.0
        nbytes = 0 if func in _ALLOCATIONS else sum(
            t.numel() * t.element_size()
            for t in tree_leaves((args, kwargs, out)) if isinstance(t, Tensor))
        self.counts[self.owner()].ops.append(
            Op(flops, nbytes, product, product and is_expansion(func, args),
               ProductCall.of(func, args, kwargs)
               if product or func._overloadpacket in COMPUTE_BOUND else None))
        return out


__all__ = ["REST", "DeviceSpeed", "Op", "OpCount", "OpCounter", "ProductCall", "calibrate",
           "product_seconds"]
