"""Running a model to measure it without leaving a trace: what :func:`iabn.convert` and
:func:`iabn.plan` both need when they run a model forward to count its bytes or compare
outputs (the model's running statistics and training flags must be as before, and models
compared must see the same random numbers)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` without a trace: its buffers (running statistics) and every module's
    training flag are restored afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield model
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def same_randomness(args: tuple) -> Iterator[None]:
    """The same random numbers (dropout, stochastic depth) for each run, and the caller's
    random state untouched afterwards."""
    devices = sorted({a.device.index or 0 for a in tree_leaves(args)
                      if isinstance(a, Tensor) and a.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        yield
