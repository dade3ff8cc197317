"""How a plan runs a segment: recomputed in backward, or with its saved tensors offloaded.

Two wrappers keep the model's ``state_dict`` keys, parameter names and module paths:

- :class:`PlannedSequential` replaces an ``nn.Sequential`` whose children form the chain; it
  holds the same children under the same names and runs groups of them (blocks) with their
  choice;
- :class:`PlannedModule` wraps one module called elsewhere (a ResNet's stem layers). It adopts
  the wrapped module's parameter, buffer and child dictionaries (the same dict objects), so its
  keys are the wrapped module's own and nothing is duplicated.

Recomputation is ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout
draws the same mask again). Running statistics must be updated once per forward, as without
the plan: the recomputation in backward saves every buffer of the recomputed modules first
and restores it afterwards (also when checkpoint stops the recomputation early), so batch
norm's running mean, variance and ``num_batches_tracked`` end as the unplanned model's, bit
for bit. The recomputed forward itself uses batch statistics in training mode, so its
outputs do not depend on the running statistics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

#: The choices a plan makes per segment.
KEEP = "keep"
INPLACE = "inplace"
RECOMPUTE = "recompute"
INPLACE_RECOMPUTE = "inplace+recompute"
OFFLOAD = "offload"
CHOICES = (KEEP, INPLACE, RECOMPUTE, INPLACE_RECOMPUTE, OFFLOAD)
RECOMPUTED = (RECOMPUTE, INPLACE_RECOMPUTE)


class Observer:
    """Told when a planned segment starts and ends (the planner's accounting); ``None`` in
    a returned model."""

    def enter(self, unit: int, inputs: Sequence[Any]) -> None:  # pragma: no cover
        raise NotImplementedError

    def exit(self, unit: int, outputs: Any) -> None:  # pragma: no cover
        raise NotImplementedError


def _buffers(modules: Iterable[nn.Module]) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for module in modules:
        for buffer in module.buffers():
            seen.setdefault(id(buffer), buffer)
    return list(seen.values())


def recomputed(fn: Callable[..., Any], modules: Sequence[nn.Module], *args: Any) -> Any:
    """``fn(*args)``, keeping only ``args`` for backward and running ``fn`` again there.

    The buffers of ``modules`` (running statistics) are restored after the recomputation:
    they are updated by the forward only, as without recomputation.
    """
    calls = [0]

    def run(*inputs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return fn(*inputs)
        buffers = _buffers(modules)
        with torch.no_grad():
            saved = [b.clone() for b in buffers]
        try:
            return fn(*inputs)
        finally:
            with torch.no_grad():
                for buffer, value in zip(buffers, saved, strict=True):
                    buffer.copy_(value)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def _offloader() -> Any:
    from ..offloading import Offloader

    # min_bytes=0: every saved activation goes, so what stays on the device is exactly what
    # the segment's neighbours save themselves (the planner's accounting relies on it)
    return Offloader(min_bytes=0)


def offloaded(fn: Callable[..., Any], offloader: Any, modules: Sequence[nn.Module],
              *args: Any) -> Any:
    """``fn(*args)`` with the tensors it saves for backward in host memory."""
    from ..offloading import _storage_key

    offloader.keep = {_storage_key(t) for m in modules
                      for t in (*m.parameters(), *m.buffers())}
    with offloader.hooks():
        return fn(*args)


class PlannedSequential(nn.Sequential):
    """An ``nn.Sequential`` (same children, same names) that runs blocks of its children as
    the plan says: ``blocks`` is a list of ``(start, stop, choice)`` covering every child."""

    def __init__(self, sequential: nn.Sequential,
                 blocks: Sequence[tuple[int, int, str]]) -> None:
        super().__init__(OrderedDict(sequential._modules))
        self.training = sequential.training
        self.blocks = [tuple(b) for b in blocks]
        # which planner unit each block is (the planner's accounting), by block index
        self.units: list[int] | None = None
        self.observer: Observer | None = None
        self._offloaders: dict[int, Any] = {}

    def forward(self, x: Any) -> Any:
        children = list(self._modules.values())
        for index, (start, stop, choice) in enumerate(self.blocks):
            modules = children[start:stop]
            if self.observer is not None and self.units is not None:
                self.observer.enter(self.units[index], (x,))
            x = _run(choice, modules, self._offloaders, index, x)
            if self.observer is not None and self.units is not None:
                self.observer.exit(self.units[index], x)
        return x

    def extra_repr(self) -> str:
        return "blocks=" + ", ".join(f"[{a}:{b}] {c}" for a, b, c in self.blocks)


def _chain(modules: Sequence[nn.Module]) -> Callable[[Any], Any]:
    def run(x: Any) -> Any:
        for module in modules:
            x = module(x)
        return x
    return run


def _run(choice: str, modules: Sequence[nn.Module], offloaders: dict[int, Any], key: int,
         *args: Any) -> Any:
    fn = modules[0] if len(modules) == 1 else _chain(modules)
    if choice in RECOMPUTED:
        return recomputed(fn, modules, *args)
    if choice == OFFLOAD:
        if key not in offloaders:
            offloaders[key] = _offloader()
        return offloaded(fn, offloaders[key], modules, *args)
    return fn(*args)


class PlannedModule(nn.Module):
    """Runs ``inner`` recomputed or offloaded. Its parameters, buffers and children are
    ``inner``'s own (the same dictionaries), so the ``state_dict`` keys, parameter names and
    attribute access (``wrapper.conv1``, ``wrapper.eps``) are ``inner``'s."""

    def __init__(self, inner: nn.Module, choice: str) -> None:
        super().__init__()
        state = self.__dict__
        state["_planned_inner"] = inner
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            state[name] = getattr(inner, name)
        state["_version"] = getattr(inner, "_version", 1)
        self.choice = choice
        self.unit: int | None = None
        self.observer: Observer | None = None
        self._offloaders: dict[int, Any] = {}

    @property
    def inner(self) -> nn.Module:
        return self.__dict__["_planned_inner"]

    def forward(self, *args: Any) -> Any:
        if self.observer is not None and self.unit is not None:
            self.observer.enter(self.unit, args)
        out = _run(self.choice, [self.inner], self._offloaders, 0, *args)
        if self.observer is not None and self.unit is not None:
            self.observer.exit(self.unit, out)
        return out

    # the wrapped module's own flag: set through the wrapper (train(), eval(), or directly, as
    # code that saves and restores modes does) it reaches the module that runs
    @property
    def training(self) -> bool:  # type: ignore[override]
        inner = self.__dict__.get("_planned_inner")
        return inner.training if inner is not None else self.__dict__.get("_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        inner = self.__dict__.get("_planned_inner")
        if inner is None:
            self.__dict__["_training"] = mode
        else:
            inner.training = mode

    # the wrapped module's own state_dict logic (e.g. batch norm's version handling)
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        self.inner._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self.inner._load_from_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_planned_inner")
            if inner is None:
                raise
            return getattr(inner, name)

    def extra_repr(self) -> str:
        return f"{self.choice}: {type(self.inner).__name__}"


__all__ = ["CHOICES", "INPLACE", "INPLACE_RECOMPUTE", "KEEP", "OFFLOAD", "RECOMPUTE",
           "RECOMPUTED", "PlannedModule", "PlannedSequential", "offloaded", "recomputed"]
