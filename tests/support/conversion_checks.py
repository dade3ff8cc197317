"""Checks shared by the conversion tests of whole models (tests/conversion/): the converted
model computes what the original computes, and the report's bytes are the models' own."""

import copy

import torch
from torch.utils._pytree import tree_leaves

from iabn.memory import saved_tensor_bytes

# The converted models compute the same float64 operations, some in another order (the
# in-place layers' backward); the largest difference measured over the models of
# test_convert_families.py is 1.5e-13 of the compared tensor's largest value (SSDlite's
# gradients; the hand-made families 5.9e-14; torch 2.14.1, CPU): 1e-12 is ~6.5x that.
RELATIVE_TOLERANCE = 1e-12
# An in-place GELU or SiLU without a norm recovers its input by Newton steps whose float64
# error near the activation's minimum is ~1e-9 of the gradient there (the minimum's
# conditioning: docs/design.md, "In-place activations without a norm"); summed into the
# next layer's weight gradient that measured 3.8e-12 relative (timm's Swin-T, the worst of
# test_convert_transformers.py's models): 1e-11 is ~2.6x that.
ACTIVATION_TOLERANCE = 1e-11


def _step(model, x, training):
    """Outputs, and the gradients of the input (a floating-point one) and every parameter,
    of a weighted sum of the outputs, in one mode, with the random numbers seeded."""
    model = copy.deepcopy(model).train(training)
    if x.is_floating_point():
        x = x.clone().requires_grad_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same dropout and stochastic depth in both models
        out = model(x)
    outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    names, weights = zip(*model.named_parameters(), strict=True)
    loss = sum((t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum()
               for t in outs)
    sources = [x, *weights] if x.requires_grad else list(weights)
    grads = torch.autograd.grad(loss, sources, allow_unused=True)
    keys = ["input", *names] if x.requires_grad else list(names)
    return [t.detach() for t in outs], dict(zip(keys, grads, strict=True))


def assert_same_model(original, converted, x, tolerance=RELATIVE_TOLERANCE):
    """Outputs and gradients equal in train and eval mode, relative to the largest of each.

    A gradient that is zero but for rounding (a bias before a norm that removes it: its
    entries are ~1e-16 where the others are ~1) is compared relative to a thousandth of
    the largest gradient instead: relative to itself, its rounding is all there is."""
    worst = 0.0
    for training in (True, False):
        expected_out, expected_grads = _step(original, x, training)
        out, grads = _step(converted, x, training)
        assert grads.keys() == expected_grads.keys()
        largest = max(float(g.abs().max()) for g in expected_grads.values() if g is not None)
        for got, want in [*zip(out, expected_out, strict=True),
                          *((grads[k], expected_grads[k]) for k in grads)]:
            assert (got is None) == (want is None)
            if got is not None:
                scale = max(float(want.abs().max()), 1e-3 * largest, 1e-300)
                worst = max(worst, float((got - want).abs().max()) / scale)
    print(f"largest relative difference {worst:.3g}")
    assert worst <= tolerance, worst


def assert_bytes_are_real(model, converted, report, x):
    """The report's bytes are what each model saves (counted as convert counts: seed 0)."""
    args = x if isinstance(x, tuple) else (x,)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        assert report.saved_before == saved_tensor_bytes(copy.deepcopy(model).train(), *args)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        assert report.saved_after == saved_tensor_bytes(copy.deepcopy(converted).train(),
                                                        *args)
