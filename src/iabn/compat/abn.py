"""``inplace_abn.abn`` of the original package: ``ABN``, ``InPlaceABN``, ``InPlaceABNSync``.

The constructors take the original's arguments in the original's order (``InPlaceABNSync``'s
``group`` is the 8th, positional). The in-place layers compute with ``|weight| + eps``
(``gamma_mode="abs"``) as the original did; ``ABN`` is standard batch norm + activation with the
weight used as it is (``gamma_mode="signed"``, no clamp), as the original's ``ABN`` was. They are
subclasses of iabn's layers, so ``isinstance(layer, iabn.InPlaceABN)`` holds and everything that
works on iabn's layers (``load_original``, ``convert_sync``, state dicts) works on them.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor

from .. import distributed
from ..autograd.batch_norm import compute_abn
from ..kernels.common import ABS, SIGNED, LayerConfig
from ..layers import batch_norm as modules


class ZeroSlopeWarning(UserWarning):
    """An in-place layer of the original API was given a leaky ReLU of slope 0 (ReLU): it
    computes exactly, but keeps its input as ``ABN`` does, so it saves no memory."""


_warned_zero_slope = False


def is_zero_slope(activation: Any, activation_param: Any) -> bool:
    """``leaky_relu`` with slope 0: ReLU, which the original package accepted in its in-place
    layers (and differentiated wrongly: its backward inverted only where the output is
    negative, which ReLU's never is)."""
    return (activation == "leaky_relu" and isinstance(activation_param, (int, float))
            and not isinstance(activation_param, bool) and activation_param == 0)


def warn_zero_slope(where: str) -> None:
    """The one warning of a process about slope-0 in-place layers."""
    global _warned_zero_slope
    if _warned_zero_slope:
        return
    _warned_zero_slope = True
    warnings.warn(
        f"{where}(activation='leaky_relu', activation_param=0.0) is ReLU, which cannot be "
        f"inverted: iabn computes it exactly, as ABN does (its input kept for backward), so "
        f"no memory is saved there; activation_param=0.01 saves it (a leaky ReLU the layer "
        f"inverts). Warned once per process.", ZeroSlopeWarning, stacklevel=4)


def _activation_arguments(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """``activation`` and ``activation_param`` of a call with the original's positional order
    ``(num_features, eps, momentum, affine, track_running_stats, activation,
    activation_param)``."""
    activation = args[5] if len(args) > 5 else kwargs.get("activation", "leaky_relu")
    param = args[6] if len(args) > 6 else kwargs.get("activation_param", 0.01)
    return activation, param


def relu_keeping_mask_(y: Tensor) -> Tensor:
    """``y <- relu(y)``, returning ``y``: ``masked_fill_`` of the elements ``<= 0``, whose
    backward reads that bool mask (one byte an element) and not the tensor it returns.
    ``relu_`` (the original's ``F.relu(x, inplace=True)``) keeps its result instead, so an
    ``nn.ReLU(inplace=True)`` applied after the layer (decoders written for the original do)
    made its backward raise ("output 0 of Relu ... modified by an inplace operation"). The
    values and the gradient are ReLU's: ``dy = dz`` where ``y > 0``, else 0, a NaN kept as
    ``relu`` keeps it."""
    return y.masked_fill_(y <= 0, 0)


def _computes_relu(config: LayerConfig) -> bool:
    return config.activation == "relu" or is_zero_slope(config.activation,
                                                        config.activation_param)


def batch_norm_then_relu(input: Tensor, running_mean: Tensor | None,
                         running_var: Tensor | None, weight: Tensor | None, bias: Tensor | None,
                         config: LayerConfig) -> Tensor:
    """The original's ``ABN`` computation (:func:`iabn.autograd.batch_norm.compute_abn`), with
    ReLU (or leaky ReLU of slope 0) by :func:`relu_keeping_mask_`: the layer keeps batch
    norm's input and a bool mask, never its output, which the caller may then overwrite."""
    if not _computes_relu(config):
        return compute_abn(input, running_mean, running_var, weight, bias, config)
    y = compute_abn(input, running_mean, running_var, weight, bias,
                    config._replace(activation="identity"))
    return relu_keeping_mask_(y)


class ABN(modules.ABN):
    """The original ``ABN``: ``nn.BatchNorm`` followed by ``relu``, ``leaky_relu``, ``elu`` or
    ``identity``; stores its input. Weights as ``nn.BatchNorm`` (signed).

    As in the original, the in-place layers below are subclasses of it, so
    ``isinstance(layer, ABN)`` finds every layer of the package (the original's scripts
    initialise and exclude from weight decay by it). ``device``, ``dtype`` and ``gamma_mode``
    are iabn's keyword-only extras.

    With ``relu`` it keeps a bool mask for backward instead of its output
    (:func:`relu_keeping_mask_`), so an ``nn.ReLU(inplace=True)`` after it trains (the
    original's raised at backward there)."""

    _compute = staticmethod(batch_norm_then_relu)

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
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, device, dtype, gamma_mode=gamma_mode, bias=bias,
        )


class InPlaceABN(modules.InPlaceABN, ABN):
    """The original ``InPlaceABN``: overwrites its input; scale ``|weight| + eps``.

    ``activation="leaky_relu", activation_param=0.0`` (ReLU, which the original accepted and
    segmentation_models_pytorch's ``decoder_use_norm="inplace"`` uses) builds a layer of the
    private subclass :class:`_ZeroSlopeInPlaceABN`: exact, computed as ``ABN`` computes it
    (input kept, not overwritten, no memory saved), with one :class:`ZeroSlopeWarning`."""

    def __new__(cls, *args: Any, **kwargs: Any) -> InPlaceABN:
        if cls is InPlaceABN and is_zero_slope(*_activation_arguments(args, kwargs)):
            cls = _ZeroSlopeInPlaceABN
        return super().__new__(cls)

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
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, gamma_mode=ABS, bias=bias,
        )


class _ZeroSlopeInPlaceABN(InPlaceABN):
    """``InPlaceABN(C, activation="leaky_relu", activation_param=0.0)`` of the original API:
    batch norm (scale ``|weight| + eps``, as the original's in-place layer) and ReLU, computed
    out of place as :class:`ABN` computes it: ReLU's input cannot be recovered from its
    output, so the layer keeps batch norm's input and a bool mask of ReLU's zeros
    (:func:`relu_keeping_mask_`), not its output, and leaves its input as it is.

    ``activation`` and ``activation_param`` read ``"leaky_relu"`` and ``0.0``, what the
    caller gave, as on the original's layer (code exporting the layer back to BatchNorm + an
    activation reads them); another value assigned later is computed as ``ABN`` computes
    it."""

    _in_place = False
    _needs_inverse = False
    _compute = staticmethod(batch_norm_then_relu)  # ABN's computation, out of place

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
        bias: bool = True,
    ) -> None:
        warn_zero_slope("InPlaceABN")
        # built as ABN with relu (iabn's layers refuse a leaky_relu of slope 0), then given
        # the caller's names, which _check_assigned takes as ReLU
        ABN.__init__(self, num_features, eps, momentum, affine, track_running_stats, "relu",
                     0.0, gamma_mode=ABS, bias=bias)
        self.variant = 2
        self.__dict__["_in_place"] = False
        self.activation = activation

    def _check_assigned(self, options: dict[str, Any], name: str) -> None:
        if is_zero_slope(options["activation"], options["activation_param"]):
            options = {**options, "activation": "relu"}
        super()._check_assigned(options, name)

    def extra_repr(self) -> str:
        text = modules.ABN.extra_repr(self)
        if is_zero_slope(self.activation, self.activation_param):
            text += " (slope 0: ReLU, computed as ABN, not in place)"
        return text


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
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, activation,
            activation_param, gamma_mode=ABS, group=group, bias=bias,
        )

    def set_group(self, group: Any) -> None:
        """Synchronise over ``group`` from the next step on (not between forward and
        backward)."""
        self.group = group


__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "ZeroSlopeWarning"]
