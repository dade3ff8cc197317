"""Launches and bytes of the output-only layer and RMS norms' backward, counted by
``iabn.measure.traffic`` (its rules) for ``layer(leaf.clone()).backward(grad)``, in units of
``A``, one activation's bytes (float32, every feature rebuilt).

Derivation of the reference backward (``kernels/row_norm._grads``), full-size tensors only:

- rebuild ``xhat``: ``addcdiv(-b/w, y, w, out=xhat)`` (layer norm), ``div(y, w, out=xhat)``
  (RMS norm): reads ``y``, writes ``xhat``: 2 A;
- ``native_layer_norm_backward(dy, xhat, mean=0, rstd=1, w, b)``: reads ``dy`` and ``xhat``,
  writes the bracket: 3 A;
- RMS norm only, ``mv(dy, w)`` (the row's mean of ``w dy``, added back): reads ``dy``: 1 A;
- ``dx``: ``mul(bracket, rstd, out=bracket)`` / ``addcmul(.., bracket, rstd, out=bracket)``:
  reads and writes the bracket: 2 A.

Layer norm 7 A, RMS norm 8 A (``nn.LayerNorm``'s one fused operator: 3 A; ``nn.RMSNorm``'s
composite backward on CPU: 24 A). That is ATen's form; on a CPU with Numba, float32, every
feature rebuilt, one loop (``kernels/cpu_loops.row_norm_backward``) reads ``y`` and ``dy`` and
writes ``dx``: 3 A, ``dx`` its only full-size allocation."""

import pytest
import torch
from torch import nn

import iabn
from iabn.kernels import cpu_loops
from iabn.kernels.backends import use_backend
from iabn.measure import traffic

SHAPE = (2, 5, 16)


def _rebuilt_everywhere(layer):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(layer.weight.shape, generator=g) + 0.5)
        if getattr(layer, "bias", None) is not None:
            layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g))
    return layer


def _step(layer, backend="reference"):
    torch.manual_seed(0)
    leaf = torch.randn(SHAPE).requires_grad_()
    with use_backend(backend):
        step = traffic.count_step(_rebuilt_everywhere(layer), leaf, torch.randn(SHAPE))
    return step, leaf.numel() * leaf.element_size()


@pytest.mark.parametrize("kind, moved", [("layer", 7), ("rms", 8)])
@pytest.mark.parametrize("overwrite_input", [False, True])
def test_reference_backward_moves_seven_or_eight_activations(kind, moved, overwrite_input,
                                                              monkeypatch):
    monkeypatch.setattr(cpu_loops, "runs_on", lambda *tensors: False)  # ATen's operations
    layer = (iabn.InPlaceLayerNorm if kind == "layer" else iabn.InPlaceRMSNorm)(
        SHAPE[-1], overwrite_input=overwrite_input)
    step, a = _step(layer)
    assert step.backward.moved == moved * a, step.backward.names()
    # what the backward allocates at full size: xhat and the bracket (dx)
    assert step.backward.peak_bytes == 2 * a


@pytest.mark.skipif(not cpu_loops.available(), reason="Numba is not installed")
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("overwrite_input", [False, True])
def test_cpu_loop_backward_moves_three_activations(kind, overwrite_input):
    layer = (iabn.InPlaceLayerNorm if kind == "layer" else iabn.InPlaceRMSNorm)(
        SHAPE[-1], overwrite_input=overwrite_input)
    step, a = _step(layer)
    assert step.backward.moved == 3 * a, step.backward.names()
    assert step.backward.peak_bytes == a  # dx


def test_pytorch_s_layer_norm_moves_three():
    """The counter's view of nn.LayerNorm, for the table beside ours."""
    step, a = _step(nn.LayerNorm(SHAPE[-1]))
    assert step.backward.moved == 3 * a and len(step.backward.launches) == 1


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("overwrite_input", [False, True])
def test_forward_moves_what_pytorch_s_module_moves(kind, overwrite_input):
    """The forward is PyTorch's kernel, which also gives the ``rstd`` backward keeps (RMS norm:
    ``aten._fused_rms_norm``, where ``rstd`` was computed again beside ``torch.rms_norm``, one
    more read of the input): the same activation-sized bytes as ``nn.LayerNorm`` /
    ``nn.RMSNorm``'s forward, plus the copy into the input where it is overwritten; the
    other operations are on the ``(D,)`` weights (which features keep ``xhat``)."""
    ours = (iabn.InPlaceLayerNorm if kind == "layer" else iabn.InPlaceRMSNorm)(
        SHAPE[-1], overwrite_input=overwrite_input)
    theirs = (nn.LayerNorm if kind == "layer" else nn.RMSNorm)(SHAPE[-1])
    step, a = _step(ours)
    reference, _ = _step(theirs)
    assert step.forward.moved == reference.forward.moved + 2 * a * overwrite_input, (
        step.forward.names())
