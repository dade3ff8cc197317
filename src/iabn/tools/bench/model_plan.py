"""``iabn plan``: fit a model's activation memory into a budget with :func:`iabn.plan`.

The model is built as ``iabn memory`` builds it (a torchvision or timm name, or
``pkg.module:factory``; random weights, nothing downloaded) on ``--device`` and planned at an
input of ``--input``. Bytes are counted on the ``meta`` device where its count of the model as
given equals the device's (shapes only: a large model plans in seconds, without its memory);
in-place conversion reads the weights, so it runs on the real model with the units' real
inputs; the time model's rates are measured on ``--device``. The figures are exact bytes
autograd keeps for backward (:func:`iabn.memory.saved_tensor_bytes`), not peak memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from ..arguments import parse_allow, parse_budget
from . import machine_info
from .model_memory import DTYPES, ModelMemoryError, resolve_device, versions


def resolve_plan_device(text: str) -> torch.device:
    if text.strip().lower().startswith("meta"):
        raise ModelMemoryError("--device meta: plan counts on meta by itself where it can; "
                               "give the device the model trains on (cpu, cuda)")
    return resolve_device(text)


@dataclass
class PlanResult:
    model: str
    source: str
    input_shape: list[int]
    dtype: str
    device: str
    report: Any  # iabn.PlanReport
    wall_time_s: float = 0.0


def run_plan(model: torch.nn.Module, name: str, source: str, shape: list[int], dtype_name: str,
             device: torch.device, budget: int | float, policy: str, allow: tuple[str, ...],
             time_limit: float, progress: Any = None, compiled: bool = False) -> PlanResult:
    """Plan ``model`` (cast and moved in place) at an input of ``shape``."""
    import iabn

    dtype = DTYPES[dtype_name]
    model = model.to(device=device, dtype=dtype).train()
    x = torch.randn(*shape, dtype=dtype, device=device)
    # no backward pass through the planned model: the command returns the report, not it
    _, report = iabn.plan(model, x, budget, policy=policy, allow=allow, time_limit=time_limit,
                          verify=False, progress=progress, compiled=compiled)
    return PlanResult(name, source, list(shape), str(dtype).removeprefix("torch."), str(device),
                      report)


def format_result(result: PlanResult) -> str:
    shape = "x".join(map(str, result.input_shape))
    head = (f"iabn plan: {result.model} ({result.source}), input {shape} {result.dtype} on "
            f"{result.device}")
    return f"{head}\n{result.report.table()}"


def to_json(result: PlanResult, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"model": result.model, "source": result.source, "input_shape": result.input_shape,
            "dtype": result.dtype, "device": result.device, "plan": result.report.to_dict(),
            "wall_time_s": result.wall_time_s, "arguments": arguments,
            "machine": machine_info(), "versions": versions(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


__all__ = ["PlanResult", "format_result", "parse_allow", "parse_budget", "resolve_plan_device",
           "run_plan", "to_json"]
