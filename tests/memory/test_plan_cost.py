"""The planner's time model (iabn.planning.cost): the operations it counts FLOPs for and the
ones it times on the device instead of predicting them from a roofline."""

import pytest
import torch
import torch.nn.functional as F

from iabn.planning import cost
from iabn.planning.cost import DeviceSpeed, OpCounter, ProductCall, calibrate
from iabn.planning.selective import is_product

aten = torch.ops.aten


def _ops(fn):
    counter = OpCounter()
    with counter:
        fn()
    return counter.counts[cost.REST].ops


def _speed(measures: bool) -> DeviceSpeed:
    return DeviceSpeed("cpu", "test", "float32", torch.get_num_threads(), flops_per_s=1e11,
                       bytes_per_s=1e10, op_overhead_s=1e-6, measures_products=measures)


def test_attention_on_a_cpu_counts_the_flops_of_its_two_products_and_their_gradients():
    # forward: Q K^T and P V, 2 FLOPs a multiply-add each; backward: Q K^T again, dO V^T,
    # P^T dO, dS K and dS^T Q
    b, h, n, m, e = 2, 3, 5, 7, 4
    q = torch.randn(b, h, n, e, requires_grad=True)
    k = torch.randn(b, h, m, e, requires_grad=True)
    v = torch.randn(b, h, m, e, requires_grad=True)
    ops = _ops(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    products = [op for op in ops if op.product]
    assert [op.flops for op in products] == [2 * 2 * b * h * n * m * e, 5 * 2 * b * h * n * m * e]
    assert is_product(aten._scaled_dot_product_flash_attention_for_cpu.default)


def test_a_product_and_a_transcendental_operation_are_recorded_with_their_layouts():
    a = torch.randn(6, 4)
    b = torch.randn(5, 6).t()  # a transposed operand: strides (1, 6)
    ops = _ops(lambda: (torch.mm(a.t(), a), torch.mm(a.t(), b), F.gelu(a), a + 1))
    calls = [op.call for op in ops]
    assert calls[0].func is aten.mm.default
    assert calls[0].args[0] == cost._TensorSpec((4, 6), (1, 4), torch.float32)
    assert calls[1].args[1] == cost._TensorSpec((6, 5), (1, 6), torch.float32)
    assert calls[2].func is aten.gelu.default
    assert calls[3] is None  # memory-bound: the roofline's


def test_a_replayed_call_runs_on_inputs_of_the_recorded_shapes_strides_and_dtypes():
    seen = []

    def fake_mm(x, y):
        seen.append((x.shape, x.stride(), x.dtype, y.shape, y.stride(), bool(y.isfinite().all())))
        return x

    spec = cost._TensorSpec
    call = ProductCall(fake_mm, (spec((3, 2), (1, 3), torch.float64),
                                 spec((2, 4), (0, 1), torch.float32)), ())
    call.run_on(torch.device("cpu"))()
    assert seen == [((3, 2), (1, 3), torch.float64, (2, 4), (0, 1), True)]


def test_a_measuring_speed_takes_a_products_measured_time_and_a_fixed_one_the_roofline(
        monkeypatch):
    runs = []

    def best(fn, device, repeats):
        fn()
        runs.append(repeats)
        return 0.03

    monkeypatch.setattr(cost, "_fastest_cold", best)
    monkeypatch.setattr(cost, "_PRODUCT_SECONDS", {})
    a = torch.randn(8, 8)
    (op,) = _ops(lambda: torch.mm(a, a))
    roofline = _speed(False).seconds(op.flops, op.bytes)
    assert _speed(False).op_seconds(op) == roofline and not runs
    assert _speed(True).op_seconds(op) == pytest.approx(0.03)  # one call a run on a CPU
    assert _speed(True).op_seconds(op) == pytest.approx(0.03)
    assert runs == [5]  # timed once per process and call


def test_every_timed_run_of_a_product_starts_from_emptied_caches(monkeypatch):
    """On a CPU each of the 5 timed runs is one call, after the caches were emptied, and the
    emptying is not timed (the clock is read after it)."""
    from iabn.planning import caches

    events = []
    clock = iter(range(0, 10_000, 10))
    monkeypatch.setattr(cost, "_PRODUCT_SECONDS", {})
    monkeypatch.setattr(caches, "evict", lambda device: events.append("evict"))
    def read_clock():  # short calls (the module time, whose clock cost.py and caches.py read)
        events.append("clock")
        return next(clock) * 1e-9

    monkeypatch.setattr(caches.time, "perf_counter", read_clock)
    spec = cost._TensorSpec

    def counted_mm(x, y):
        events.append("call")
        return torch.mm(x, y)

    call = ProductCall(counted_mm, (spec((16, 8), (8, 1), torch.float32),
                                    spec((8, 4), (4, 1), torch.float32)), ())
    assert cost.product_seconds(call, _speed(True)) == pytest.approx(10e-9)
    # the first run decides short or long; each timed run: evict, then the clock around a call
    assert events == ["clock", "call", "clock"] + ["evict", "clock", "call", "clock"] * 5


def test_a_call_that_cannot_run_on_the_device_falls_back_to_the_roofline(monkeypatch):
    monkeypatch.setattr(cost, "_PRODUCT_SECONDS", {})
    spec = cost._TensorSpec
    wrong = ProductCall(aten.mm.default, (spec((3, 2), (2, 1), torch.float32),
                                          spec((5, 4), (4, 1), torch.float32)), ())
    op = cost.Op(48.0, 100, True, call=wrong)
    assert _speed(True).op_seconds(op) == _speed(True).seconds(48.0, 100)


def test_calibrate_measures_products_and_counting_on_meta_times_on_the_real_device(
        monkeypatch):
    speed = calibrate("cpu")
    assert speed.measures_products
    monkeypatch.setattr(cost, "_PRODUCT_SECONDS", {})
    a = torch.empty(64, 64, device="meta")
    (op,) = _ops(lambda: torch.mm(a, a))
    seconds = speed.op_seconds(op)
    assert seconds > 0
    assert [(key[0], key[-1].func, value) for key, value in cost._PRODUCT_SECONDS.items()] == [
        ("cpu", aten.mm.default, seconds)]


def test_a_long_call_is_timed_twice_not_eighteen_times(monkeypatch):
    calls = []
    monkeypatch.setattr(cost, "_PRODUCT_SECONDS", {})
    monkeypatch.setattr(cost, "LONG_CALL_S", 0.0)  # every call is long
    monkeypatch.setattr(cost, "_best_seconds", lambda *a: pytest.fail("the short calls' scheme"))
    spec = cost._TensorSpec

    def counted_mm(x, y):
        calls.append(1)
        return torch.mm(x, y)

    call = ProductCall(counted_mm, (spec((16, 8), (8, 1), torch.float32),
                                    spec((8, 4), (4, 1), torch.float32)), ())
    seconds = cost.product_seconds(call, _speed(True))
    assert seconds > 0 and len(calls) == 2
