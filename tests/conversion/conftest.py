"""The conversion tests' fixture ``analysis``: a test that takes it runs on both of
iabn.convert's ways to a graph (tests/support/analysis_paths.py)."""

from analysis_paths import analysis  # noqa: F401  (a fixture, found by pytest here)
