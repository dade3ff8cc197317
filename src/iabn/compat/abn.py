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

from .. import distributed, modules
from ..scale import ABS, SIGNED


class ABN(modules.ABN):
    """The original ``ABN``: ``nn.BatchNorm`` followed by ``relu``, ``leaky_relu``, ``elu`` or
    ``identity``; stores its input. Weights as ``nn.BatchNorm`` (signed)."""

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
            activation_param, gamma_mode=SIGNED,
        )


class InPlaceABN(modules.InPlaceABN):
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


class InPlaceABNSync(distributed.InPlaceABNSync):
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
