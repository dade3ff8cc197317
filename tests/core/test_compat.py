"""iabn.compat: the original inplace_abn package's API, checked against PyTorch's own
batch norm in float64: the original computes act((|w| + eps) * xhat + b) in its in-place layers
(with d/dw = -dg where w < 0, else +dg) and plain BatchNorm + activation in its ABN."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from iabn import compat
from iabn.compat import functions

SRC = str(Path(iabn.__file__).resolve().parents[1])


@pytest.fixture
def opted_in():
    assert compat.install()
    yield
    compat.uninstall()


def _run(code, tmp_path, extra_path=()):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), SRC])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def _reference(x, w, b, rm, rv, training, momentum, eps, activation, param, abs_scale):
    """F.batch_norm + activation; the original's in-place scale |w| + eps with its gradient
    (+1 at w = 0) when abs_scale, through autograd."""
    if w is not None and abs_scale:
        sign = torch.where(w.detach() < 0, -1.0, 1.0).to(w.dtype)
        w = w * sign + eps
    y = F.batch_norm(x, rm, rv, w, b, training, momentum, eps)
    if activation == "leaky_relu":
        return F.leaky_relu(y, param)
    if activation == "elu":
        return F.elu(y, param)
    if activation == "relu":
        return F.relu(y)
    return y


def _params(c, zero=False):
    torch.manual_seed(1)
    w = torch.randn(c, dtype=torch.float64)
    if zero:
        w[0], w[1] = 0.0, -0.0
    b = torch.randn(c, dtype=torch.float64)
    rm = torch.randn(c, dtype=torch.float64)
    rv = torch.rand(c, dtype=torch.float64) + 0.5
    return w, b, rm, rv


def _loaded(layer, c, w, b, rm, rv):
    """``layer`` given w, b, rm, rv; the reference's copies (weight and bias requiring
    grad), an input requiring grad and an output gradient of shape (4, c, 3, 3)."""
    with torch.no_grad():
        for t, v in ((layer.weight, w), (layer.bias, b), (layer.running_mean, rm),
                     (layer.running_var, rv)):
            t.copy_(v)
    rw, rb = w.clone().requires_grad_(), b.clone().requires_grad_()
    torch.manual_seed(2)
    x = torch.randn(4, c, 3, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, c, 3, 3, dtype=torch.float64)
    return rw, rb, rm.clone(), rv.clone(), x, dy


def _grads(out, inputs, dy):
    return torch.autograd.grad(out, inputs, dy)


# ---- item 1: `import inplace_abn` through a one-line opt-in, without surprises --------------

def test_import_iabn_registers_nothing(tmp_path):
    result = _run("""
        import importlib.util, sys
        import iabn, iabn.compat
        assert "inplace_abn" not in sys.modules
        assert importlib.util.find_spec("inplace_abn") is None
        try:
            import inplace_abn
        except ImportError:
            print("no inplace_abn")
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "no inplace_abn"


def test_one_line_opt_in_gives_the_original_names(tmp_path):
    result = _run("""
        import iabn.compat.enable  # the documented opt-in
        import inplace_abn
        from inplace_abn import ABN, InPlaceABN, InPlaceABNSync, active_group, set_active_group
        from inplace_abn.functions import inplace_abn, inplace_abn_sync
        from inplace_abn.abn import InPlaceABN as Again
        import iabn.compat
        assert inplace_abn is not None and Again is InPlaceABN is iabn.compat.InPlaceABN
        import timm.layers.inplace_abn as timm_iabn
        assert timm_iabn.has_iabn and timm_iabn.inplace_abn is iabn.compat.functions.inplace_abn
        print("ok")
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.slow
def test_opt_in_after_timm_was_imported_reaches_timm(tmp_path):
    result = _run("""
        import torch, timm, timm.layers.inplace_abn as timm_iabn
        assert not timm_iabn.has_iabn
        import iabn.compat
        assert iabn.compat.install()
        layer = timm.layers.InplaceAbn(3)
        print(layer(torch.randn(2, 3, 4, 4)).shape == (2, 3, 4, 4))
        iabn.compat.uninstall()
        import sys
        assert "inplace_abn" not in sys.modules and not timm_iabn.has_iabn
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


@pytest.mark.slow
def test_a_real_inplace_abn_is_not_shadowed(tmp_path):
    real = tmp_path / "site" / "inplace_abn"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    result = _run("""
        import warnings
        import iabn.compat
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert iabn.compat.install() is False
        assert [w.category for w in caught] == [iabn.compat.CompatWarning], caught
        assert "site" in str(caught[0].message) and "force=True" in str(caught[0].message)
        import inplace_abn
        assert inplace_abn.REAL
        assert iabn.compat.install(force=True)
        import inplace_abn
        assert inplace_abn is iabn.compat
        print("ok")
    """, tmp_path, extra_path=[tmp_path / "site"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ---- the layers: the original's semantics ----------------------------------------------------

@pytest.mark.parametrize("activation,param", [("leaky_relu", 0.01), ("elu", 1.0),
                                              ("identity", 0.01)])
@pytest.mark.parametrize("zero", [False, True])
def test_compat_inplace_abn_is_the_originals_abs_computation(activation, param, zero):
    c, eps = 5, 1e-5
    w, b, rm, rv = _params(c, zero)
    layer = compat.InPlaceABN(c, eps, 0.1, True, True, activation, param).double()
    rw, rb, rm_ref, rv_ref, x, dy = _loaded(layer, c, w, b, rm, rv)
    ref = _reference(x, rw, rb, rm_ref, rv_ref, True, 0.1, eps, activation, param, True)
    out = layer(x * 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for ours, theirs in zip(_grads(out, (x, layer.weight, layer.bias), dy),
                            _grads(ref, (x, rw, rb), dy), strict=True):
        # measured up to 4.3e-11 (elu's log1p inversion in backward); 1e-9 is ~25x that
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)
    torch.testing.assert_close(layer.running_mean, rm_ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(layer.running_var, rv_ref, rtol=0, atol=1e-14)


# ---- timm: InplaceAbn and TResNet on top of the opt-in ---------------------------------------

def _timm_swapped(model):
    """Replace each BatchNormAct2d (BN + LeakyReLU or identity) by timm's InplaceAbn with the
    same state; return (the reference: the BN model with weight |w| + eps, the InplaceAbn
    model, the list of (InplaceAbn, reference BN) pairs)."""
    import copy

    from timm.layers import BatchNormAct2d, InplaceAbn

    reference = copy.deepcopy(model)
    pairs = []
    names = [n for n, m in model.named_modules() if isinstance(m, BatchNormAct2d)]
    for name in names:
        bn = model.get_submodule(name)
        act = bn.act
        if isinstance(act, nn.LeakyReLU):
            kind, param = "leaky_relu", act.negative_slope
        else:
            assert isinstance(act, nn.Identity), act
            kind, param = "identity", 0.01
        layer = InplaceAbn(bn.num_features, bn.eps, bn.momentum, True, True, kind, param)
        layer = layer.to(bn.weight.dtype)
        layer.load_state_dict({k: v for k, v in bn.state_dict().items()
                               if k != "num_batches_tracked"})
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        ref = reference.get_submodule(name)
        with torch.no_grad():
            ref.weight.copy_(ref.weight.abs() + ref.eps)
        pairs.append((layer, ref))
    return reference, model, pairs


def _train_step_matches(model, x, atol):
    reference, ours, pairs = _timm_swapped(model)
    assert pairs
    reference.train()
    ours.train()
    out_ref = reference(x.clone())
    out = ours(x.clone())
    torch.manual_seed(3)
    dy = torch.randn_like(out)
    (out_ref * dy).sum().backward()
    (out * dy).sum().backward()
    errors = {"output": (out - out_ref).abs().max().item()}
    torch.testing.assert_close(out, out_ref, rtol=0, atol=atol)
    norm_ids = {id(p) for layer, _ in pairs for p in layer.parameters()}
    for (name, p), p_ref in zip(ours.named_parameters(), reference.parameters(), strict=True):
        if id(p) not in norm_ids:
            torch.testing.assert_close(p.grad, p_ref.grad, rtol=0, atol=atol, msg=name)
            errors[name] = (p.grad - p_ref.grad).abs().max().item()
    for layer, ref in pairs:
        # the original's chain rule through |w| + eps: -1 where w < 0, else +1 (also at 0)
        sign = torch.where(layer.weight.detach() < 0, -1.0, 1.0).to(ref.weight.grad.dtype)
        expected = sign * ref.weight.grad
        errors[f"norm:{id(layer)}.weight"] = (layer.weight.grad - expected).abs().max()
        errors[f"norm:{id(layer)}.bias"] = (layer.bias.grad - ref.bias.grad).abs().max()
        torch.testing.assert_close(layer.weight.grad, sign * ref.weight.grad, rtol=0, atol=atol)
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=0, atol=atol)
        torch.testing.assert_close(layer.running_mean, ref.running_mean, rtol=0, atol=atol)
        torch.testing.assert_close(layer.running_var, ref.running_var, rtol=0, atol=atol)
    return errors


def test_timm_inplace_abn_layer_matches_batchnorm(opted_in):
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), BatchNormAct2d(6, act_layer=nn.LeakyReLU),
        nn.Conv2d(6, 5, 3, padding=1), BatchNormAct2d(5, apply_act=False),
    ).double()
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.0, -0.5, 1.5, -2.0, 0.3, 1.0]))
        model[3].weight.normal_()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    # measured max error 1.4e-14 (outputs and all gradients, float64); 1e-12 is ~70x that
    _train_step_matches(model, x, atol=1e-12)


def test_timm_tresnet_with_inplace_abn_trains_like_batchnorm(opted_in):
    """timm's TResNet code (SpaceToDepth, BlurPool, SE, BasicBlock and Bottleneck, zero-init
    last BN per block) at a width and depth that runs in a second; TResNet-M itself below."""
    from timm.models.tresnet import TResNet

    torch.manual_seed(0)
    model = TResNet(layers=[1, 1, 1, 1], num_classes=7, width_factor=0.25).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    # measured max error 3.2e-16 (outputs and all gradients, float64); 1e-13 is ~300x that
    _train_step_matches(model, x, atol=1e-13)


@pytest.mark.slow
def test_timm_tresnet_m_with_inplace_abn_trains_like_batchnorm(opted_in):
    """timm.create_model("tresnet_m"), its 60 BatchNormAct2d swapped for InplaceAbn (~8 s)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("tresnet_m", pretrained=False, num_classes=10).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    # measured max error 5.3e-16 (outputs and all gradients, float64); 1e-13 is ~200x that
    errors = _train_step_matches(model, x, atol=1e-13)
    assert sum(name.startswith("norm:") and name.endswith(".weight") for name in errors) == 60


@pytest.mark.parametrize("activation,param", [("relu", 0.0), ("leaky_relu", 0.2), ("elu", 0.5)])
def test_compat_abn_is_plain_batchnorm_with_signed_weights(activation, param):
    """The original ABN is standard BN + activation: negative and zero weights as they are."""
    c = 5
    w, b, _, _ = _params(c, zero=True)
    layer = compat.ABN(c, 1e-5, 0.1, True, True, activation, param).double()
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    bn = nn.BatchNorm2d(c).double()
    bn.load_state_dict(layer.state_dict())
    x = torch.randn(3, c, 4, 4, dtype=torch.float64, requires_grad=True)
    for training in (True, False):
        layer.train(training)
        bn.train(training)
        ref = _reference(x, bn.weight, bn.bias, bn.running_mean, bn.running_var, training,
                         0.1, 1e-5, activation, param, False)
        torch.testing.assert_close(layer(x), ref, rtol=0, atol=1e-15)


# ---- item 4: the functionals in the original's order and defaults ----------------------------

@pytest.mark.filterwarnings("ignore:InPlaceABNSync runs without")
def test_compat_functional_keeps_the_original_order_and_training_default():
    c = 4
    w, b, rm, rv = _params(c)
    torch.manual_seed(4)
    x = torch.randn(3, c, 5, dtype=torch.float64)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    out = functions.inplace_abn(x.clone(), w, b, rm, rv)  # positional, as the original
    ref = _reference(x, w, b, rm_ref, rv_ref, True, 0.1, 1e-5, "leaky_relu", 0.01, True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(rm, rm_ref, rtol=0, atol=1e-15)  # training=True updated them
    torch.testing.assert_close(rv, rv_ref, rtol=0, atol=1e-15)
    out = functions.inplace_abn(x.clone(), w, b, rm, rv, False, 0.1, 1e-3, "elu", 0.5)
    ref = _reference(x, w, b, rm, rv, False, 0.1, 1e-3, "elu", 0.5, True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-14)
    # no process group: local statistics, as the original (iabn warns once per process)
    out = functions.inplace_abn_sync(x.clone(), w, b, None, None, True, 0.1, 1e-5,
                                     "leaky_relu", 0.01, None)
    ref = _reference(x, w, b, None, None, True, 0.1, 1e-5, "leaky_relu", 0.01, True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-14)


@pytest.mark.parametrize("function", ["inplace_abn", "abn"])
def test_iabn_functional_rejects_the_original_order(function):
    """iabn.functional follows F.batch_norm's order; a call in the original's order (a
    parameter where a running statistic belongs) used to give NaN or an ATen error."""
    layer = nn.BatchNorm2d(4)
    x = torch.randn(2, 4, 3, 3)
    before = x.clone()
    with pytest.raises(ValueError, match=r"running_mean requires grad.*iabn\.compat\.functions"):
        getattr(iabn.functional, function)(x, layer.weight, layer.bias, layer.running_mean,
                                           layer.running_var, True)
    assert torch.equal(x, before)


# ---- item 6: InPlaceABNSync's group is positional in the compat API --------------------------

@pytest.mark.filterwarnings("ignore:InPlaceABNSync runs without")
def test_compat_sync_takes_group_positionally():
    group = object()  # any process-group handle; stored, used only with torch.distributed
    layer = compat.InPlaceABNSync(4, 1e-5, 0.1, True, True, "leaky_relu", 0.01, group)
    assert layer.group is group and layer.gamma_mode == "abs"
    other = object()
    compat.set_active_group(nn.Sequential(layer, nn.ReLU()), other)
    assert layer.group is other
    layer.set_group(None)
    assert layer.group is None
    # without a process group it is the local layer, with the original's |w| + eps
    w, b, _, _ = _params(4)
    layer = layer.double()
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    x = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    out = layer(x.clone())
    ref = _reference(x, w, b, None, None, True, 0.1, 1e-5, "leaky_relu", 0.01, True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-14)


# ---- leaving compatibility mode ---------------------------------------------------------------

def test_to_signed_converts_abs_weights_exactly():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), compat.InPlaceABN(4), nn.Conv2d(4, 4, 1),
                          compat.InPlaceABN(4, activation="identity")).eval()
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([0.0, -0.7, 1e-7, 2.0]))
        model[3].running_var.uniform_(0.5, 2)
    x = torch.randn(2, 3, 5, 5)
    before = model(x)
    compat.to_signed(model)
    assert model[1].gamma_mode == model[3].gamma_mode == "signed"
    assert torch.equal(model(x), before)
    # the state_dict is now a plain BatchNorm's: nn.BatchNorm2d + LeakyReLU gives the same
    bn = nn.BatchNorm2d(4).eval()
    bn.load_state_dict(model[1].state_dict())
    torch.testing.assert_close(F.leaky_relu(bn(model[0](x)), 0.01), model[1](model[0](x)),
                               rtol=0, atol=1e-6)


# ---- item 3: the documentation's porting advice, run -------------------------------------------

@pytest.mark.slow
def test_documented_porting_examples_run(tmp_path):
    """The checked examples (those with asserts) of the porting sections of the documentation
    (docs/usage/conversion.md, where the README's porting sections moved) run against
    PyTorch's own BatchNorm, in one fresh process: from the original InPlaceABN (|w| + eps),
    from the original ABN (signed), leaving compat mode, timm's InplaceAbn."""
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "usage" / "conversion.md").read_text()
    section = page[page.index("## Porting from `nn.BatchNorm2d` + activation"):]  # to the end
    blocks = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "assert" in b]
    assert len(blocks) >= 3, "the porting sections lost their checked examples"
    assert 'ABN(16, activation="relu")' in section and "never `gamma_mode=\"abs\"`" in section
    result = _run("\n".join(blocks) + "\nprint('ran', len(__import__('sys').argv))", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran 1"


def test_original_style_training_script_runs_and_trains_like_batchnorm():
    """The original's example scripts build layers with functools.partial(InPlaceABN, ...),
    initialise with isinstance(m, ABN) (its in-place layers subclass ABN) and train with SGD.
    Three SGD steps match nn.BatchNorm2d + LeakyReLU with weight |w| + eps (weights stay
    positive here, where SGD on w and on |w| + eps take the same steps)."""
    from functools import partial

    torch.manual_seed(0)
    norm_act = partial(compat.InPlaceABN, activation="leaky_relu", activation_param=0.1)
    ours = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), norm_act(8), nn.Conv2d(8, 8, 1),
                         compat.ABN(8, activation="relu"), nn.Flatten(), nn.Linear(8 * 36, 4))
    ours = ours.double()
    for m in ours.modules():
        if isinstance(m, compat.ABN):  # as the original's train_imagenet.init_weights
            nn.init.constant_(m.weight, 1.0)
            nn.init.constant_(m.bias, 0.0)
    assert isinstance(ours[1], compat.ABN) and isinstance(ours[3], compat.ABN)
    reference = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8),
                              nn.LeakyReLU(0.1), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8),
                              nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 4)).double()
    mapping = {"0": "0", "1": "1", "2": "3", "3": "4", "5": "7"}
    reference.load_state_dict({mapping[k.split(".")[0]] + k[k.index("."):]: v
                               for k, v in ours.state_dict().items()})
    with torch.no_grad():
        reference[1].weight.add_(1e-5)  # |w| + eps of ours
    optimisers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, reference)]
    for step in range(3):
        x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
        target = torch.randint(0, 4, (4,))
        losses = []
        for model, optimiser in zip((ours, reference), optimisers, strict=True):
            optimiser.zero_grad()
            loss = F.cross_entropy(model(x.clone()), target)
            loss.backward()
            optimiser.step()
            losses.append(loss.item())
        # measured loss differences 0, 0, 4.4e-16; 1e-12 is ~2000x the largest
        assert abs(losses[0] - losses[1]) < 1e-12, (step, losses)
    torch.testing.assert_close(ours[1].weight.abs() + 1e-5, reference[1].weight, rtol=0,
                               atol=1e-12)
    torch.testing.assert_close(ours[1].running_var, reference[1].running_var, rtol=0,
                               atol=1e-12)


@pytest.mark.slow
def test_active_group_in_a_one_rank_gloo_world(tmp_path):
    result = _run(f"""
        import torch.distributed as dist
        from iabn import compat
        dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0,
                                world_size=1)
        assert compat.active_group(True) is dist.group.WORLD
        assert compat.active_group(False) is None
        dist.destroy_process_group()
        print("ok")
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# ---- slope 0: the original accepted ReLU in its in-place layers ---------------------------

@pytest.fixture
def zero_slope_unwarned(monkeypatch):
    """The process-wide "warned once" flag cleared for this test."""
    from iabn.compat import abn

    monkeypatch.setattr(abn, "_warned_zero_slope", False)


@pytest.mark.parametrize("how", ["positional", "keywords", "integer zero"])
def test_zero_slope_in_place_layer_is_exact_relu_and_warns_once(how, zero_slope_unwarned):
    """segmentation_models_pytorch's decoder_use_norm="inplace" builds InPlaceABN(C,
    activation="leaky_relu", activation_param=0.0). The original's backward inverted only
    where the output is negative (never, with ReLU): its gradients were wrong. Here the layer
    is batch norm with the original's |weight| + eps, then ReLU, exact; its input is kept."""
    c, eps = 5, 1e-5
    w, b, rm, rv = _params(c, zero=True)
    with pytest.warns(compat.abn.ZeroSlopeWarning, match="no memory is saved") as caught:
        if how == "positional":
            layer = compat.InPlaceABN(c, eps, 0.1, True, True, "leaky_relu", 0.0)
        elif how == "keywords":
            layer = compat.InPlaceABN(c, activation="leaky_relu", activation_param=0.0)
        else:
            layer = compat.InPlaceABN(c, activation_param=0)
        compat.InPlaceABN(c, activation="leaky_relu", activation_param=0.0)  # no second one
    assert len(caught) == 1
    assert isinstance(layer, compat.InPlaceABN) and isinstance(layer, iabn.InPlaceABN)
    assert "activation_param=0.0" in repr(layer)
    layer = layer.double()
    rw, rb, rm_ref, rv_ref, x, dy = _loaded(layer, c, w, b, rm, rv)
    for training in (True, False):
        layer.train(training)
        h = x * 1
        h_before = h.detach().clone()
        ref = _reference(x, rw, rb, rm_ref, rv_ref, training, 0.1, eps, "relu", 0.0, True)
        out = layer(h)
        assert torch.equal(h, h_before)  # not overwritten: ReLU's input cannot be recovered
        # the same ATen operations as the reference: equal to the last bit (measured)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        for ours, theirs in zip(_grads(out, (x, layer.weight, layer.bias), dy),
                                _grads(ref, (x, rw, rb), dy), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        torch.testing.assert_close(layer.running_mean, rm_ref, rtol=0, atol=0)
        torch.testing.assert_close(layer.running_var, rv_ref, rtol=0, atol=0)


def test_zero_slope_layer_state_dict_copy_and_other_slopes(zero_slope_unwarned):
    import copy
    import pickle

    with pytest.warns(compat.abn.ZeroSlopeWarning):
        layer = compat.InPlaceABN(4, activation="leaky_relu", activation_param=0.0)
    plain = compat.InPlaceABN(4)
    assert set(layer.state_dict()) == set(plain.state_dict())
    plain.load_state_dict(layer.state_dict())
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(clone) is type(layer) and "activation_param=0.0" in repr(clone)
    # a slope > 0 stays the in-place layer; a negative one is still refused
    assert compat.InPlaceABN(4, activation_param=0.01).overwrite_input
    with pytest.raises(ValueError, match=r"activation_param=-0\.1"):
        compat.InPlaceABN(4, activation_param=-0.1)
    # iabn's own layer keeps refusing slope 0, with its message
    with pytest.raises(ValueError, match="a zero slope is relu"):
        iabn.InPlaceABN(4, activation_param=0.0)


def test_zero_slope_functional_is_exact_relu(zero_slope_unwarned):
    c, eps = 5, 1e-5
    w, b, rm, rv = _params(c)
    ours_w, ours_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    rw, rb = w.clone().requires_grad_(), b.clone().requires_grad_()
    rm_ours, rv_ours, rm_ref, rv_ref = rm.clone(), rv.clone(), rm.clone(), rv.clone()
    torch.manual_seed(2)
    x = torch.randn(4, c, 3, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    with pytest.warns(compat.abn.ZeroSlopeWarning):
        out = functions.inplace_abn(x * 1, ours_w, ours_b, rm_ours, rv_ours, True, 0.1, eps,
                                    "leaky_relu", 0.0)
    ref = _reference(x, rw, rb, rm_ref, rv_ref, True, 0.1, eps, "relu", 0.0, True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for ours, theirs in zip(_grads(out, (x, ours_w, ours_b), dy), _grads(ref, (x, rw, rb), dy),
                            strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    torch.testing.assert_close(rm_ours, rm_ref, rtol=0, atol=0)


def test_zero_slope_decoder_block_through_the_opt_in(opted_in, zero_slope_unwarned):
    """A decoder block as segmentation_models_pytorch builds it with decoder_use_norm=
    "inplace" (conv without bias, then InPlaceABN with slope 0), written against
    ``import inplace_abn``: it runs and matches conv + BatchNorm(|w| + eps) + ReLU."""
    import inplace_abn

    torch.manual_seed(0)
    with pytest.warns(compat.abn.ZeroSlopeWarning):
        block = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False),
                              inplace_abn.InPlaceABN(6, activation="leaky_relu",
                                                     activation_param=0.0)).double()
    reference = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6),
                              nn.ReLU()).double()
    reference.load_state_dict(block.state_dict())
    with torch.no_grad():
        block[1].weight.uniform_(-1, 1)
        reference[1].weight.copy_(block[1].weight.abs() + block[1].eps)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    out, expected = block(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    dy = torch.randn_like(out)
    (out * dy).sum().backward()
    (expected * dy).sum().backward()
    torch.testing.assert_close(block[0].weight.grad, reference[0].weight.grad, rtol=0,
                               atol=0)
    sign = torch.where(block[1].weight.detach() < 0, -1.0, 1.0).to(torch.float64)
    torch.testing.assert_close(block[1].weight.grad, sign * reference[1].weight.grad, rtol=0,
                               atol=0)


def test_zero_slope_layer_reports_the_activation_it_was_given(zero_slope_unwarned):
    """The original kept what the caller gave: code that exports a layer back to BatchNorm +
    activation reads ``activation``/``activation_param`` and must take the leaky_relu branch
    with slope 0 (ReLU's values), as for the original's layer."""
    with pytest.warns(compat.abn.ZeroSlopeWarning):
        layer = compat.InPlaceABN(4, 1e-5, 0.1, True, True, "leaky_relu", 0.0)
    assert (layer.activation, layer.activation_param) == ("leaky_relu", 0.0)
    assert "activation=leaky_relu, activation_param=0.0" in repr(layer)
    plain = compat.InPlaceABN(4)
    assert list(layer.state_dict()) == list(plain.state_dict())

    def exported(abn_layer):  # an exporter written against the original package
        act = {"relu": lambda: nn.ReLU(),
               "leaky_relu": lambda: nn.LeakyReLU(abn_layer.activation_param),
               "elu": lambda: nn.ELU(abn_layer.activation_param)}[abn_layer.activation]()
        bn = nn.BatchNorm2d(abn_layer.num_features).double()
        with torch.no_grad():
            bn.weight.copy_(abn_layer.weight.abs() + abn_layer.eps)
            bn.bias.copy_(abn_layer.bias)
        return nn.Sequential(bn, act)

    layer = layer.double()
    export = exported(layer)
    assert isinstance(export[1], nn.LeakyReLU) and export[1].negative_slope == 0.0
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(layer(x * 1), export(x), rtol=0, atol=0)
    # an option assigned later is checked as given, and the layer computes what it says
    layer.activation_param = 0.3
    assert layer.activation_param == 0.3
    torch.testing.assert_close(layer(x * 1), exported(layer)(x), rtol=0, atol=0)
    layer.activation_param = 0.0
    torch.testing.assert_close(layer(x * 1), export(x), rtol=0, atol=0)


def _decoder_gradients(norm, c=6):
    """conv -> ``norm`` -> nn.ReLU(inplace=True) (a decoder as segmentation code writes it),
    and the same with nn.BatchNorm2d + nn.ReLU: output and all gradients, float64."""
    torch.manual_seed(0)
    ours = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), norm,
                         nn.ReLU(inplace=True), nn.Conv2d(c, 2, 1)).double()
    theirs = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                           nn.ReLU(), nn.Conv2d(c, 2, 1)).double()  # relu(relu(y)) = relu(y)
    with torch.no_grad():
        ours[1].weight.uniform_(0.5, 1.5)  # positive: |w| + eps and w + eps agree in sign
        ours[1].bias.normal_()
    state = ours.state_dict()
    if norm.gamma_mode == "abs":  # the original's in-place scale
        state["1.weight"] = state["1.weight"].abs() + norm.eps
    theirs.load_state_dict(state)
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    dy = torch.randn(2, 2, 7, 7, dtype=torch.float64)
    results = []
    for model in (ours, theirs):
        norm_layer, last = model[1], model[3]
        out = model(x)
        grads = torch.autograd.grad(out, [model[0].weight, norm_layer.weight, norm_layer.bias,
                                          last.weight], dy)
        results.append([out.detach(), *grads, norm_layer.running_mean.clone(),
                        norm_layer.running_var.clone()])
    return results


def test_zero_slope_layer_then_an_in_place_relu_trains_as_batchnorm_relu(zero_slope_unwarned):
    """A decoder that applies nn.ReLU(inplace=True) after InPlaceABN(C, "leaky_relu", 0.0):
    the original raised at backward there (ReLU's backward read the output the next ReLU
    overwrote); this layer keeps a mask instead, so the decoder trains, with the gradients of
    nn.BatchNorm2d + nn.ReLU to the last bit."""
    with pytest.warns(compat.abn.ZeroSlopeWarning):
        norm = compat.InPlaceABN(6, activation="leaky_relu", activation_param=0.0)
    ours, theirs = _decoder_gradients(norm)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compat_abn_relu_then_an_in_place_relu_trains_as_batchnorm_relu():
    """The original's ABN ran F.relu(x, inplace=True), whose backward reads its output: an
    nn.ReLU(inplace=True) after it raised at backward. compat.ABN with relu keeps a mask."""
    ours, theirs = _decoder_gradients(compat.ABN(6, activation="relu"))
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_zero_slope_functional_then_an_in_place_relu(zero_slope_unwarned):
    c, eps = 5, 1e-5
    w, b, rm, rv = _params(c)
    ours_w, ours_b = w.clone().requires_grad_(), b.clone().requires_grad_()
    rw, rb = w.clone().requires_grad_(), b.clone().requires_grad_()
    x = torch.randn(4, c, 3, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn_like(x)
    with pytest.warns(compat.abn.ZeroSlopeWarning):
        out = F.relu(functions.inplace_abn(x * 1, ours_w, ours_b, rm.clone(), rv.clone(), True,
                                           0.1, eps, "leaky_relu", 0.0), inplace=True)
    ref = F.relu(_reference(x, rw, rb, rm.clone(), rv.clone(), True, 0.1, eps, "relu", 0.0,
                            True))
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for ours, theirs in zip(_grads(out, (x, ours_w, ours_b), dy), _grads(ref, (x, rw, rb), dy),
                            strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_relu_keeps_a_mask_not_its_output(zero_slope_unwarned):
    """What the slope-0 layer and compat.ABN with relu keep for backward: their input (batch
    norm's) and one bool mask, never the tensor they return."""
    with pytest.warns(compat.abn.ZeroSlopeWarning):
        zero_slope = compat.InPlaceABN(4, activation_param=0.0)
    for layer in (zero_slope, compat.ABN(4, activation="relu")):
        kept = []
        x = torch.randn(2, 4, 3, 3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t) or t,
                                                      lambda t: t):
            out = layer(x * 1)
        big = [t for t in kept if t.numel() == out.numel()]
        assert sorted(str(t.dtype) for t in big) == ["torch.bool", "torch.float32"], big
        assert all(t.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
                   for t in kept)
