"""Old import paths of the tools, kept for one release (the tools moved to iabn.tools).

``iabn.training``, ``iabn.data``, ``iabn.segment``, ``iabn.metrics``, ``iabn.losses``,
``iabn.bench`` and ``iabn.cli`` (and their submodules, e.g. ``iabn.training.config``) now live
under :mod:`iabn.tools`. Importing an old name gives the very module object of the new name, so
``monkeypatch``, ``isinstance`` and pickles by the old name keep working, and emits one
:class:`DeprecationWarning` naming the new path (one per old name: later imports find it in
``sys.modules``).

A finder at the front of ``sys.meta_path`` does this. It must come before the standard path
finder: once ``iabn.training`` is in ``sys.modules``, its ``__path__`` (iabn/tools/training)
would let that finder load ``iabn.training.config`` a second time as a separate module. This
module imports nothing from the tools until an old name is asked for, so ``import iabn`` stays
light (tests/test_imports.py).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: Top-level names under ``iabn`` that moved to ``iabn.tools``. Remove this module (and its
#: install in iabn/__init__.py) in the release after 0.1.
MOVED = frozenset({"training", "data", "segment", "metrics", "losses", "bench", "cli"})

_REMOVAL = "the old path will be removed in the next release"


def new_name(fullname: str) -> str | None:
    """``iabn.tools.<old>[.<sub>]`` for an old ``iabn.<old>[.<sub>]``, else None."""
    parts = fullname.split(".")
    if len(parts) >= 2 and parts[0] == "iabn" and parts[1] in MOVED:
        return ".".join(("iabn", "tools", *parts[1:]))
    return None


# Plain classes, not importlib.abc's bases: the import protocol is duck-typed, and importlib.abc
# imports importlib.resources (pathlib, tempfile, typing: ~15 ms) before torch would.
class _MovedFinder:
    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


class _AliasLoader:
    """Loads an old name as the already-imported (or now imported) module of the new name."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec) -> ModuleType:
        # Imported before warning: a missing module (a typo under an old name) raises the
        # usual ModuleNotFoundError naming the new path and warns about nothing.
        module = importlib.import_module(self.new)
        # stacklevel 2: the import machinery's own frames are skipped, so the warning points
        # at the line that imported the old name.
        warnings.warn(f"{spec.name} is deprecated: it moved to {self.new} ({_REMOVAL})",
                      DeprecationWarning, stacklevel=2)
        # The import system keeps the module's own __name__, __spec__, __path__ and __file__
        # (it fills only missing attributes), so the module stays the one of the new name.
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: create_module returned the new module, already executed."""

    def get_code(self, fullname: str):
        # runpy (`python -m iabn.cli`) asks for code to run as __main__; running the moved code
        # under the old package would break its relative imports, so name the new command.
        raise ImportError(f"{fullname} moved to {self.new}: run `python -m {self.new}` "
                          f"(or `python -m iabn` for the command line)")


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once; reloading iabn adds no second one)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
