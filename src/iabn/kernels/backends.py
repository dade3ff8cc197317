"""Which backend runs a layer: PyTorch's own kernels (:mod:`.reference`) by default, Triton
(:mod:`.triton_backend`) on request.

``IABN_BACKEND`` sets the choice for every layer:

``auto`` (or unset)
    the reference backend on CPU and on CUDA. It is the path verified on a GPU (float32 input
    gradients within 2e-7 of float64 on an H100 at every shape of the GPU sweep). The fused
    Triton kernels stay opt-in until a GPU run of the whole suite is green with them: their fix
    of the activation-slope error at 100k+ values per channel is verified under Triton's CPU
    interpreter only, and their per-layer launch cost still makes whole networks slower than
    BatchNorm (1.35-2.6x on an H100).
``reference``
    the reference backend everywhere.
``triton``
    the Triton backend; raises when it cannot run: Triton missing, or a CPU tensor without
    ``TRITON_INTERPRET=1`` (the interpreter, which is how the kernels are tested on CPU).

The variable is read once per layer call (its backward uses the forward's choice), so tests
and users can switch it at run time (:func:`use_backend` scopes it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from . import reference
from .backend import KernelBackend

ENV = "IABN_BACKEND"
CHOICES = ("auto", "reference", "triton")


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_backend() -> KernelBackend:
    from . import triton_backend

    return triton_backend  # type: ignore[return-value]


def requested_backend() -> str:
    """The value of ``IABN_BACKEND`` (``auto`` when unset), validated."""
    # os.environ.get costs ~0.7 µs a call (it encodes the key and decodes the value); the
    # encoded table it keeps, which every change through os.environ updates, answers in a
    # twentieth of that. Where it is missing (os.environ replaced by a plain mapping), the
    # public way.
    try:
        raw = os.environ._data.get(_ENV_KEY)  # type: ignore[attr-defined]
    except AttributeError:
        raw = os.environ.get(ENV)
    choice = _PARSED.get(raw)
    if choice is None:
        choice = _parse(os.fsdecode(raw) if isinstance(raw, bytes) else raw)
        _PARSED[raw] = choice
    return choice


def _parse(raw: str | None) -> str:
    choice = (raw or "").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(
            f"{ENV}={raw!r} is not a backend: use one of {', '.join(CHOICES)} "
            f"(or unset it to choose by device)"
        )
    return choice


# Valid raw values of the variable seen so far (bytes as the environment's table holds them),
# parsed: a layer call pays one lookup in that table, not the string handling.
_PARSED: dict[bytes | str | None, str] = {}
_ENV_KEY = os.environ.encodekey(ENV) if hasattr(os.environ, "encodekey") else ENV


def backend_for(x: Tensor, activation: str | None = None) -> KernelBackend:
    """The kernel module that runs a layer on ``x``: its forward and backward, and the two
    halves of the synchronised layer's backward (:class:`.backend.KernelBackend`). A backend
    that runs only some activations names them (``KNOWN_ACTIVATIONS``); for another
    ``activation`` the reference runs the layer."""
    if requested_backend() != "triton":
        return reference  # type: ignore[return-value]
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
    backend = _triton_backend()
    if activation is not None and activation not in backend.KNOWN_ACTIVATIONS:
        return reference  # type: ignore[return-value]
    return backend


def backend_or_reference(x: Tensor, activation: str | None = None) -> KernelBackend:
    """:func:`backend_for`, or the reference while compiling: its ATen operations, which the
    compiler traces and fuses (the norms' and activations' ``Function``\\ s are traced as they
    are)."""
    if torch.compiler.is_compiling():
        return reference  # type: ignore[return-value]
    return backend_for(x, activation)


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


__all__ = ["CHOICES", "ENV", "backend_for", "backend_or_reference", "has_triton",
           "requested_backend", "triton_interpreting", "use_backend"]
