"""Image transforms against crops, formulas and resizes written independently here."""

import numpy as np
import pytest
import torch
from PIL import Image

from iabn.data.transforms import (
    LIGHTING_EIGENVALUES,
    LIGHTING_EIGENVECTORS,
    EvalTransform,
    TrainTransform,
    TransformedDataset,
    center_crop,
    color_jitter,
    normalize,
    pca_lighting,
    random_resized_crop,
    resize_shorter_side,
    ten_crops,
    to_tensor,
)


def _image(width=40, height=30, seed=0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int64)


def test_to_tensor_is_chw_in_unit_range():
    image = _image()
    x = to_tensor(image)
    assert x.shape == (3, 30, 40) and x.dtype == torch.float32
    np.testing.assert_allclose(x.numpy(), _pixels(image).transpose(2, 0, 1) / 255.0, rtol=1e-6)


def test_resize_shorter_side_keeps_the_aspect_ratio():
    assert resize_shorter_side(_image(40, 30), 15).size == (20, 15)
    assert resize_shorter_side(_image(30, 40), 60).size == (60, 80)
    image = _image(40, 30)
    assert resize_shorter_side(image, 30) is image


def test_ten_crops_are_corners_centre_and_their_mirrors():
    image, size = _image(40, 30), 20
    full = _pixels(image)
    expected = [full[:20, :20], full[:20, 20:], full[10:, :20], full[10:, 20:],
                full[5:25, 10:30]]
    expected += [crop[:, ::-1] for crop in expected]
    crops = ten_crops(image, size)
    assert len(crops) == 10
    for got, want in zip(crops, expected, strict=True):
        np.testing.assert_array_equal(_pixels(got), want)
    np.testing.assert_array_equal(_pixels(center_crop(image, size)), expected[4])


def test_eval_transform_stacks_ten_normalised_crops():
    image = _image(48, 32)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    single = EvalTransform(32, 24, False, mean, std)(image)
    ten = EvalTransform(32, 24, True, mean, std)(image)
    assert single.shape == (3, 24, 24) and ten.shape == (10, 3, 24, 24)
    torch.testing.assert_close(ten[4], single)  # the centre crop
    raw = _pixels(center_crop(resize_shorter_side(image, 32), 24)).transpose(2, 0, 1) / 255.0
    reference = (raw - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    np.testing.assert_allclose(single.numpy(), reference, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="crop 40 is larger than scale 32"):
        EvalTransform(32, 40, False, mean, std)


def test_random_resized_crop_is_a_resized_region_of_the_image():
    # A horizontal ramp: every column has one value, so a resized crop's row is a sub-ramp.
    ramp = np.tile(np.arange(64, dtype=np.uint8) * 4, (48, 1))
    image = Image.fromarray(ramp).convert("RGB")
    for seed in range(5):
        crop = random_resized_crop(image, 16, (0.3, 0.6), (0.75, 4 / 3),
                                   np.random.default_rng(seed))
        assert crop.size == (16, 16)
        row = _pixels(crop)[0, :, 0]
        assert np.all(np.diff(row) >= 0)  # not flipped, a monotone piece of the ramp
        covered = (row[-1] - row[0]) / 4 + 1
        assert covered <= 64 * (0.6 * 4 / 3) ** 0.5 + 2  # no wider than the area allows


def test_random_resized_crop_depends_only_on_the_generator():
    image = _image(50, 40)
    first = random_resized_crop(image, 24, (0.08, 1), (0.75, 4 / 3), np.random.default_rng(7))
    again = random_resized_crop(image, 24, (0.08, 1), (0.75, 4 / 3), np.random.default_rng(7))
    np.testing.assert_array_equal(_pixels(first), _pixels(again))


def test_pca_lighting_adds_the_eigenvector_combination():
    x = torch.rand(3, 5, 6)
    alpha = np.random.default_rng(3).normal(0.0, 0.1, size=3)
    shift = sum(alpha[j] * LIGHTING_EIGENVALUES[j] * np.array(LIGHTING_EIGENVECTORS)[:, j]
                for j in range(3))
    got = pca_lighting(x, 0.1, np.random.default_rng(3))
    torch.testing.assert_close(got, x + torch.tensor(shift, dtype=torch.float32)[:, None, None])


def test_colour_jitter_of_strength_zero_is_the_identity_and_stays_in_range():
    x = torch.rand(3, 8, 8)
    torch.testing.assert_close(color_jitter(x.clone(), 0.0, np.random.default_rng(0)), x)
    jittered = color_jitter(x.clone(), 0.9, np.random.default_rng(1))
    assert jittered.min() >= 0 and jittered.max() <= 1 and not torch.equal(jittered, x)


class _FixedDraws:
    """A stand-in generator whose ``uniform`` returns the given factors."""

    def __init__(self, factors):
        self.factors = np.array(factors)

    def uniform(self, low, high, size):
        assert size == len(self.factors) and np.all((low <= self.factors) & (self.factors <= high))
        return self.factors


def test_colour_jitter_blends_with_black_mean_grey_and_grey_image():
    x = torch.rand(3, 4, 5) * 0.5
    b, c, s = 1.2, 0.7, 0.6
    luma = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
    y = x * b                                                     # brightness
    y = c * y + (1 - c) * (y * luma).sum(0).mean()                 # contrast
    y = s * y + (1 - s) * (y * luma).sum(0, keepdim=True)          # saturation
    got = color_jitter(x.clone(), 0.5, _FixedDraws([b, c, s]))
    torch.testing.assert_close(got, y.clamp(0, 1))
    assert not torch.allclose(got, x)


def test_normalize_matches_the_formula():
    x = torch.rand(2, 3, 4, 4)
    got = normalize(x, (0.1, 0.2, 0.3), (0.5, 0.6, 0.7))
    mean = torch.tensor([0.1, 0.2, 0.3]).view(3, 1, 1)
    std = torch.tensor([0.5, 0.6, 0.7]).view(3, 1, 1)
    torch.testing.assert_close(got, (x - mean) / std)


def test_train_transform_is_a_function_of_the_sample_seed():
    transform = TrainTransform(24, None, (0.25, 1.0), (0.75, 4 / 3), True, 0.4, 0.1,
                               (0.5,) * 3, (0.25,) * 3)
    dataset = TransformedDataset([(_image(seed=i), i) for i in range(3)], transform)
    first, label = dataset[(1, 1234)]
    assert label == 1 and first.shape == (3, 24, 24)
    torch.testing.assert_close(dataset[(1, 1234)][0], first)
    assert not torch.equal(dataset[(1, 999)][0], first)


def test_fixed_scale_training_crop_has_the_crop_size():
    transform = TrainTransform(20, 24, (0.08, 1.0), (0.75, 4 / 3), False, 0.0, 0.0,
                               (0.0,) * 3, (1.0,) * 3)
    x = transform(_image(60, 30), np.random.default_rng(0))
    assert x.shape == (3, 20, 20)
    # Without jitter, lighting and flip the crop is a window of the resized image.
    resized = _pixels(resize_shorter_side(_image(60, 30), 24)) / 255.0
    window = (x.numpy().transpose(1, 2, 0) * 255).round() / 255
    found = any(np.allclose(resized[t:t + 20, left:left + 20], window, atol=1e-6)
                for t in range(5) for left in range(resized.shape[1] - 19))
    assert found
