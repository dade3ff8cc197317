"""Where one call's time goes: device kernels against the host, from ``torch.profiler``.

A layer or a training step slower than its target is explained by three numbers of one
profiled call: how many kernels it launched, how long they ran on the device (summed), and how
long the call took on the wall clock. Kernel time near the wall time means the device is the
limit (then the top kernels say which); kernel time far below it means the host is (Python,
dispatch, launches, synchronisations). On a CPU there are no kernels: the figures are the
top-level ``aten::`` operators the call ran instead, so the same code path is rehearsed there.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from . import synchronize

#: Kernel names are C++ templates; the table keeps their first characters.
NAME_CHARS = 120


def profile_call(call: Callable[[], object], device: torch.device, top: int = 8) -> dict[str, Any]:
    """Profile one ``call`` (already warmed up) on ``device``: ``wall_ms`` (host clock, from
    before the call until the device has finished it), ``kernels`` (device kernels, copies and
    fills launched; on a CPU the top-level ``aten::`` operators run), ``kernel_ms`` (their
    summed device time; on a CPU their summed host time), ``kernel_fraction`` (``kernel_ms``
    over ``wall_ms``) and ``top``: the ``top`` names by summed time, each with its count and
    milliseconds. If profiling fails, ``{"error": ...}``: the call's other figures stand."""
    try:
        return _profile(call, device, top)
    except Exception as error:  # a measurement aid: its failure must not lose the figures
        return {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300]}


def _profile(call: Callable[[], object], device: torch.device, top: int) -> dict[str, Any]:
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        call()
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if cuda:
            if event.device_type != DeviceType.CUDA:
                continue
        elif not (event.name.startswith("aten::") and event.cpu_parent is None):
            continue
        entry = totals[event.name[:NAME_CHARS]]
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() / 1e3
    kernel_ms = sum(ms for _, ms in totals.values())
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return {"wall_ms": wall_ms, "kernels": int(sum(n for n, _ in totals.values())),
            "kernel_ms": kernel_ms, "kernel_fraction": kernel_ms / wall_ms if wall_ms else None,
            "what": "device kernels" if cuda else "top-level aten operators (CPU)",
            "top": [{"name": name, "count": int(n), "ms": ms} for name, (n, ms) in ranked]}


def format_profile(profile_: dict[str, Any]) -> str:
    """One line: kernels, their time and the wall time."""
    if "error" in profile_:
        return f"profile failed: {profile_['error']}"
    return (f"{profile_['kernels']} {profile_['what']}, {profile_['kernel_ms']:.2f} ms of "
            f"{profile_['wall_ms']:.2f} ms wall ({profile_['kernel_fraction']:.0%})")
