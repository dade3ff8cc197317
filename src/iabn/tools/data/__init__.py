"""Datasets and input pipelines for the training, evaluation and segmentation tools.

Written on torchvision (transforms.v2, datasets, io), NumPy and torch. The embedded default
data is scikit-learn's bundled set of real handwritten digits (:mod:`iabn.tools.data.digits`).
"""
