"""``inplace_abn.abn`` of the original package: ``ABN``, ``InPlaceABN``, ``InPlaceABNSync``.

The constructors take the original's arguments in the original's order (``InPlaceABNSync``'s
``group`` is the 8th, positional). The in-place layers compute with ``|weight| + eps``
(``gamma_mode="abs"``) as the original did; ``ABN`` is standard batch norm + activation with the
weight used as it is (``gamma_mode="signed"``, no clamp), as the original's ``ABN`` was. They are
subclasses of iabn's layers, so ``isinstance(layer, iabn.InPlaceABN)`` holds and everything that
works on iabn's layers (``load_original``, ``convert_sync``, state dicts) works on them.
"""

from __future__ import annotations

from typing import Any

from .. import distributed
from ..kernels.common import ABS, SIGNED
from ..layers import batch_norm as modules


class ABN(modules.ABN):
    """The original ``ABN``: ``nn.BatchNorm`` followed by ``relu``, ``leaky_relu``, ``elu`` or
    ``identity``; stores its input. Weights as ``nn.BatchNorm`` (signed).

    As in the original, the in-place layers below are subclasses of it, so
    ``isinstance(layer, ABN)`` finds every layer of the package (the original's scripts
    initialise and exclude from weight decay by it). ``device``, ``dtype`` and ``gamma_mode``
    are iabn's keyword-only extras."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        *,
        device=None,
        dtype=None,
        gamma_mode: str = SIGNED,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, device, dtype, gamma_mode=gamma_mode,
        )


class InPlaceABN(modules.InPlaceABN, ABN):
    """The original ``InPlaceABN``: overwrites its input; scale ``|weight| + eps``."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, gamma_mode=ABS,
        )


class InPlaceABNSync(distributed.InPlaceABNSync, ABN):
    """The original ``InPlaceABNSync``: :class:`InPlaceABN` with batch statistics over the
    ranks of ``group`` (``None``: the default group), positional as in the original."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        activation: str = "leaky_relu",
        activation_param: float = 0.01,
        group: Any = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, gamma_mode=ABS, group=group,
        )

    def set_group(self, group: Any) -> None:
        """Synchronise over ``group`` from the next step on (not between forward and
        backward)."""
        self.group = group


__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync"]
