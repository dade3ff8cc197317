"""The contract every kernel backend keeps: five functions, no autograd, no communication.

A backend is a module (:mod:`.reference`, :mod:`.triton_backend`) that :func:`.dispatch.backend_for`
returns and the layers call without knowing which one it is: the single-process layer calls
``forward_`` and ``backward``; the synchronised layer calls ``forward_`` with the statistics
merged over its ranks (``config.for_eval()``), then ``local_sums`` -> all-reduce of the sums
-> ``input_grad`` (docs/design.md, "Synchronised layers"). What a backend returns from
``local_sums`` as ``saved`` is its own business: only its own ``input_grad`` reads it.

The branch bits of the activations with one minimum (``silu``, ``gelu``, ``mish``) are part
of the contract: ``forward_`` writes them into ``bits`` (:func:`.branch.new_bits` makes the
buffer; ``None`` where no backward will read them, e.g. without autograd), ``backward`` and
``local_sums`` read them; each backend packs them in its own order, which only its own
backward reads. ``activation_grad`` is the backward of the activation layers without a norm,
whose bits torch packs in logical order. The layers pass ``bits`` through without asking
which activation or backend they have. The suite checks each backend's signatures against this class
(``test_backend_contract.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from .common import LayerConfig


class KernelBackend(Protocol):
    """Shapes: ``x``/``z``/``dz`` are ``(N, C, *spatial)`` with 0 to 3 spatial dims; every
    per-channel tensor is ``(C,)``; ``scale`` is the effective scale ``g`` that ``forward_``
    returned."""

    def forward_(
        self, x: Tensor, weight: Tensor | None, bias: Tensor | None,
        running_mean: Tensor | None, running_var: Tensor | None, config: LayerConfig,
        bits: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Overwrite ``x`` with ``phi(g * xhat + beta)``, update the running statistics in
        training, write the branch bits into ``bits`` when given; return ``(invstd, g)``."""
        ...

    def backward(
        self, z: Tensor, dz: Tensor, weight: Tensor | None, bias: Tensor | None,
        invstd: Tensor, scale: Tensor, config: LayerConfig, output_mask: list[bool],
        bits: Tensor | None = None,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(dx, dgamma, dbeta)`` from the output ``z`` alone, ``None`` where
        ``output_mask`` does not ask for it."""
        ...

    def local_sums(
        self, z: Tensor, dz: Tensor, bias: Tensor | None, scale: Tensor, config: LayerConfig,
        bits: Tensor | None = None,
    ) -> tuple[Any, Tensor]:
        """``(saved, sums)``: this rank's ``[sum(dy * xhat), sum(dy)]`` stacked ``(2, C)``,
        and what :meth:`input_grad` needs once the sums are summed over the ranks."""
        ...

    def input_grad(
        self, saved: Any, bias: Tensor | None, scale: Tensor, invstd: Tensor,
        global_sums: Tensor, total: Tensor, out_dtype: torch.dtype,
    ) -> Tensor:
        """``dx`` in ``out_dtype`` from :meth:`local_sums`' ``saved`` and the sums over all
        ``total`` values per channel of every rank."""
        ...

    def activation_grad(self, z: Tensor, dz: Tensor, bits: Tensor, activation: str) -> Tensor:
        """``dx = phi'(y) dz`` of an activation with one minimum and no norm
        (:class:`iabn.InPlaceGELU`...), ``y`` recovered from its output ``z`` (any shape and
        strides) and ``bits``, the bit ``y < y*`` of every element in ``z``'s logical order
        (:func:`.branch.pack_bits`: the layers pack them with torch); ``dx`` in ``z``'s dtype
        and shape."""
        ...
