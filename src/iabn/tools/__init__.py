"""The applications built on the iabn core: the ``iabn`` command and what it runs.

:mod:`.cli` (the command line), :mod:`.training` (the training engine, classification and
segmentation tasks), :mod:`.data` (datasets, transforms, samplers), :mod:`.segment` (``iabn
segment``), :mod:`.metrics`, :mod:`.losses` and :mod:`.bench` (benchmark helpers behind ``iabn
bench``, ``iabn memory`` and benchmarks/).

The tools depend on the core (layers, kernels, memory, offloading, conversion, models), never
the reverse: no module outside this package imports one inside it (tests/core/test_imports.py), so
``import iabn`` does not load them.
"""
