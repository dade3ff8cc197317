"""iabn: In-Place Activated BatchNorm and memory-saving tools for training deep CNNs."""

from . import functional, memory
from .modules import ABN, InPlaceABN, InPlaceABNSync

__version__ = "0.1.0"

__all__ = ["ABN", "InPlaceABN", "InPlaceABNSync", "__version__", "functional", "memory"]
