"""In-place activation layers without a norm: :class:`InPlaceGELU`, :class:`InPlaceSiLU`,
:class:`InPlaceMish`, :class:`InPlaceSoftplus` (docs/design.md, "In-place activations without
a norm"), their checks,
and :func:`activation_layer`, the layer of a recognised ``torch.nn`` activation module.

``z = phi(x)`` is computed by PyTorch's own function (``F.gelu``, ``F.silu``, ``F.mish``: the
outputs are torch's, bit for bit) and written into ``x``'s storage (``overwrite_input=True``)
or into a new tensor (``False``). Backward needs ``y = x``, which is not kept: each output
``z* < z < 0`` comes from two inputs, so forward also keeps one bit per element, ``x < y*``,
packed eight to a byte, and backward recovers ``x`` from ``z`` and the bit
(:mod:`iabn.autograd.activation`, :func:`iabn.kernels.branch.activation_grad`). Saved for
backward: ``z`` (the returned tensor) and ``ceil(numel / 8)`` bytes; ``nn.GELU`` and the
others keep their input instead.

The layers run on any strided input (a half of ``fc1(x).chunk(2, -1)``, a permuted view),
under ``torch.compile``, and by composition under forward-mode AD and ``torch.func``. Double
backward is refused. The functional forms are in :mod:`iabn.functional`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn

from ..autograd.activation import activation_call
from ..autograd.call import check_writable
from ..kernels.activations import (
    ACTIVATIONS,
    GELU,
    GELU_TANH,
    MISH,
    SILU,
    SOFTPLUS,
    module_activation,
)
from .checks import SUPPORTED_DTYPES, OverwriteInputOption, check_overwrite_input

#: ``nn.GELU``'s ``approximate`` -> the registry's record.
GELU_FORMS = {"none": GELU, "tanh": GELU_TANH}


# ------------------------------------------------------------------ checks


def gelu_activation(approximate: str) -> str:
    """The registry's name of ``nn.GELU(approximate=...)``; a ``ValueError`` naming the two
    accepted values otherwise."""
    try:
        return GELU_FORMS[approximate]
    except (KeyError, TypeError):
        raise ValueError(
            f"approximate={approximate!r}: must be 'none' (the exact erf form, nn.GELU's "
            f"default) or 'tanh' (the tanh approximation), as for nn.GELU"
        ) from None


def check_activation_input(input: Tensor, layer: str, *, overwrite: bool) -> None:
    """Validate a call before anything is written: a dense floating-point tensor, and where it
    is overwritten one autograd and its memory allow to be (the in-place contract)."""
    if not isinstance(input, Tensor):
        raise TypeError(f"{layer}: input must be a torch.Tensor, got {type(input).__name__}")
    if input.is_nested or input.layout is not torch.strided:
        kind = "nested" if input.is_nested else str(input.layout)
        raise TypeError(
            f"{layer}: input is a {kind} tensor; the layer takes dense (strided) tensors: "
            f"pass input.to_dense() (a nested one: torch.nested.to_padded_tensor(input, 0.0))"
        )
    if input.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{layer}: input has dtype {input.dtype}; the layer takes float16, bfloat16, "
            f"float32 or float64 tensors: convert it first, e.g. input.float()"
        )
    if not overwrite:
        return
    check_writable(input, layer, instead="overwrite_input=False (a new output, the input "
                   "left as it is)")


# ------------------------------------------------------------------ the modules


class _InPlaceActivation(OverwriteInputOption):
    """What the three layers share: ``overwrite_input`` (:class:`OverwriteInputOption`),
    the forward, TorchScript's refusal and the ``extra_repr``."""

    #: iabn.debug names the in-place layers by this class attribute.
    _in_place = True

    def _activation(self) -> str:
        raise NotImplementedError

    @classmethod
    def like(cls, module: nn.Module, *, overwrite_input: bool) -> nn.Module:
        """The layer computing what ``module`` (an instance of this layer's ``torch.nn`` base
        class) computes, holding no state of it (these layers have no parameters)."""
        return cls(overwrite_input=overwrite_input)

    def _activation_param(self) -> Any:
        """The registry functions' parameter (0.0: none)."""
        return 0.0

    def forward(self, input: Tensor) -> Tensor:
        activation = self._activation()
        overwrite = self.__dict__.get("_in_place", True)
        layer = type(self).__name__
        check_activation_input(input, layer, overwrite=overwrite)
        return activation_call(input, activation, self._activation_param(), overwrite, layer)

    def __prepare_scriptable__(self) -> nn.Module:
        raise RuntimeError(
            f"iabn.{type(self).__name__} cannot be compiled by TorchScript (torch.jit.script): "
            f"its forward is Python that TorchScript cannot compile. Use torch.compile, or the "
            f"torch.nn activation in its place (it has no parameters)"
        )

    def _overwrite_repr(self) -> str:
        return "" if self.overwrite_input else "overwrite_input=False"


class InPlaceGELU(_InPlaceActivation, nn.GELU):
    """``nn.GELU`` that keeps only its output and one bit per element for backward.

    Args:
        approximate: ``"none"`` (default, the exact erf form) or ``"tanh"``, as ``nn.GELU``.
        overwrite_input: ``True`` (default): the output is written into the input, which is
            returned (:class:`iabn.InPlaceABN`'s in-place contract: the input must not be needed
            afterwards; the caller's leaf that requires grad is refused; a view autograd or an
            engine forbids overwriting goes as ``False``). ``False``: a new tensor, not kept.

    Outputs are ``F.gelu``'s, bit for bit; backward recovers the input from the output and
    the bit (docs/design.md, "In-place activations without a norm").
    """

    def __init__(self, approximate: str = "none", *, overwrite_input: bool = True) -> None:
        gelu_activation(approximate)
        check_overwrite_input(overwrite_input)
        super().__init__(approximate=approximate)
        self.overwrite_input = overwrite_input

    def _activation(self) -> str:
        return gelu_activation(self.approximate)  # checked on every call: it may be assigned

    @classmethod
    def like(cls, module: nn.Module, *, overwrite_input: bool) -> nn.Module:
        return cls(module.approximate, overwrite_input=overwrite_input)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (super().extra_repr(), self._overwrite_repr())))


class InPlaceSiLU(_InPlaceActivation, nn.SiLU):
    """``nn.SiLU`` that keeps only its output and one bit per element for backward.

    Args:
        overwrite_input: as :class:`InPlaceGELU`. ``nn.SiLU``'s own ``inplace`` attribute
            stays ``False`` and is not read: ``overwrite_input`` alone decides.
    """

    def __init__(self, *, overwrite_input: bool = True) -> None:
        check_overwrite_input(overwrite_input)
        super().__init__(inplace=False)
        self.overwrite_input = overwrite_input

    def _activation(self) -> str:
        return SILU

    def extra_repr(self) -> str:
        return self._overwrite_repr()


class InPlaceMish(_InPlaceActivation, nn.Mish):
    """``nn.Mish`` that keeps only its output and one bit per element for backward.

    Args:
        overwrite_input: as :class:`InPlaceGELU`; ``nn.Mish``'s ``inplace`` stays ``False``
            and is not read.
    """

    def __init__(self, *, overwrite_input: bool = True) -> None:
        check_overwrite_input(overwrite_input)
        super().__init__(inplace=False)
        self.overwrite_input = overwrite_input

    def _activation(self) -> str:
        return MISH

    def extra_repr(self) -> str:
        return self._overwrite_repr()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class InPlaceSoftplus(_InPlaceActivation, nn.Softplus):
    """``nn.Softplus`` that keeps only its output for backward: softplus is monotone, so its
    input is recovered from its output alone (no branch bit), ``y = z + log(1 - exp(-beta z))
    / beta`` below the threshold.

    Args:
        beta, threshold: as ``nn.Softplus``: ``beta`` a finite number > 0, ``threshold`` a
            finite number >= 20 (torch's default). Softplus is continuous at the threshold to
            ``exp(-threshold)`` only, so just above it two inputs give one output; the layer
            takes the one below, off by at most ``exp(-threshold)`` in the slope (2.1e-9 at
            20), which a lower threshold would make larger.
        overwrite_input: as :class:`InPlaceGELU`.
    """

    def __init__(self, beta: float = 1.0, threshold: float = 20.0, *,
                 overwrite_input: bool = True) -> None:
        if not (_is_number(beta) and beta > 0):
            raise ValueError(f"beta={beta!r}: must be a finite number > 0, e.g. 1.0")
        if not (_is_number(threshold) and threshold >= 20):
            raise ValueError(f"threshold={threshold!r}: must be a finite number >= 20 (torch's "
                             f"default 20; the input is recovered to exp(-threshold) there)")
        check_overwrite_input(overwrite_input)
        super().__init__(beta, threshold)
        self.overwrite_input = overwrite_input

    def _activation(self) -> str:
        return SOFTPLUS

    def _activation_param(self) -> Any:
        return (float(self.beta), float(self.threshold))

    @classmethod
    def like(cls, module: nn.Module, *, overwrite_input: bool) -> nn.Module:
        return cls(module.beta, module.threshold, overwrite_input=overwrite_input)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (super().extra_repr(), self._overwrite_repr())))


# ------------------------------------------------------------------ from the registry


def _torch_base(cls: type) -> type:
    """The ``torch.nn`` activation class a layer of this module subclasses."""
    return next(base for base in cls.__mro__[1:] if base.__module__.startswith("torch.nn"))


@functools.cache
def _layer_classes() -> dict[type, type]:
    """``torch.nn`` class -> the in-place layer subclassing it, read off the classes above
    (no table to keep in step with the registry; the classes are fixed once imported)."""
    return {_torch_base(cls): cls for cls in _InPlaceActivation.__subclasses__()}


def activation_layer(module: nn.Module, *, overwrite_input: bool) -> nn.Module | None:
    """iabn's in-place layer computing what ``module`` computes, or ``None``: the registry
    names the activation (:func:`iabn.kernels.activations.module_activation`), its record
    gives the ``torch.nn`` module of it (``torch_module``), and the layer is the one of this
    module that subclasses that class. ``None`` where the registry does not recognise
    ``module`` or no in-place layer of that class exists (``nn.ReLU``, ``nn.LeakyReLU``:
    their backward keeps the output already)."""
    found = module_activation(module)
    if found is None:
        return None
    reference = ACTIVATIONS[found[0]].torch_module(found[1])
    cls = _layer_classes().get(type(reference))
    if cls is None:
        return None
    source = module if type(module) is type(reference) else reference
    return cls.like(source, overwrite_input=overwrite_input)


def has_activation_layer(module: nn.Module) -> bool:
    """Whether :func:`activation_layer` gives a layer for ``module``."""
    found = module_activation(module)
    return (found is not None
            and type(ACTIVATIONS[found[0]].torch_module(found[1])) in _layer_classes())


@functools.cache
def standalone_activations() -> tuple[str, ...]:
    """The registry's activations with a layer here, for :func:`iabn.functional.inplace_activation`,
    which asks on every call: made once (building the modules took 63 us a call, CPU)."""
    classes = _layer_classes()
    return tuple(name for name, record in ACTIVATIONS.items()
                 if type(record.torch_module(record.parameter.default if record.parameter
                                             else 0.0)) in classes)


__all__ = [
    "InPlaceGELU",
    "InPlaceMish",
    "InPlaceSiLU",
    "InPlaceSoftplus",
    "activation_layer",
    "has_activation_layer",
    "standalone_activations",
]
