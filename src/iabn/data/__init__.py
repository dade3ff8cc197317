"""Datasets and input pipelines for the training, evaluation and segmentation tools.

Everything here is written on NumPy, Pillow and torch (no torchvision). The embedded default
data is scikit-learn's bundled set of real handwritten digits (:mod:`iabn.data.digits`).
"""
