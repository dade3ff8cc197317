"""Compatibility with the original ``inplace_abn`` package (1.1.0) and with timm.

``iabn.compat`` has the original's public names — ``ABN``, ``InPlaceABN``, ``InPlaceABNSync``,
``active_group``, ``set_active_group`` and the submodules ``abn``, ``functions``, ``group`` —
with its signatures, defaults and semantics (``|weight| + eps`` in the in-place layers, signed
weights in ``ABN``), computed by iabn. Code written for the original runs unchanged after one
line, the opt-in::

    import iabn.compat.enable  # noqa: F401   (or: iabn.compat.install())

which makes ``import inplace_abn`` (and ``inplace_abn.functions`` etc.) resolve to this package,
so that ``timm.layers.InplaceAbn`` and timm's TResNet with in-place ABN work too. Importing
``iabn`` alone registers nothing.

If a real ``inplace_abn`` is installed (found by ``importlib.util.find_spec``) or already
imported, :func:`install` leaves it in place, warns with :class:`CompatWarning` and returns
``False``: ``import inplace_abn`` keeps giving the original. ``install(force=True)`` replaces it
for this process.

To leave compatibility mode, :func:`to_signed` (a model) or :func:`to_signed_state_dict` (a
state_dict) converts the in-place layers' weights from ``|weight| + eps`` to signed weights
exactly; loading abs-trained weights into a signed layer without converting them warns once
(:class:`iabn.layers.options.GammaModeWarning`).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from typing import Any

import torch
from torch import nn

from ..kernels.common import ABS, SIGNED
from ..layers.batch_norm import ABN as _IabnABN
from . import abn, functions, group
from .abn import ABN, InPlaceABN, InPlaceABNSync
from .group import active_group, set_active_group

__version__ = "1.1.0+iabn"

_ALIASES = {
    "inplace_abn": __name__,
    "inplace_abn.abn": abn.__name__,
    "inplace_abn.functions": functions.__name__,
    "inplace_abn.group": group.__name__,
}
_TIMM = "timm.layers.inplace_abn"
_timm_saved: dict[str, Any] = {}


class CompatWarning(UserWarning):
    """:func:`install` did not alias ``inplace_abn`` (a real one is installed)."""


def installed() -> bool:
    """Whether ``import inplace_abn`` gives this package in this process."""
    return sys.modules.get("inplace_abn") is sys.modules[__name__]


def install(force: bool = False) -> bool:
    """Make ``import inplace_abn`` give :mod:`iabn.compat`; returns whether it does now.

    Registers ``inplace_abn``, ``inplace_abn.abn``, ``inplace_abn.functions`` and
    ``inplace_abn.group`` in ``sys.modules``. A real ``inplace_abn`` (installed or imported) is
    left alone unless ``force=True``: a :class:`CompatWarning` says where it is and ``False``
    is returned. If ``timm.layers.inplace_abn`` was imported before and holds timm's
    "please install InplaceABN" stand-ins, they are pointed at :mod:`iabn.compat.functions`.
    Calling it again is harmless.
    """
    if not installed() and not force:
        real = sys.modules.get("inplace_abn")
        where = getattr(real, "__file__", None) if real is not None else None
        if real is None:
            try:
                spec = importlib.util.find_spec("inplace_abn")
            except (ImportError, ValueError):
                spec = None
            where = None if spec is None else (spec.origin or "a namespace package")
            found = spec is not None
        else:
            found = True
        if found:
            warnings.warn(
                f"a real inplace_abn is installed ({where}); iabn.compat.install() leaves it in "
                f"place, so `import inplace_abn` gives the original package. Uninstall it, "
                f"import iabn.compat directly, or call iabn.compat.install(force=True) to use "
                f"iabn for this process.",
                CompatWarning, stacklevel=2,
            )
            return False
    for alias, target in _ALIASES.items():
        sys.modules[alias] = sys.modules[target]
    _patch_timm()
    return True


def uninstall() -> None:
    """Undo :func:`install`: remove the aliases and restore timm's stand-ins."""
    for alias, target in _ALIASES.items():
        if sys.modules.get(alias) is sys.modules.get(target):
            del sys.modules[alias]
    timm_module = sys.modules.get(_TIMM)
    if timm_module is not None and _timm_saved:
        for name, value in _timm_saved.items():
            setattr(timm_module, name, value)
        _timm_saved.clear()


def _patch_timm() -> None:
    timm_module = sys.modules.get(_TIMM)
    if timm_module is None or getattr(timm_module, "has_iabn", True) or _timm_saved:
        return  # not imported (it will import inplace_abn itself), or it has a real one
    for name in ("inplace_abn", "inplace_abn_sync", "has_iabn"):
        _timm_saved[name] = getattr(timm_module, name)
    timm_module.inplace_abn = functions.inplace_abn
    timm_module.inplace_abn_sync = functions.inplace_abn_sync
    timm_module.has_iabn = True


def to_signed(model: nn.Module) -> nn.Module:
    """Convert every ``gamma_mode="abs"`` layer of ``model`` (in place) to signed mode with
    ``weight <- |weight| + eps``: the outputs stay bit-identical (signed mode uses a weight with
    ``|weight| >= eps`` as it is), and the state_dict becomes one that ``nn.BatchNorm`` and
    default iabn layers load with the same results. Returns ``model``."""
    for module in model.modules():
        if isinstance(module, _IabnABN) and module.gamma_mode == ABS:
            if module.weight is not None:
                with torch.no_grad():
                    module.weight.copy_(module.weight.abs() + module.eps)
            module.gamma_mode = SIGNED
    return model


def to_signed_state_dict(state_dict: dict[str, Any], eps: float = 1e-5,
                         layers: list[str] | None = None) -> dict[str, Any]:
    """A copy of ``state_dict`` in which each abs-trained layer's ``weight`` is replaced by
    ``|weight| + eps``, so that signed iabn layers and ``nn.BatchNorm`` compute exactly what the
    abs layers did. ``layers``: the module names (``""`` for a lone layer) to convert; default:
    those whose state_dict metadata says ``gamma_mode="abs"`` (iabn saves it); give them
    explicitly for the original package's files, which carry no such note. ``eps`` must be the
    layers' eps."""
    metadata = getattr(state_dict, "_metadata", None)
    if layers is None:
        if metadata is None:
            raise ValueError(
                "state_dict has no metadata saying which layers are abs-trained (the original "
                "package's files have none): pass layers=[...] with the norm layers' names"
            )
        layers = [name for name, meta in metadata.items() if meta.get("gamma_mode") == ABS]
    converted = type(state_dict)(state_dict)
    for name in layers:
        key = f"{name}.weight" if name else "weight"
        if key not in state_dict:
            raise KeyError(f"layers: {name!r} has no {key!r} in the state_dict")
        converted[key] = state_dict[key].abs() + eps
    if metadata is not None:
        converted._metadata = type(metadata)(
            (name, {k: v for k, v in meta.items() if not (name in layers and k == "gamma_mode")})
            for name, meta in metadata.items()
        )
    return converted


__all__ = [
    "ABN",
    "CompatWarning",
    "InPlaceABN",
    "InPlaceABNSync",
    "abn",
    "active_group",
    "functions",
    "group",
    "install",
    "installed",
    "set_active_group",
    "to_signed",
    "to_signed_state_dict",
    "uninstall",
]
