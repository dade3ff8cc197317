"""Measuring tools the layers never use: :mod:`.traffic` (launches, bytes moved and backward
memory of a step) and :mod:`.trial_runs` (running a model to measure it without a trace: its
state preserved and its randomness repeated)."""
