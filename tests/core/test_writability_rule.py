"""The run-time writability rule (docs/design.md, "The in-place contract"): an in-place layer
whose input autograd or an engine does not let be overwritten computes output-only. It neither
raises nor writes into that input, and its outputs and gradients are PyTorch's own modules'
(float64). A computed tensor the rule does not cover is still overwritten, and the user's own
leaf that requires grad is still refused."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn

C = 6
#: measured: the largest difference of these cases against torch's modules is 5.1e-16 (float64,
#: relative to the largest of each tensor); 100x that
TOLERANCE = 5.1e-14


class _Identity(torch.autograd.Function):
    """A custom Function returning its input as-is, as FSDP2's RegisterPostBackwardFunction."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g


def _channels_last_norm(norm):
    return lambda x: norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _layers():
    """(name, iabn layer, torch reference on an (N, C, H, W) tensor)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(C).double()
    gn = nn.GroupNorm(2, C).double()
    ln = nn.LayerNorm(C).double()
    rms = nn.RMSNorm(C).double()
    for m in (bn, gn, ln, rms):
        nn.init.uniform_(m.weight, 0.5, 1.5)
        if getattr(m, "bias", None) is not None:
            nn.init.uniform_(m.bias, -0.5, 0.5)
    abn = iabn.InPlaceABN(C, activation="leaky_relu", activation_param=0.1).double()
    abn.load_state_dict(bn.state_dict())
    gna = iabn.InPlaceGroupNormAct(2, C, activation="leaky_relu", activation_param=0.1).double()
    gna.load_state_dict(gn.state_dict())
    iln = iabn.InPlaceLayerNorm(C).double()
    iln.load_state_dict(ln.state_dict())
    irms = iabn.InPlaceRMSNorm(C).double()
    irms.load_state_dict(rms.state_dict())
    return [
        ("InPlaceABN", abn, lambda x: F.leaky_relu(bn(x), 0.1), [bn.weight, bn.bias],
         [abn.weight, abn.bias]),
        ("InPlaceGroupNormAct", gna, lambda x: F.leaky_relu(gn(x), 0.1), [gn.weight, gn.bias],
         [gna.weight, gna.bias]),
        ("InPlaceLayerNorm", _channels_last_norm(iln), _channels_last_norm(ln),
         [ln.weight, ln.bias], [iln.weight, iln.bias]),
        ("InPlaceRMSNorm", _channels_last_norm(irms), _channels_last_norm(rms), [rms.weight],
         [irms.weight]),
        ("InPlaceGELU", iabn.InPlaceGELU(), F.gelu, [], []),
        ("InPlaceSiLU", iabn.InPlaceSiLU(), F.silu, [], []),
    ]


LAYERS = _layers()


def _views(base):
    """name -> a view of ``base`` (computed, requires grad) that autograd refuses to let be
    overwritten."""
    with torch.no_grad():
        no_grad_view = base[2:]
    return {
        "chunk": base.chunk(2)[0],
        "unbind": base.unbind(0)[0].unsqueeze(0),
        "split": base.split(2)[1],
        "custom_function": _Identity.apply(base[:2] * 1),
        "no_grad_view": no_grad_view,
    }


def _relative(got, want):
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)


@pytest.mark.parametrize("view", ["chunk", "unbind", "split", "custom_function", "no_grad_view"])
@pytest.mark.parametrize("case", LAYERS, ids=[c[0] for c in LAYERS])
def test_a_refused_view_is_computed_output_only(case, view):
    _, layer, reference, ref_params, params = case
    if view == "no_grad_view" and not params:
        pytest.skip("nothing requires grad: autograd lets the view be overwritten, and it is")
    torch.manual_seed(1)
    source = torch.randn(4, C, 3, 3, dtype=torch.float64, requires_grad=True)
    dz = torch.randn(2 if view != "unbind" else 1, C, 3, 3, dtype=torch.float64)

    def run(fn, wrt):
        base = source * 1.5  # computed: a view of it may be overwritten but for its kind
        x = _views(base)[view]
        before = x.detach().clone()
        out = fn(x)
        assert torch.equal(x.detach(), before), "the input was written"
        wanted = [source, *wrt] if view != "no_grad_view" else wrt  # no history there
        grads = torch.autograd.grad(out, wanted, dz, allow_unused=True)
        return out.detach(), grads

    want_out, want_grads = run(reference, ref_params)
    got_out, got_grads = run(layer, params)
    assert _relative(got_out, want_out) <= TOLERANCE
    for got, want in zip(got_grads, want_grads, strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            assert _relative(got, want) <= TOLERANCE


@pytest.mark.parametrize("case", LAYERS, ids=[c[0] for c in LAYERS])
def test_a_recorded_input_under_no_grad_is_not_written(case):
    """A reentrant checkpoint's first forward: no_grad, an input autograd recorded (which the
    checkpoint saved for its recomputation)."""
    _, layer, reference, _, _ = case
    x = torch.randn(2, C, 3, 3, dtype=torch.float64, requires_grad=True) * 1
    before = x.detach().clone()
    with torch.no_grad():
        out = layer(x)
        want = reference(before)
    assert torch.equal(x.detach(), before)
    assert _relative(out, want) <= TOLERANCE


@pytest.mark.parametrize("case", LAYERS, ids=[c[0] for c in LAYERS])
def test_a_computed_tensor_is_still_overwritten(case):
    name, layer, _, _, _ = case
    x = torch.randn(2, C, 3, 3, dtype=torch.float64, requires_grad=True) * 1
    if name in ("InPlaceLayerNorm", "InPlaceRMSNorm"):  # through the permuted view
        out = layer(x)
        assert out.data_ptr() == x.data_ptr()
    else:
        assert layer(x) is x


@pytest.mark.parametrize("case", LAYERS, ids=[c[0] for c in LAYERS])
def test_the_user_s_own_leaf_is_still_refused(case):
    _, layer, _, _, _ = case
    x = torch.randn(2, C, 3, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        layer(x)


def test_the_debug_mode_does_not_poison_a_refused_view():
    layer = iabn.InPlaceGELU()
    base = torch.randn(4, C, dtype=torch.float64, requires_grad=True) * 1
    first, second = base.chunk(2)
    with iabn.debug.poison_overwritten():
        out = layer(first)
        kept = (first * second).sum()  # reading the input afterwards is no error: not written
    assert torch.isfinite(kept) and torch.equal(out, F.gelu(first.detach()))
