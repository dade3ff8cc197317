"""The embedded digits data: real images, value range, and a deterministic stratified split."""

import numpy as np
import pytest

from iabn.tools.data.digits import NUM_CLASSES, load_digits_uint8, split_indices


def test_digits_are_the_real_sklearn_scans():
    images, labels = load_digits_uint8()
    assert images.shape == (1797, 8, 8) and images.dtype == np.uint8
    assert labels.shape == (1797,) and set(labels.tolist()) == set(range(NUM_CLASSES))
    assert images.max() == 255 and images.min() == 0


def test_split_is_disjoint_complete_stratified_and_deterministic():
    _, labels = load_digits_uint8()
    train, val = split_indices(labels, 0.2, seed=3)
    assert len(np.intersect1d(train, val)) == 0
    assert len(train) + len(val) == len(labels)
    for cls in range(NUM_CLASSES):
        share = np.sum(labels[val] == cls) / np.sum(labels == cls)
        assert abs(share - 0.2) < 0.01
    again = split_indices(labels, 0.2, seed=3)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], val)
    other = split_indices(labels, 0.2, seed=4)
    assert not np.array_equal(other[1], val)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        split_indices(np.zeros(10, dtype=np.int64), fraction)
