"""Which kernels run a layer: PyTorch's own batch-norm kernels by default, Triton on request.

``IABN_BACKEND`` sets the choice for every layer:

``auto`` (or unset)
    the reference kernels (:mod:`.reference`, on PyTorch's native batch-norm kernels) on CPU
    and on CUDA. They are the path verified on a GPU (float32 input gradients within 2e-7 of
    float64 on an H100 at every shape of the GPU sweep). The fused Triton kernels stay opt-in until
    a GPU run of the whole suite is green with them: their fix of the activation-slope error
    at 100k+ values per channel is verified under Triton's CPU interpreter only, and their
    per-layer launch cost still makes whole networks slower than BatchNorm (1.35-2.6x on an H100).
``reference``
    the reference kernels everywhere.
``triton``
    the Triton kernels; raises when they cannot run: Triton missing, or a CPU tensor without
    ``TRITON_INTERPRET=1`` (the interpreter, which is how the kernels are tested on CPU).

The variable is read once per layer call (its backward uses the forward's choice), so tests
and users can switch it at run time. :func:`backend_for` and the reading of the variable live
in :mod:`.reference`, beside the default backend, so that a layer call asks and runs in one
module; this module gives them with :func:`use_backend` to tools and tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from .reference import (
    CHOICES,
    ENV,
    backend_for,
    has_triton,
    requested_backend,
    triton_interpreting,
)


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Set ``IABN_BACKEND`` to ``name`` inside the ``with`` block, restoring it afterwards (the
    variable is read on every call, so this scopes the choice; for benchmarks and tests)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


__all__ = ["CHOICES", "ENV", "backend_for", "has_triton", "requested_backend",
           "triton_interpreting", "use_backend"]
