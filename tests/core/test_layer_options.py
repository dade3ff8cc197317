"""Options assigned to a built layer: the per-call caches of the batch-norm layers (the call's
settings, the last validated signature) never outlive an assignment, whether or not the
option is in the layer's list of validated options."""

import torch
from torch import nn

import iabn


def test_an_option_left_out_of_the_list_leaves_no_stale_cache(monkeypatch):
    """With ``eps`` missing from ``_OPTIONS`` (as a new option forgotten there would be), a
    new ``eps`` still reaches the next call: against nn.BatchNorm2d + nn.LeakyReLU in
    float64."""
    monkeypatch.setattr(iabn.InPlaceABN, "_OPTIONS", ("num_features",))
    layer = iabn.InPlaceABN(3).double()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    layer(x.clone())  # caches the call's settings with eps=1e-5
    assert "_call_config" in layer.__dict__
    layer.eps = 0.5
    assert "_call_config" not in layer.__dict__
    bn = nn.BatchNorm2d(3, eps=0.5).double()
    expected = nn.functional.leaky_relu(bn(x), 0.01)
    torch.testing.assert_close(layer(x.clone()), expected, rtol=1e-13, atol=1e-14)


def test_group_norm_layers_validate_assignments_as_batch_norm_layers_do():
    layer = iabn.InPlaceGroupNormAct(2, 4)
    try:
        layer.activation = "relu"
    except ValueError as error:
        assert "not invertible" in str(error)
    else:
        raise AssertionError("relu accepted by the in-place group norm")
    assert layer.activation == "leaky_relu"
    layer.activation_param = 1
    assert type(layer.activation_param) is float
