"""iabn: In-Place Activated BatchNorm and memory-saving tools for training deep CNNs."""

from . import debug, functional, memory
from .blocks import BNActConv
from .conversion import ConversionReport, convert
from .distributed import ABNSync, InPlaceABNSync, convert_local, convert_sync
from .modules import ABN, InPlaceABN
from .offloading import Offloader, OffloadModel, offload

__version__ = "0.1.0"

__all__ = [
    "ABN",
    "ABNSync",
    "BNActConv",
    "ConversionReport",
    "InPlaceABN",
    "InPlaceABNSync",
    "OffloadModel",
    "Offloader",
    "__version__",
    "convert",
    "convert_local",
    "convert_sync",
    "debug",
    "functional",
    "memory",
    "offload",
]
