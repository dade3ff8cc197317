"""iabn: In-Place Activated BatchNorm and memory-saving tools for training deep CNNs.

The library core is this package's modules; the command-line tools (training, data,
segmentation, benchmarks, the ``iabn`` command) live in :mod:`iabn.tools`.

The names below load on first use (PEP 562), so ``import iabn`` imports no torch: the ``iabn``
command, whose modules live in this package, checks its arguments before paying the seconds
torch takes to import. ``iabn.InPlaceABN`` (or ``from iabn import InPlaceABN``) imports it.
"""

import importlib
import importlib.util
import os

__version__ = "0.1.0"

#: Public name -> (module, attribute in it; None for the module itself).
_LAZY = {
    "ABN": ("layers.batch_norm", "ABN"),
    "InPlaceABN": ("layers.batch_norm", "InPlaceABN"),
    "ABNSync": ("distributed", "ABNSync"),
    "InPlaceABNSync": ("distributed", "InPlaceABNSync"),
    "convert_local": ("distributed", "convert_local"),
    "convert_sync": ("distributed", "convert_sync"),
    "BNActConv": ("memory.bn_act_conv", "BNActConv"),
    "GroupNormAct": ("layers.group_norm", "GroupNormAct"),
    "InPlaceGroupNormAct": ("layers.group_norm", "InPlaceGroupNormAct"),
    "InPlaceLayerNorm": ("layers.layer_norm", "InPlaceLayerNorm"),
    "InPlaceLayerNorm2d": ("layers.layer_norm", "InPlaceLayerNorm2d"),
    "InPlaceRMSNorm": ("layers.layer_norm", "InPlaceRMSNorm"),
    "InPlaceGELU": ("layers.activation", "InPlaceGELU"),
    "InPlaceSiLU": ("layers.activation", "InPlaceSiLU"),
    "InPlaceMish": ("layers.activation", "InPlaceMish"),
    "InPlaceSoftplus": ("layers.activation", "InPlaceSoftplus"),
    "OffloadModel": ("memory.offloading", "OffloadModel"),
    "Offloader": ("memory.offloading", "Offloader"),
    "offload": ("memory.offloading", "offload"),
    # the conversion package was a third of `import iabn`'s own time (12 of 35 ms, measured on
    # CPU with -X importtime), and iabn.plan also imports SciPy, to solve
    "convert": ("conversion", "convert"),
    "ConversionReport": ("conversion", "ConversionReport"),
    "plan": ("planning", "plan"),
    "PlanReport": ("planning", "PlanReport"),
    "debug": ("debug", None),
    "functional": ("functional", None),
    "memory": ("memory", None),
    # as the README writes them; importing iabn.compat registers nothing (iabn.compat.enable or
    # install() does)
    "compat": ("compat", None),
    "models": ("models", None),
}


def __getattr__(name: str):
    if name in _LAZY:
        module_name, attribute = _LAZY[name]
    elif (not name.startswith("_")
          and importlib.util.find_spec(f"{__name__}.{name}") is not None):
        # another submodule (iabn.distributed, iabn.kernels, ...): `import iabn` used to load
        # them all, and code reached them as attributes
        module_name, attribute = name, None
    else:
        raise AttributeError(f"module 'iabn' has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{module_name}")
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


# IABN_DEBUG_INPLACE=1 turns the debug mode on for the whole process when iabn is imported
# (iabn.debug reads it, and refuses a value it does not know, when it is imported)
if os.environ.get("IABN_DEBUG_INPLACE", "").strip():
    from . import debug

__all__ = [
    "ABN",
    "ABNSync",
    "BNActConv",
    "ConversionReport",
    "GroupNormAct",
    "InPlaceABN",
    "InPlaceABNSync",
    "InPlaceGELU",
    "InPlaceGroupNormAct",
    "InPlaceLayerNorm",
    "InPlaceLayerNorm2d",
    "InPlaceMish",
    "InPlaceRMSNorm",
    "InPlaceSiLU",
    "InPlaceSoftplus",
    "OffloadModel",
    "Offloader",
    "PlanReport",
    "__version__",
    "convert",
    "convert_local",
    "convert_sync",
    "debug",
    "functional",
    "memory",
    "offload",
    "plan",
]
