"""What every task's ``network`` section shares: the norm + activation choice."""

from __future__ import annotations

from typing import Any

from ...kernels.activations import check_activation
from .config import ConfigError


def check_norm_act(network: dict[str, Any], source: str) -> None:
    """ConfigError when ``network.activation`` cannot follow ``network.norm_act`` (the in-place
    layers need an invertible activation; ``bn`` takes any)."""
    if network["norm_act"] == "bn":
        return
    try:
        check_activation(network["activation"], network["activation_param"],
                         in_place=network["norm_act"] in ("iabn", "iabn_sync"),
                         branch=network["norm_act"] in ("iabn", "iabn_sync"))
    except ValueError as error:
        raise ConfigError(f"{source}: network.activation with network.norm_act="
                          f"{network['norm_act']!r}: {error}") from None


def norm_act_kwargs(network: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """``norm_act``/``activation``/``activation_param`` for :mod:`iabn.models`. ``iabn_sync`` in
    a single process builds ``iabn``: the same computation and ``state_dict``, without the
    layer's no-process-group warning."""
    norm_act = network["norm_act"]
    if norm_act == "iabn_sync" and not distributed:
        norm_act = "iabn"
    return {"norm_act": norm_act, "activation": network["activation"],
            "activation_param": network["activation_param"]}
