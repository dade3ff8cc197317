"""The measured extra time of a unit converted in place: what its in-place and output-only
layers cost beyond the layers they replace (the activations' inversion, the norms' rebuild of
``xhat``, ``InPlaceABN``'s recovery of ``y``), for the planner's time model (:mod:`.cost`).

Each converted layer is paired with the layer it replaced (the leaf module at the same path
in the unit, of another class) and both are timed on the input the replaced layer received
in the model's recorded forward: one forward and backward each, on a fresh copy of that input
(which an in-place layer overwrites), alternated ``repeats`` times on the real device, the
fastest of each kept (other jobs only add time). The caches are emptied before the forward and
again before the backward (:func:`.caches.evict`, outside the timed parts): in a training step
each layer runs after other layers have passed through them, and its backward reads what its
forward saved long before. Timed warm, back to back, the layers of a converted ViT-S/16 (batch
2, one thread, 2-core VM) cost 9 ms more than those they replaced, from emptied caches 23-31
ms, where the steps differed by 36 ms: the output-only layer norm's backward took 110 us warm
and 390 us cold, PyTorch's 69 and 233 us (the host's own code and data, the Python around each
call, are cold too). A unit's extra time is the sum over its pairs (a norm + activation
fused into ``InPlaceABN`` pairs with the batch norm, and the activation it replaced, now an
``Identity``, pairs with that: the sum is the fused layer against both), at least 0. Pairs
of equal classes, hyperparameters and input shapes are timed once per process, so a
transformer's repeated blocks cost one measurement per kind of layer. This measures whatever
the layers cost on this device with this backend, not a constant: a faster inversion lowers
it."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from . import caches

#: ``(classes, hyperparameters, input shape, dtype, device, threads, backend) -> seconds``.
_MEASURED: dict[tuple, float] = {}
#: Alternated forward + backward runs per pair (the fastest of each is kept).
REPEATS = 7


def layer_pairs(original: Sequence[nn.Module], converted: Sequence[nn.Module],
                ) -> list[tuple[nn.Module, nn.Module]]:
    """``(replaced, converted)`` leaf modules at the same path of the unit's modules (given
    and converted, position by position) whose classes differ."""
    pairs = []
    for before, after in zip(original, converted, strict=True):
        after_leaves = {name: m for name, m in after.named_modules()}
        for name, module in before.named_modules():
            if next(module.children(), None) is not None:
                continue  # a container: its leaves are compared
            other = after_leaves.get(name)
            if other is not None and type(other) is not type(module):
                pairs.append((module, other))
    return pairs


def _inputs_of(modules: Sequence[nn.Module], example: tuple[Tensor, ...],
               wanted: Sequence[nn.Module]) -> dict[int, Tensor]:
    """The first tensor argument each of ``wanted`` receives when ``modules`` run one after
    the other on ``example`` (without autograd), by ``id``."""
    seen: dict[int, Tensor] = {}

    def hook(module: nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], Tensor) and id(module) not in seen:
            seen[id(module)] = args[0].detach().clone()

    handles = [m.register_forward_pre_hook(hook) for m in wanted]
    try:
        with torch.no_grad():
            out: object = example
            for module in modules:
                out = module(*out) if isinstance(out, tuple) else module(out)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _step_seconds(module: nn.Module, leaf: Tensor, grad: Tensor) -> float:
    """One forward and backward of ``module`` on a copy of ``leaf`` (the copy, which an
    in-place layer may overwrite, is timed for both layers of a pair alike), each timed from
    emptied caches."""
    forward, out = caches.timed_cold(lambda: module(leaf.clone()), leaf.device)
    seed = grad if out.shape == grad.shape else torch.ones_like(out)
    backward, _ = caches.timed_cold(lambda: out.backward(seed), leaf.device)
    return forward + backward


def pair_seconds(replaced: nn.Module, converted: nn.Module, x: Tensor,
                 repeats: int = REPEATS) -> float:
    """The converted layer's forward + backward time minus the replaced one's on ``x`` (the
    fastest of ``repeats`` alternated runs each; may be negative)."""
    from ..kernels.backends import requested_backend

    key = (type(replaced), repr(replaced), type(converted), repr(converted), tuple(x.shape),
           x.dtype, str(x.device), torch.get_num_threads(), requested_backend())
    if key in _MEASURED:
        return _MEASURED[key]
    layers = [copy.deepcopy(replaced).train(), copy.deepcopy(converted).train()]
    for layer in layers:
        layer.requires_grad_(True)
    leaf = x.detach().clone().requires_grad_()
    grad = torch.randn_like(x)
    best = [float("inf"), float("inf")]
    for _ in range(repeats + 1):  # the first round warms up
        for i, layer in enumerate(layers):
            best[i] = min(best[i], _step_seconds(layer, leaf, grad))
    _MEASURED[key] = best[1] - best[0]
    return _MEASURED[key]


def unit_recovery_seconds(original: Sequence[nn.Module], converted: Sequence[nn.Module],
                          example: tuple[Tensor, ...], repeats: int = REPEATS) -> float:
    """The extra time of the unit converted in place (module docstring), at least 0. The
    unit's modules run on a copy (a forward in training mode updates batch norm's running
    statistics)."""
    original = copy.deepcopy(list(original))
    pairs = layer_pairs(original, converted)
    if not pairs:
        return 0.0
    inputs = _inputs_of(original, example, [replaced for replaced, _ in pairs])
    total = 0.0
    for replaced, layer in pairs:
        x = inputs.get(id(replaced))
        if x is None or not x.is_floating_point() or x.device.type == "meta":
            continue  # not called in this forward, or nothing to time it on
        total += pair_seconds(replaced, layer, x, repeats)
    return max(0.0, total)


__all__ = ["REPEATS", "layer_pairs", "pair_seconds", "unit_recovery_seconds"]
