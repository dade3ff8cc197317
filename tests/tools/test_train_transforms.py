"""Image transforms against crops, formulas and resizes written independently here (Pillow's
resize is the reference for shrinking)."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from iabn.tools.data.transforms import (
    LIGHTING_EIGENVALUES,
    LIGHTING_EIGENVECTORS,
    EvalTransform,
    PCALighting,
    TrainTransform,
    TransformedDataset,
)

IDENTITY = ((0.0,) * 3, (1.0,) * 3)  # mean, std that leave [0, 1] pixels as they are


def _pixels(width=40, height=30, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _tensor(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(pixels.transpose(2, 0, 1).copy())


def _pil_resized(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    image = Image.fromarray(pixels).resize((width, height), Image.Resampling.BILINEAR)
    return np.asarray(image)


def test_eval_ten_crops_are_corners_centre_and_their_mirrors():
    full = _pixels(40, 30)
    got = EvalTransform(30, 20, True, *IDENTITY)(_tensor(full))  # shorter side already 30
    assert got.shape == (10, 3, 20, 20) and got.dtype == torch.float32
    def five(image):
        return [image[:20, :20], image[:20, 20:], image[10:, :20], image[10:, 20:],
                image[5:25, 10:30]]

    expected = five(full) + five(full[:, ::-1])  # the same five crops of the mirrored image
    for crop, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(crop.numpy().transpose(1, 2, 0), want / 255.0, rtol=1e-6)


def test_eval_five_crops_without_mirrors_are_corners_and_centre():
    """A model trained without flips is evaluated on the five crops of the image itself."""
    full = _pixels(40, 30)
    transform = EvalTransform(30, 20, True, *IDENTITY, mirror=False)
    got = transform(_tensor(full))
    assert got.shape == (5, 3, 20, 20) and transform.views == 5
    expected = [full[:20, :20], full[:20, 20:], full[10:, :20], full[10:, 20:], full[5:25, 10:30]]
    for crop, want in zip(got, expected, strict=True):
        np.testing.assert_allclose(crop.numpy().transpose(1, 2, 0), want / 255.0, rtol=1e-6)


def test_eval_transform_resizes_the_shorter_side_then_normalises_the_centre_crop():
    full = _pixels(48, 32)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    single = EvalTransform(24, 16, False, mean, std)(_tensor(full))
    ten = EvalTransform(24, 16, True, mean, std)(_tensor(full))
    assert single.shape == (3, 16, 16) and ten.shape == (10, 3, 16, 16)
    torch.testing.assert_close(ten[4], single)  # the centre crop
    resized = _pil_resized(full, 36, 24)  # 48x32 with shorter side 24
    raw = resized[4:20, 10:26].transpose(2, 0, 1) / 255.0
    reference = (raw - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]
    # torchvision's uint8 resize equals PIL's on the CPU's vector code path (measured at most
    # 1.9e-5 of an intensity level over 8 images under ATEN_CPU_CAPABILITY=avx512 and avx2)
    # and rounds up to 1 level differently on the scalar one (default: a quarter of the
    # values); asserted: 1.5 levels, after normalisation
    level = 1 / 255 / min(std)
    np.testing.assert_allclose(single.numpy(), reference, rtol=0, atol=1.5 * level)
    with pytest.raises(ValueError, match="crop 40 is larger than scale 32"):
        EvalTransform(32, 40, False, mean, std)


def _plain_train(crop, scale=None, area=(0.3, 0.6), flip=False):
    return TrainTransform(crop, scale, area, (0.75, 4 / 3), flip, 0.0, 0.0, *IDENTITY)


def test_random_resized_crop_is_a_resized_region_of_the_image():
    # A horizontal ramp: every column has one value, so a resized crop's row is a sub-ramp.
    ramp = np.tile(np.arange(64, dtype=np.uint8) * 4, (48, 1))
    image = torch.from_numpy(ramp)[None].expand(3, -1, -1)
    transform = _plain_train(16)
    for seed in range(5):
        torch.manual_seed(seed)
        crop = transform(image)
        assert crop.shape == (3, 16, 16)
        row = (crop[0, 0] * 255).round().numpy()
        assert np.all(np.diff(row) >= 0)  # not flipped, a monotone piece of the ramp
        covered = (row[-1] - row[0]) / 4 + 1
        assert covered <= 64 * (0.6 * 4 / 3) ** 0.5 + 2  # no wider than the area allows


def test_flip_mirrors_the_crop_about_half_the_time():
    ramp = torch.from_numpy(np.tile(np.arange(32, dtype=np.uint8) * 8, (32, 1)))
    image = ramp[None].expand(3, -1, -1)
    transform = TrainTransform(32, 32, (0.08, 1.0), (0.75, 4 / 3), True, 0.0, 0.0, *IDENTITY)
    torch.manual_seed(0)
    rows = [transform(image)[0, 0] for _ in range(40)]
    increasing = sum(bool(torch.all(row.diff() > 0)) for row in rows)
    decreasing = sum(bool(torch.all(row.diff() < 0)) for row in rows)
    assert increasing + decreasing == 40 and 10 <= increasing <= 30


def test_pca_lighting_adds_the_eigenvector_combination():
    x = torch.rand(3, 5, 6)
    torch.manual_seed(3)
    alpha = (torch.randn(3, dtype=torch.float64) * 0.1).numpy()
    shift = sum(alpha[j] * LIGHTING_EIGENVALUES[j] * np.array(LIGHTING_EIGENVECTORS)[:, j]
                for j in range(3))
    torch.manual_seed(3)
    got = PCALighting(0.1)(x)
    torch.testing.assert_close(got, x + torch.tensor(shift, dtype=torch.float32)[:, None, None])


def test_jitter_and_lighting_steps_have_the_configured_strength_or_are_left_out():
    steps = TrainTransform(24, None, (0.25, 1.0), (0.75, 4 / 3), True, 0.4, 0.1,
                           *IDENTITY).transforms
    (jitter,) = [step for step in steps if isinstance(step, v2.ColorJitter)]
    assert jitter.brightness == jitter.contrast == jitter.saturation == pytest.approx((0.6, 1.4))
    assert jitter.hue is None
    assert [step.std for step in steps if isinstance(step, PCALighting)] == [0.1]
    plain = _plain_train(24).transforms
    assert not any(isinstance(step, (v2.ColorJitter, PCALighting, v2.RandomHorizontalFlip))
                   for step in plain)


def test_colour_jitter_keeps_pixels_in_range_and_changes_them():
    transform = TrainTransform(30, 30, (0.08, 1.0), (0.75, 4 / 3), False, 0.9, 0.0, *IDENTITY)
    image = _tensor(_pixels(30, 30))
    torch.manual_seed(1)
    jittered = transform(image)
    assert jittered.min() >= 0 and jittered.max() <= 1
    assert not torch.allclose(jittered, image / 255.0)


def test_normalisation_matches_the_formula():
    image = _tensor(_pixels(20, 20))
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.6, 0.7)
    got = EvalTransform(20, 20, False, mean, std)(image)
    reference = (image.double() / 255 - torch.tensor(mean).view(3, 1, 1).double()) \
        / torch.tensor(std).view(3, 1, 1).double()
    torch.testing.assert_close(got, reference.float())


def test_train_transform_is_a_function_of_the_sample_seed_and_leaves_the_global_generator():
    transform = TrainTransform(24, None, (0.25, 1.0), (0.75, 4 / 3), True, 0.4, 0.1,
                               (0.5,) * 3, (0.25,) * 3)
    dataset = TransformedDataset([(_tensor(_pixels(seed=i)), i) for i in range(3)], transform)
    state = torch.get_rng_state()
    first, label = dataset[(1, 1234)]
    assert label == 1 and first.shape == (3, 24, 24) and type(first) is torch.Tensor
    torch.testing.assert_close(dataset[(1, 1234)][0], first)
    assert not torch.equal(dataset[(1, 999)][0], first)
    assert torch.equal(torch.get_rng_state(), state)


def test_fixed_scale_training_crop_is_a_window_of_the_resized_image():
    full = _pixels(60, 30)
    transform = _plain_train(20, scale=24)
    torch.manual_seed(0)
    x = transform(_tensor(full))
    assert x.shape == (3, 20, 20)
    resized = _pil_resized(full, 48, 24) / 255.0
    window = x.numpy().transpose(1, 2, 0)
    # torchvision's uint8 resize differs from Pillow's by at most one level here (measured:
    # 8 % of the pixels of this 60x30 -> 48x24 resize), hence atol of one level.
    found = [(top, left) for top in range(5) for left in range(29)
             if np.allclose(resized[top:top + 20, left:left + 20], window, rtol=0,
                            atol=1.001 / 255)]
    assert len(found) == 1
