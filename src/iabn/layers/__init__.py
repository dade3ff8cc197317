"""The norm + activation modules and their checks: :mod:`.batch_norm` (``ABN``, ``InPlaceABN``),
:mod:`.group_norm` (``GroupNormAct``, ``InPlaceGroupNormAct``) and :mod:`.checks` (the
validation the modules and the functional forms share). Public names: ``iabn.ABN``,
``iabn.InPlaceABN``, ``iabn.GroupNormAct``, ``iabn.InPlaceGroupNormAct``."""
