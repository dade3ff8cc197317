"""iabn.compat: the original inplace_abn package's API (issue 16), checked against PyTorch's own
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

import iabn
from iabn import compat

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
    with torch.no_grad():
        for t, v in ((layer.weight, w), (layer.bias, b), (layer.running_mean, rm),
                     (layer.running_var, rv)):
            t.copy_(v)
    rw, rb = w.clone().requires_grad_(), b.clone().requires_grad_()
    rm_ref, rv_ref = rm.clone(), rv.clone()
    torch.manual_seed(2)
    x = torch.randn(4, c, 3, 3, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(4, c, 3, 3, dtype=torch.float64)
    ref = _reference(x, rw, rb, rm_ref, rv_ref, True, 0.1, eps, activation, param, True)
    out = layer(x * 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for ours, theirs in zip(_grads(out, (x, layer.weight, layer.bias), dy),
                            _grads(ref, (x, rw, rb), dy), strict=True):
        # measured up to 4.3e-11 (elu's log1p inversion in backward); 1e-9 is ~25x that
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)
    torch.testing.assert_close(layer.running_mean, rm_ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(layer.running_var, rv_ref, rtol=0, atol=1e-14)
