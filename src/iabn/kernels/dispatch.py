"""Which kernels run a layer: Triton for CUDA tensors, the PyTorch reference otherwise.

``IABN_BACKEND`` overrides the choice for every layer:

``auto`` (or unset)
    Triton for CUDA tensors when Triton is installed, else the reference (with a one-time
    warning on CUDA, since the fused kernels are the fast path there).
``reference``
    the pure-PyTorch kernels everywhere.
``triton``
    the Triton kernels; raises when they cannot run: Triton missing, or a CPU tensor without
    ``TRITON_INTERPRET=1`` (the interpreter, which is how the kernels are tested on CPU).

The variable is read on every call, so tests and users can switch it at run time.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from types import ModuleType

from torch import Tensor

from . import reference

ENV = "IABN_BACKEND"
CHOICES = ("auto", "reference", "triton")


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_backend() -> ModuleType:
    from . import triton_backend

    return triton_backend


@functools.cache
def _warn_no_triton() -> None:
    warnings.warn(
        "iabn: Triton is not installed, so CUDA tensors use the slower reference kernels; "
        "pip install triton for the fused kernels (set IABN_BACKEND=reference to silence this)",
        stacklevel=4,
    )


def requested_backend() -> str:
    """The value of ``IABN_BACKEND`` (``auto`` when unset), validated."""
    choice = os.environ.get(ENV, "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r} is not a backend: use one of {', '.join(CHOICES)} "
            f"(or unset it to choose by device)"
        )
    return choice


def backend_for(x: Tensor) -> ModuleType:
    """The kernel module (``forward_``, ``backward``) that runs a layer on ``x``."""
    choice = requested_backend()
    if choice == "reference":
        return reference
    if choice == "auto":
        if not x.is_cuda:
            return reference
        if not has_triton():
            _warn_no_triton()
            return reference
        return _triton_backend()
    if not has_triton():
        raise RuntimeError(
            f"{ENV}=triton, but Triton is not installed: pip install triton, or set "
            f"{ENV}=reference"
        )
    if not x.is_cuda and not triton_interpreting():
        raise RuntimeError(
            f"{ENV}=triton needs CUDA tensors (got a {x.device.type} tensor); to run the "
            f"kernels on CPU set TRITON_INTERPRET=1 before starting Python (slow, for tests), "
            f"or set {ENV}=reference"
        )
    return _triton_backend()


def sync_backend_for(x: Tensor) -> ModuleType:
    """The module with ``local_sums`` and ``input_grad``, the two halves of the synchronised
    layer's backward around its all-reduce, for the backend :func:`backend_for` picks."""
    kernels = backend_for(x)
    if kernels is reference:
        from . import sync_reference

        return sync_reference
    return kernels
