"""Which modules of a model run, in what order, and which were still running when a forward
failed: what the tools' shape checks (``iabn memory --input``, the training batch check) report
as the layer at fault."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

Entered = tuple[str, nn.Module]


@dataclass
class ModuleTrace:
    """``running``: the modules whose forward is under way, innermost last (after a failed
    forward: the chain that failed); ``entered``: every module whose forward started, in order.
    Names are ``named_modules`` names, ``""`` for the model itself."""

    running: list[Entered] = field(default_factory=list)
    entered: list[Entered] = field(default_factory=list)


@contextmanager
def trace_modules(
    model: nn.Module, on_enter: Callable[[str, nn.Module, tuple[Any, ...]], None] | None = None,
) -> Iterator[ModuleTrace]:
    """Record module calls of ``model`` inside the ``with`` block (hooks removed after it);
    ``on_enter(name, module, args)`` is called as each forward starts."""
    trace = ModuleTrace()

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:  # None: args unchanged
            trace.running.append((name, module))
            trace.entered.append((name, module))
            if on_enter is not None:
                on_enter(name, module, args)

        return hook

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        trace.running.pop()  # returns None: a forward hook's value would replace the output

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["ModuleTrace", "trace_modules"]
