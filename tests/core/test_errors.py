"""Bad input: a clear error naming the argument and the fix, and nothing modified."""

import math

import pytest
import torch

import iabn
from iabn.functional import abn, inplace_abn


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _assert_unchanged(module, before):
    after = module.state_dict()
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def _trained_layer(cls=iabn.InPlaceABN, **kw):
    layer = cls(4, **kw)
    layer(torch.randn(3, 4, 5, 5))  # non-default running statistics
    return layer


BAD_INPUTS = {
    "one value per channel (N, C)": (lambda: torch.randn(1, 4), "more than 1 value per channel"),
    "one value per channel 1x1": (lambda: torch.randn(1, 4, 1, 1), "at least 2 samples"),
    "wrong channel count": (lambda: torch.randn(2, 5, 3, 3), "num_features=4"),
    "integer dtype": (lambda: torch.ones(2, 4, 3, 3, dtype=torch.int64), r"input\.float\(\)"),
    "complex dtype": (lambda: torch.randn(2, 4, 3, 3, dtype=torch.complex64), "float32"),
    "1-D input": (lambda: torch.randn(4), r"\(N, C\)"),
    "6-D input": (lambda: torch.randn(2, 4, 2, 2, 2, 2), "6-D"),
    "float64 input, float32 layer": (lambda: torch.randn(2, 4, 3, 3, dtype=torch.float64),
                                     r"\.to\(torch.float64\)"),
    "expanded input": (lambda: torch.randn(1, 4, 1, 1).expand(3, 4, 5, 5),
                       r"input\.contiguous\(\)"),
}


CASES = [(case, cls) for case in BAD_INPUTS for cls in (iabn.InPlaceABN, iabn.ABN)
         if not (cls is iabn.ABN and case == "expanded input")]  # ABN only reads its input


@pytest.mark.parametrize("case,cls", CASES, ids=str)
def test_bad_input_raises_and_modifies_nothing(case, cls):
    make, message = BAD_INPUTS[case]
    layer = _trained_layer(cls)
    x = make()
    x_before = x.clone()
    state_before = _snapshot(layer)
    with pytest.raises((ValueError, TypeError), match=message):
        layer(x)
    assert torch.equal(x, x_before)
    _assert_unchanged(layer, state_before)


def _replace(name, value):
    def change(layer):
        setattr(layer, name, value)
    return change


def _recast(name, dtype):
    def change(layer):
        getattr(layer, name).data = getattr(layer, name).data.to(dtype)
    return change


# Changes to a layer between two calls with the same input shape: the module revalidates only
# when the call's signature (input and per-channel tensors' shape, dtype, device) changes, so
# each of these must change it (iabn.autograd.call.input_signature).
LAYER_CHANGES = {
    "layer.double()": (lambda layer: layer.double(), "parameters have dtype torch.float64"),
    "weight of another size": (_replace("weight", torch.nn.Parameter(torch.ones(5))),
                               r"weight has shape \(5,\)"),
    "bias in float16": (_recast("bias", torch.float16), "must share one dtype"),
    "running_var on meta": (_replace("running_var", torch.ones(4, device="meta")),
                            "running_var is on meta"),
}


@pytest.mark.parametrize("change", LAYER_CHANGES)
@pytest.mark.parametrize("cls", [iabn.InPlaceABN, iabn.ABN])
def test_a_layer_changed_after_a_valid_call_is_checked_again(change, cls):
    modify, message = LAYER_CHANGES[change]
    layer = _trained_layer(cls)  # one valid call with this input shape
    modify(layer)
    x = torch.randn(3, 4, 5, 5)
    x_before = x.clone()
    with pytest.raises((ValueError, TypeError), match=message):
        layer(x)
    assert torch.equal(x, x_before)


def test_abn_reads_an_expanded_input_without_complaint():
    x = torch.randn(1, 4, 5, 5).expand(3, 4, 5, 5)
    expected = torch.nn.functional.leaky_relu(
        torch.nn.functional.batch_norm(x, None, None, training=True), 0.01
    )
    torch.testing.assert_close(iabn.ABN(4)(x), expected)


def test_leaf_that_requires_grad_points_to_abn():
    layer = _trained_layer()
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    before, state = x.detach().clone(), _snapshot(layer)
    with pytest.raises(RuntimeError, match=r"leaf tensor that requires grad.*iabn\.ABN"):
        layer(x)
    with pytest.raises(RuntimeError, match="view of a leaf tensor"):
        layer(x[:, :, 1:])
    assert torch.equal(x.detach(), before)
    _assert_unchanged(layer, state)
    iabn.ABN(4)(x).sum().backward()  # the suggested fix works
    assert x.grad is not None


def test_parameters_on_another_device():
    layer = iabn.InPlaceABN(4, device="meta")
    x = torch.randn(2, 4, 3, 3)
    before = x.clone()
    with pytest.raises(ValueError, match=r"weight is on meta but input is on cpu.*\.to\('cpu'\)"):
        layer(x)
    assert torch.equal(x, before)


def test_eval_without_running_statistics_in_functional():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="running_mean and running_var are required"):
        inplace_abn(x, None, None, training=False)
    with pytest.raises(ValueError, match="must have shape \\(3,\\)"):
        inplace_abn(x, torch.zeros(4), torch.ones(4), training=False)


def test_mixed_parameter_dtypes():
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="share one dtype"):
        inplace_abn(x, torch.zeros(3), torch.ones(3), torch.ones(3, dtype=torch.bfloat16),
                    training=True)
    with pytest.raises(TypeError, match="float32"):
        abn(x, torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64),
            training=True)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"activation": "relu"}, "use activation='leaky_relu'.*non-in-place ABN for relu"),
        ({"activation": "swish"}, "unknown activation='swish'"),
        ({"activation_param": 0.0}, "a zero slope is relu"),
        ({"activation_param": -0.1}, "must be a finite number > 0"),
        ({"activation_param": math.nan}, "must be a finite number > 0"),
        ({"activation": "elu", "activation_param": 0.0}, "alpha of elu"),
        ({"gamma_mode": "positive"}, "use 'signed'.*or 'abs'"),
        ({"variant": 3}, "variant=3"),
        ({"momentum": math.nan}, "momentum=nan: must be a finite number"),
        ({"momentum": math.inf}, "momentum=inf: must be a finite number"),
    ],
    ids=str,
)
def test_invalid_configuration_rejected_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        iabn.InPlaceABN(8, **kwargs)
    with pytest.raises(ValueError, match=message):
        inplace_abn(torch.randn(2, 8), None, None, training=True, **kwargs)


@pytest.mark.parametrize("cls", [iabn.ABN, iabn.InPlaceABN])
def test_a_nan_momentum_assigned_is_refused_before_anything_changes(cls):
    layer = cls(4)
    with pytest.raises(ValueError, match="momentum=nan: must be a finite number"):
        layer.momentum = math.nan
    assert layer.momentum == 0.1
    layer(torch.randn(2, 4, 3, 3))
    assert torch.isfinite(layer.running_mean).all() and torch.isfinite(layer.running_var).all()


@pytest.mark.parametrize("training", ["yes", "no", 1, None, torch.tensor(True)],
                         ids=["'yes'", "'no'", "1", "None", "tensor"])
def test_training_of_the_functionals_must_be_a_bool(training):
    """``training="no"`` is truthy: it would train. Nothing is written before the refusal."""
    from iabn.compat import functions

    x = torch.randn(2, 4, 3, 3)
    rm, rv = torch.zeros(4), torch.ones(4)
    for call in (lambda: inplace_abn(x, rm, rv, training=training),
                 lambda: abn(x, rm, rv, training=training),
                 lambda: functions.inplace_abn(x, None, None, rm, rv, training)):
        before = x.clone()
        with pytest.raises(TypeError, match=r"training=.*: must be True or False"):
            call()
        assert torch.equal(x, before) and torch.equal(rm, torch.zeros(4))


def test_abn_accepts_relu_but_rejects_unknown():
    assert iabn.ABN(3, activation="relu").activation == "relu"
    with pytest.raises(ValueError, match="unknown activation"):
        iabn.ABN(3, activation="swish")
