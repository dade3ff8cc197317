"""bootstrapped_cross_entropy against a per-crop NumPy reference (values) and a per-crop torch
loop over the pixels NumPy selects (gradients); edge cases of valid-pixel counts; errors."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from iabn.tools.losses import BootstrappedCrossEntropy, bootstrapped_cross_entropy

IGNORE = 255


def _reference_selection(logits: np.ndarray, target: np.ndarray, fraction: float,
                         ignore: int):
    """Per crop: (flat pixel indices of its hardest valid pixels, their cross entropies),
    with log-softmax written out in float64."""
    n, c = logits.shape[:2]
    flat = logits.reshape(n, c, -1).astype(np.float64)
    labels = target.reshape(n, -1)
    chosen = []
    for i in range(n):
        valid = np.flatnonzero(labels[i] != ignore)
        scores = flat[i][:, valid]
        peak = scores.max(0)
        log_norm = peak + np.log(np.exp(scores - peak).sum(0))
        ce = log_norm - scores[labels[i][valid], np.arange(valid.size)]
        order = np.argsort(-ce, kind="stable")[: math.ceil(fraction * valid.size)]
        chosen.append((valid[order], ce[order]))
    return chosen


def _reference_loss(logits, target, fraction, ignore=IGNORE) -> float:
    chosen = _reference_selection(logits.numpy(), target.numpy(), fraction, ignore)
    count = sum(len(pixels) for pixels, _ in chosen)
    return sum(ce.sum() for _, ce in chosen) / count if count else 0.0


def _reference_grad(logits, target, fraction, ignore=IGNORE) -> torch.Tensor:
    """d loss / d logits from a per-crop loop over the pixels the NumPy reference chose."""
    chosen = _reference_selection(logits.numpy(), target.numpy(), fraction, ignore)
    leaf = logits.detach().double().requires_grad_()
    n, c = leaf.shape[:2]
    flat, labels = leaf.reshape(n, c, -1), target.reshape(n, -1)
    count = sum(len(pixels) for pixels, _ in chosen)
    total = leaf.sum() * 0.0
    for i, (pixels, _) in enumerate(chosen):
        index = torch.from_numpy(pixels)
        scores = flat[i][:, index]
        total = total + (torch.logsumexp(scores, 0) - scores[labels[i][index], range(len(index))]
                         ).sum()
    (total / max(count, 1)).backward()
    return leaf.grad


def _case(shape, ignored_share, seed, ignore=IGNORE):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=generator, dtype=torch.float64) * 3
    target = torch.randint(0, shape[1], shape[:1] + shape[2:], generator=generator)
    target[torch.rand(target.shape, generator=generator) < ignored_share] = ignore
    return logits, target


CASES = [
    # (shape, share of ignored pixels, top_fraction)
    ((2, 5, 6, 7), 0.0, 0.25),     # the usual 2-D crops, nothing ignored
    ((3, 4, 9, 5), 0.3, 0.25),     # ignored pixels scattered
    ((2, 3, 10), 0.2, 0.3),        # 1-D "crops"; 0.3 * v needs a careful ceil
    ((1, 3, 2, 3, 4), 0.1, 0.5),   # 3-D volumes
    ((4, 6, 5, 5), 0.5, 0.01),     # tiny fraction: at least one pixel per crop
    ((2, 5, 4, 4), 0.2, 1.0),      # everything valid is kept
]


@pytest.mark.parametrize(("shape", "ignored", "fraction"), CASES)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_value_and_gradient_match_the_per_crop_reference(shape, ignored, fraction, dtype,
                                                         atol):
    logits, target = _case(shape, ignored, seed=sum(shape))
    leaf = logits.to(dtype).clone().requires_grad_()
    loss = bootstrapped_cross_entropy(leaf, target, fraction)
    loss.backward()
    assert loss.item() == pytest.approx(_reference_loss(logits, target, fraction), abs=atol)
    torch.testing.assert_close(leaf.grad.double(), _reference_grad(logits, target, fraction),
                               atol=atol, rtol=0)


def test_fraction_one_is_plain_cross_entropy():
    logits, target = _case((3, 7, 8, 8), 0.25, seed=4)
    torch.testing.assert_close(bootstrapped_cross_entropy(logits, target, 1.0),
                               F.cross_entropy(logits, target, ignore_index=IGNORE))


def test_kept_pixels_per_crop_are_the_ceiling_of_the_fraction():
    # crop 0: 10 valid pixels -> ceil(0.25 * 10) = 3 kept; crop 1: 1 valid -> 1 kept
    logits = torch.zeros(2, 2, 12, dtype=torch.float64)
    target = torch.full((2, 12), IGNORE)
    target[0, :10] = 0
    target[1, 0] = 0
    losses = torch.arange(10, dtype=torch.float64)  # pixel j of crop 0 has loss ~ j
    logits[0, 1, :10] = losses  # class 1 scores up: class-0 pixels get harder
    logits[1, 1, 0] = 100.0
    loss = bootstrapped_cross_entropy(logits, target, 0.25)
    per_pixel = F.softplus(losses)  # -log softmax of class 0 against class 1
    expected = (per_pixel[-3:].sum() + F.softplus(torch.tensor(100.0, dtype=torch.float64))) / 4
    torch.testing.assert_close(loss, expected)


def test_a_crop_without_valid_pixels_adds_nothing():
    logits, target = _case((3, 4, 6, 6), 0.2, seed=7)
    target[1] = IGNORE
    leaf = logits.clone().requires_grad_()
    loss = bootstrapped_cross_entropy(leaf, target, 0.25)
    loss.backward()
    assert loss.item() == pytest.approx(_reference_loss(logits, target, 0.25), abs=1e-10)
    assert (leaf.grad[1] == 0).all()
    # the other crops alone give the same loss
    others = bootstrapped_cross_entropy(logits[[0, 2]], target[[0, 2]], 0.25)
    torch.testing.assert_close(loss.detach(), others)


def test_a_batch_without_valid_pixels_gives_zero_and_a_zero_gradient():
    logits, target = _case((2, 3, 4, 4), 1.0, seed=1)
    leaf = logits.clone().requires_grad_()
    loss = bootstrapped_cross_entropy(leaf, target)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(leaf.grad, torch.zeros_like(leaf))


def test_custom_ignore_index():
    logits, target = _case((2, 4, 5, 5), 0.3, seed=3, ignore=-1)
    loss = bootstrapped_cross_entropy(logits, target, 0.5, ignore_index=-1)
    assert loss.item() == pytest.approx(_reference_loss(logits, target, 0.5, -1), abs=1e-10)


def test_module_matches_the_function():
    logits, target = _case((2, 4, 5, 5), 0.3, seed=9)
    module = BootstrappedCrossEntropy(top_fraction=0.4, ignore_index=IGNORE)
    torch.testing.assert_close(module(logits, target),
                               bootstrapped_cross_entropy(logits, target, 0.4))
    assert "top_fraction=0.4" in repr(module)


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_bad_fraction_is_named(fraction):
    logits, target = _case((1, 2, 3, 3), 0.0, seed=0)
    with pytest.raises(ValueError, match="top_fraction="):
        bootstrapped_cross_entropy(logits, target, fraction)
    with pytest.raises(ValueError, match="top_fraction="):
        BootstrappedCrossEntropy(fraction)


def test_bad_shapes_and_dtypes_are_named():
    logits = torch.randn(2, 3, 4, 4)
    with pytest.raises(ValueError, match=r"target of shape \(2, 4, 5\)"):
        bootstrapped_cross_entropy(logits, torch.zeros(2, 4, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        bootstrapped_cross_entropy(logits, torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match=r"\[N, C, \*spatial\]"):
        bootstrapped_cross_entropy(torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
