"""What the layers' options share: their checks (at construction, on assignment to a built
layer, and on the functionals' every call), the validation of an option assigned to a built
layer (:class:`ValidatedOptions`), the note a ``gamma_mode="abs"`` layer leaves in its
``state_dict`` (:class:`GammaModeWarning`), and the functional forms' prelude
(:func:`checked_call`: their options, then their tensors). Messages name the argument and the
fix.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..kernels.activations import check_activation
from ..kernels.common import ABS, LayerConfig, check_gamma_mode
from .checks import check_inputs


def check_options(
    activation: str, activation_param: float, gamma_mode: str, *, in_place: bool,
    variant: int = 2, eps: float = 1e-5, momentum: float | None = 0.1, branch: bool = False,
) -> None:
    """Validate the layer's configuration: at construction, on assignment of an option to a
    built layer, and by the functionals on every call.

    The verdict depends only on the arguments; hashable ones are memoised (the functionals
    call this on every call). A rejected configuration raises every time (exceptions are not
    cached); an unhashable argument (a list, say) is checked uncached, to name it.
    """
    try:
        _check_options_cached(activation, activation_param, gamma_mode, in_place, variant, eps,
                              momentum, branch)
    except TypeError:
        _check_options(activation, activation_param, gamma_mode, in_place, variant, eps, momentum,
                       branch)
        raise


def _check_options(
    activation: str, activation_param: float, gamma_mode: str, in_place: bool, variant: int,
    eps: float, momentum: float | None, branch: bool = False,
) -> None:
    check_eps(eps)
    if momentum is not None and not _is_real(momentum):
        raise TypeError(
            f"momentum={momentum!r}: must be a number (the running-statistics factor, e.g. "
            f"0.1) or None (a cumulative average)"
        )
    if momentum is not None and not math.isfinite(momentum):
        raise ValueError(
            f"momentum={momentum!r}: must be a finite number (the running-statistics factor, "
            f"e.g. 0.1) or None (a cumulative average); a NaN would make every running "
            f"statistic NaN"
        )
    check_activation(activation, activation_param, in_place=in_place, branch=branch)
    check_gamma_mode(gamma_mode)
    if variant not in (1, 2) or isinstance(variant, bool):
        raise ValueError(
            f"variant={variant!r}: use 2 (default, gradients from y) or 1 (the paper's "
            f"reference variant, which recovers xhat first)"
        )


# typed: True == 1 and hash alike, and must not share 1's verdict (eps=True, variant=True)
_check_options_cached = functools.lru_cache(maxsize=256, typed=True)(_check_options)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_eps(eps: float) -> None:
    """``eps`` is added to the variance before its square root (and bounds ``|scale|`` of the
    in-place layer): it must be a finite number > 0, or a constant channel divides by 0."""
    if not _is_real(eps):
        raise TypeError(f"eps={eps!r}: must be a number > 0, e.g. 1e-5")
    if not 0 < eps < math.inf:
        raise ValueError(
            f"eps={eps!r}: must be a finite number > 0 (e.g. 1e-5); eps <= 0 divides by zero "
            f"(NaN outputs and gradients) on a channel whose values are all equal"
        )


def check_flag(name: str, value: object) -> None:
    """A yes/no option must be a bool: ``training="no"`` is truthy and would train."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be True or False")


def check_num_features(num_features: int) -> None:
    """The channel count a layer is built for: a positive integer."""
    if not isinstance(num_features, numbers.Integral) or isinstance(num_features, bool):
        raise TypeError(
            f"num_features={num_features!r}: must be an int, the channel count C of the "
            f"(N, C, ...) input"
        )
    if num_features < 1:
        raise ValueError(
            f"num_features={num_features!r}: must be at least 1, the channel count C of the "
            f"(N, C, ...) input"
        )


#: The options a layer reads on every call; assigning one to a built layer validates it.
class ValidatedOptions:
    """Options assigned to a built layer are validated as the constructor validates them
    (same messages) before they are stored: forward and backward read these attributes and
    trust them. ``_OPTIONS`` names them; ``_check_assigned(options)`` checks them together.

    A layer may keep facts of its options in ``__dict__`` between calls (``_CACHES``: the
    batch-norm layers' call settings and the signature of their last validated call). Every
    assignment of a public attribute drops them all, whether or not it is an option in
    ``_OPTIONS``, so no option can leave a stale cache; assignments are rare (construction,
    ``train()``/``eval()``), calls are not.
    """

    _OPTIONS: tuple[str, ...] = ()
    _CACHES = ("_call_config", "_valid_signature")

    def _check_assigned(self, options: dict[str, Any], name: str) -> None:
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        # During __init__ (before gamma_mode, the last option, is set) the constructor has
        # already checked the options together.
        if name in self._OPTIONS and "gamma_mode" in self.__dict__:
            options = {option: self.__dict__.get(option) for option in self._OPTIONS}
            options[name] = value
            self._check_assigned(options, name)
            if name == "activation_param":
                value = float(value)
        super().__setattr__(name, value)
        if name[0] != "_":
            state = self.__dict__
            for cache in self._CACHES:
                state.pop(cache, None)


class GammaModeWarning(UserWarning):
    """A state_dict trained with ``gamma_mode="abs"`` was loaded into a signed layer."""


_warned_abs_into_signed = False


def _warn_abs_into_signed(prefix: str) -> None:
    global _warned_abs_into_signed
    if _warned_abs_into_signed:
        return
    _warned_abs_into_signed = True
    layer = prefix[:-1] or "the layer"
    warnings.warn(
        f"{layer}: this state_dict was saved by a layer with gamma_mode='abs' (scale |weight| + "
        f"eps, the original inplace_abn's) and is loaded into a gamma_mode='signed' layer, which "
        f"uses the weight as it is, so the outputs change. Build the layers with "
        f"gamma_mode='abs' (or use iabn.compat's), or convert the weights exactly first: "
        f"iabn.compat.to_signed(model) on the abs model, or "
        f"iabn.compat.to_signed_state_dict(state_dict) (any layer; to_signed covers the "
        f"batch-norm layers). Warned once per process.",
        GammaModeWarning, stacklevel=4,
    )


def note_gamma_mode(gamma_mode: str, destination: Any, prefix: str) -> None:
    """Record an abs layer's parametrisation in its state_dict metadata (next to the version),
    so that loading its weights into a signed layer (same keys and shapes) can be noticed."""
    metadata = getattr(destination, "_metadata", None)
    if gamma_mode == ABS and metadata is not None and prefix[:-1] in metadata:
        metadata[prefix[:-1]]["gamma_mode"] = ABS


def check_loaded_gamma_mode(gamma_mode: str, local_metadata: dict, prefix: str) -> None:
    """Warn (once per process) when abs-trained weights are loaded into a signed layer."""
    if local_metadata.get("gamma_mode") == ABS and gamma_mode != ABS:
        _warn_abs_into_signed(prefix)


# ------------------------------------------------------------------ the functionals' prelude


def check_argument_order(function: str, running_mean: Tensor | None,
                         running_var: Tensor | None) -> None:
    """Running statistics are buffers; one that requires grad is almost always a ``weight`` or
    ``bias`` passed in the original package's order ``(x, weight, bias, running_mean, ...)``,
    which would otherwise give NaN or an obscure ATen error."""
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if isinstance(t, Tensor) and t.requires_grad:
            raise ValueError(
                f"iabn.functional.{function}: {name} requires grad, so it looks like a weight or "
                f"bias: iabn's order is (input, running_mean, running_var, weight, bias, "
                f"training, ...) like F.batch_norm, not the original inplace_abn's (x, weight, "
                f"bias, running_mean, running_var, ...). Pass the tensors by keyword, or use "
                f"iabn.compat.functions.{function if function != 'abn' else 'inplace_abn'}, "
                f"which keeps the original order and defaults (training=True, |weight| + eps)"
            )


def checked_call(
    function: str, input: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
    weight: Tensor | None, bias: Tensor | None, training: bool, momentum: float, eps: float,
    activation: str, activation_param: float, gamma_mode: str, variant: int = 2, *,
    in_place: bool, branch: bool = False, group_of: Callable[[bool], Any] | None = None,
) -> tuple[LayerConfig, Any]:
    """The functional forms' prelude, before anything is written: the options, the order of
    the running statistics, the tensors; return ``(config, group)``.

    ``group_of(training)`` (the synchronised form's) gives the process group the call
    normalises over, or ``None``; it runs after the options' checks and before the tensors',
    since a synchronised call may hold a single value per channel. ``group`` is ``None``
    without it.
    """
    check_flag("training", training)
    check_options(activation, activation_param, gamma_mode, in_place=in_place, variant=variant,
                  eps=eps, momentum=momentum, branch=branch)
    check_argument_order(function, running_mean, running_var)
    group = None if group_of is None else group_of(training)
    check_inputs(input, running_mean, running_var, weight, bias, training, in_place=in_place,
                 synchronised=group is not None)
    config = LayerConfig(training, momentum, eps, activation, activation_param, gamma_mode,
                         variant)
    return config, group



__all__ = ["GammaModeWarning", "ValidatedOptions",
           "check_eps", "check_flag", "check_loaded_gamma_mode", "check_num_features",
           "check_options", "checked_call", "note_gamma_mode"]
