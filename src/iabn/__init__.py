"""iabn: In-Place Activated BatchNorm and memory-saving tools for training deep CNNs.

The library core is this package's modules; the command-line tools (training, data,
segmentation, benchmarks, the ``iabn`` command) live in :mod:`iabn.tools`.
"""

from . import _moved, debug, functional, memory
from .blocks import BNActConv
from .distributed import ABNSync, InPlaceABNSync, convert_local, convert_sync
from .group_norm import GroupNormAct, InPlaceGroupNormAct
from .modules import ABN, InPlaceABN
from .offloading import Offloader, OffloadModel, offload

__version__ = "0.1.0"

# The tools' old paths (iabn.training, iabn.cli, ...) still import, with a DeprecationWarning;
# installing the finder imports no tool code.
_moved.install()



def __getattr__(name: str):
    # iabn.convert and iabn.ConversionReport load on first use (PEP 562): the conversion
    # package was a third of `import iabn`'s own time (12 of 35 ms, measured on CPU with
    # -X importtime) and a training script never calls it.
    if name in ("convert", "ConversionReport"):
        from . import conversion

        return getattr(conversion, name)
    # iabn.plan likewise: it imports the conversion package and, to solve, SciPy
    if name in ("plan", "PlanReport"):
        from . import planning

        return getattr(planning, name)
    raise AttributeError(f"module 'iabn' has no attribute {name!r}")

__all__ = [
    "ABN",
    "ABNSync",
    "BNActConv",
    "ConversionReport",
    "GroupNormAct",
    "InPlaceABN",
    "InPlaceABNSync",
    "InPlaceGroupNormAct",
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
