"""Converting existing models to iabn's layers (docs/design.md, "Converting existing models")."""

from .converter import ConversionWarning, convert
from .decide import POLICIES
from .report import ConversionReport, LayerRow
from .rewrite import TrainEvalGraphModule

__all__ = ["POLICIES", "ConversionReport", "ConversionWarning", "LayerRow",
           "TrainEvalGraphModule", "convert"]
