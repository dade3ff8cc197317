"""The pluggable norm + activation layer every model takes (timm-style string factory).

``norm_act_factory(name_or_callable, activation, activation_param)`` returns a callable
``make(channels, activation_override=None) -> nn.Module``: ``"bn"`` (:class:`BatchNormAct2d`:
standard batch norm, then the activation in place), ``"abn"``, ``"iabn"``, ``"iabn_sync"``, or any
callable with that signature (models pass the override positionally). All four have the
``state_dict`` keys of ``nn.BatchNorm2d``, so one checkpoint loads into a model built with any
of them. ``activation_override=None`` means the model's default activation; models pass
``"identity"`` where a norm is followed by a residual sum.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..distributed import InPlaceABNSync
from ..kernels.activations import get as activation_record
from ..layers.batch_norm import ABN, InPlaceABN

NormAct = Callable[..., nn.Module]
NAMES = ("bn", "abn", "iabn", "iabn_sync")


def activation_module(activation: str, activation_param: float) -> nn.Module:
    """The ``torch.nn`` activation, in place (it follows a batch norm's fresh output)."""
    return activation_record(activation).torch_module(activation_param, inplace=True)


class BatchNormAct2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` followed by an activation (in place on the norm's fresh output),
    with exactly ``nn.BatchNorm2d``'s parameters, buffers and keys."""

    def __init__(self, num_features: int, activation: str = "leaky_relu",
                 activation_param: float = 0.01, **kwargs) -> None:
        super().__init__(num_features, **kwargs)
        self.act = activation_module(activation, activation_param)

    def forward(self, input):
        return self.act(super().forward(input))


def norm_act_factory(
    layer: str | NormAct = "iabn", activation: str = "leaky_relu", activation_param: float = 0.01
) -> NormAct:
    """A factory ``make(channels, activation_override=None)`` for the chosen norm + activation
    layer; ``activation_override`` replaces ``activation`` for one layer (e.g. ``"identity"``
    before a residual sum)."""
    if callable(layer):
        return layer
    if layer not in NAMES:
        raise ValueError(f"unknown norm_act={layer!r}: use one of {', '.join(NAMES)} or a callable")

    def make(channels: int, activation_override: str | None = None) -> nn.Module:
        act = activation_override or activation
        if layer == "bn":
            return BatchNormAct2d(channels, act, activation_param)
        cls = {"abn": ABN, "iabn": InPlaceABN, "iabn_sync": InPlaceABNSync}[layer]
        return cls(channels, activation=act, activation_param=activation_param)

    return make
