"""scikit-learn's bundled handwritten digits: 1,797 real 8x8 greyscale scans of the digits 0-9.

They ship inside scikit-learn, so the tools can train and evaluate on real data with no download.
The split into training and validation images is stratified and deterministic: the same seed gives
the same split on every machine.
"""

from __future__ import annotations

import numpy as np

NUM_CLASSES = 10
IMAGE_SIZE = 8


def _sklearn_datasets():
    try:
        from sklearn import datasets
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the embedded digits data needs scikit-learn: pip install 'iabn[tools]' "
            "(or pip install scikit-learn)"
        ) from error
    return datasets


def load_digits_uint8() -> tuple[np.ndarray, np.ndarray]:
    """All digits as ``(images, labels)``: images ``uint8 [N, 8, 8]`` in 0..255 (ink is bright),
    labels ``int64 [N]`` in 0..9."""
    bunch = _sklearn_datasets().load_digits()
    # The scans are 4-bit counts of ink (0..16); stretch them to the 8-bit range of photographs.
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    return images, bunch.target.astype(np.int64)


def split_indices(labels: np.ndarray, val_fraction: float = 0.2,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Stratified deterministic split: ``(train_indices, val_indices)``, both sorted.

    Every class contributes ``round(val_fraction * count)`` images to validation, chosen by a
    permutation drawn from ``numpy.random.default_rng(seed)``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    rng = np.random.default_rng(seed)
    val: list[np.ndarray] = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        members = members[rng.permutation(len(members))]
        val.append(members[: round(val_fraction * len(members))])
    val_indices = np.sort(np.concatenate(val))
    train_indices = np.setdiff1d(np.arange(len(labels)), val_indices)
    return train_indices, val_indices
