r"""The contract every kernel backend keeps: nine functions, no autograd, no communication.

A backend is a module (:mod:`.reference`, :mod:`.triton_backend`) that :func:`.backends.backend_for`
returns and the layers' ``Function``\ s call without knowing which one it is. A backend may leave
a function to the reference backend (:func:`from_reference`, named in its own source), and an
activation: one that runs only some names them in ``KNOWN_ACTIVATIONS``, and ``backend_for``
gives the reference for the others.

The batch-norm family: the single-process layer calls
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
which activation or backend they have. The group-norm family calls ``group_norm_forward_`` and
``group_norm_backward``, the row-norm family (layer and RMS norm) ``row_norm_forward`` and
``row_norm_backward``. The suite checks each backend's signatures against this class
(``test_backend_contract.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from .common import GroupConfig, LayerConfig, RowConfig


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

    def activation_grad(self, z: Tensor, dz: Tensor, bits: Tensor | None, activation: str,
                        activation_param: Any = 0.0) -> Tensor:
        """``dx = phi'(y) dz`` of an activation without a norm (:class:`iabn.InPlaceGELU`...),
        ``y`` recovered from its output ``z`` (any shape and strides) and, for an activation
        with one minimum, ``bits``, the bit ``y < y*`` of every element in ``z``'s logical
        order (:func:`.branch.pack_bits`: the layers pack them with torch; ``None`` for an
        invertible activation); ``dx`` in ``z``'s dtype and shape."""
        ...

    def group_norm_forward_(self, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                            config: GroupConfig) -> tuple[Tensor, Tensor | None]:
        """Overwrite ``x`` (``(N, C, *)``) with ``phi(g * xhat + beta)`` normalised over each
        sample's groups; return ``(rstd, bits)``: ``rstd`` of shape ``(N, G)`` and, for an
        activation with one minimum, the bit ``y < y*`` of every element in ``x``'s logical
        order (:func:`.branch.pack_bits`' layout; ``None`` for an invertible activation)."""
        ...

    def group_norm_backward(self, z: Tensor, dz: Tensor, weight: Tensor | None,
                            bias: Tensor | None, rstd: Tensor, config: GroupConfig,
                            output_mask: list[bool], bits: Tensor | None = None,
                            ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(dx, dweight, dbias)`` from the output ``z``, ``rstd`` and the forward's
        ``bits``."""
        ...

    def row_norm_forward(self, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                         config: RowConfig, keep: bool,
                         ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """``(out, rstd, kept, index)``: the layer or RMS norm of ``x`` as a new tensor, the
        per-row ``rstd`` ``(rows, 1)`` and, with ``keep``, the ``xhat`` columns of the
        features whose ``xhat`` cannot be rebuilt from the output, with their index."""
        ...

    def row_norm_backward(self, y: Tensor, dz: Tensor, weight: Tensor | None,
                          bias: Tensor | None, rstd: Tensor, kept: Tensor | None,
                          index: Tensor | None, config: RowConfig, output_mask: list[bool],
                          ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``(dx, dweight, dbias)`` from the output ``y`` and what forward returned."""
        ...


#: The contract's function names.
CONTRACT = tuple(name for name, value in vars(KernelBackend).items()
                 if callable(value) and not name.startswith("_"))


def from_reference(*names: str) -> tuple[Any, ...]:
    """The reference backend's functions ``names``, for a backend that leaves them to it (its
    source names them: ``group_norm_forward_, ... = from_reference(...)``)."""
    from . import reference

    unknown = [name for name in names if name not in CONTRACT]
    if unknown:
        raise ValueError(f"{unknown} are not functions of the backend contract ({CONTRACT})")
    return tuple(getattr(reference, name) for name in names)
