"""BNActConv: the five memory strategies of the paper's Figure 2 compute the same thing and
keep exactly the tensors they promise."""

import pytest
import torch

from iabn.memory import saved_storages
from iabn.memory.bn_act_conv import STRATEGIES, BNActConv

from helpers import randomise_

N, C, H, W = 3, 6, 7, 5


def _blocks(activation="leaky_relu", param=0.1, strategies=STRATEGIES, **kw):
    torch.manual_seed(0)
    reference = BNActConv(C, 4, 3, strategy="standard", activation=activation,
                          activation_param=param, **kw).double()
    randomise_(reference.norm)
    blocks = {}
    for strategy in strategies:
        block = BNActConv(C, 4, 3, strategy=strategy, activation=activation,
                          activation_param=param, **kw).double()
        block.load_state_dict(reference.state_dict())
        blocks[strategy] = block
    return blocks


def _step(block, x, grad, training):
    block.train(training)
    block.zero_grad()
    leaf = x.clone().requires_grad_()
    out = block(leaf.clone())
    out.backward(grad)
    return out.detach(), leaf.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize(
    "activation,param,options",
    [
        ("leaky_relu", 0.1, {}),
        ("elu", 0.7, {"momentum": None}),
        ("identity", 0.0, {"affine": False}),
        ("leaky_relu", 0.01, {"stride": 2, "padding": 1, "bias": True, "gamma_mode": "abs"}),
        ("leaky_relu", 0.01, {"dilation": 2, "padding": 2, "groups": 2}),
    ],
    ids=str,
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_every_strategy_matches_standard(activation, param, options, training):
    blocks = _blocks(activation, param, **options)
    for step in range(2):
        torch.manual_seed(10 + step)
        x = torch.randn(N, C, H, W, dtype=torch.float64) * 2 + 0.3
        grad = None
        results = {}
        for strategy, block in blocks.items():
            if grad is None:
                grad = torch.randn_like(_shape_probe(block, x))
            results[strategy] = _step(block, x, grad, training)
        reference = results["standard"]
        for strategy, (out, gx, gparams) in results.items():
            torch.testing.assert_close(out, reference[0], atol=1e-12, rtol=0, msg=strategy)
            torch.testing.assert_close(gx, reference[1], atol=1e-12, rtol=0, msg=strategy)
            for name, g in gparams.items():
                torch.testing.assert_close(g, reference[2][name], atol=1e-11, rtol=0,
                                           msg=f"{strategy} {name}")
        state = blocks["standard"].state_dict()
        for strategy, block in blocks.items():
            for key, value in block.state_dict().items():
                torch.testing.assert_close(value, state[key], atol=1e-12, rtol=0,
                                           msg=f"{strategy} {key}")


def _shape_probe(block, x):
    with torch.no_grad():
        training = block.training
        block.eval()
        out = block(x.clone())
        block.train(training)
    return out


def test_relu_works_with_the_non_inplace_strategies():
    blocks = _blocks("relu", 0.0, strategies=("standard", "checkpoint", "checkpoint_opt"))
    x = torch.randn(N, C, H, W, dtype=torch.float64)
    grad = torch.randn(N, 4, H - 2, W - 2, dtype=torch.float64)
    results = {s: _step(b, x, grad, True) for s, b in blocks.items()}
    for strategy in ("checkpoint", "checkpoint_opt"):
        torch.testing.assert_close(results[strategy][1], results["standard"][1], atol=1e-12,
                                   rtol=0)
    with pytest.raises(ValueError, match="non-in-place ABN for relu"):
        BNActConv(C, 4, 3, strategy="inplace_II", activation="relu")


def test_running_statistics_updated_once_per_forward():
    torch.manual_seed(0)
    x = torch.randn(N, C, H, W)
    bn = torch.nn.BatchNorm2d(C)
    bn(x)
    for strategy in STRATEGIES:
        block = BNActConv(C, 4, 3, strategy=strategy)
        block(x.clone()).sum().backward()
        assert block.norm.num_batches_tracked.item() == 1, strategy
        torch.testing.assert_close(block.norm.running_mean, bn.running_mean, msg=strategy)
        torch.testing.assert_close(block.norm.running_var, bn.running_var, msg=strategy)


# (activations of the block input's size, per-channel float32 vectors) kept for backward
EXPECTED = {
    "standard": (2, 2),        # x, z + mean, invstd (the weight itself: signed ABN, no clamp)
    "checkpoint": (1, 2),      # x + mean, invstd
    "checkpoint_opt": (1, 1),  # xhat + invstd
    "inplace_I": (1, 2),       # z + invstd, scale(gamma)
    "inplace_II": (1, 2),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_saved_bytes_are_exact(strategy):
    block = BNActConv(C, 4, 3, strategy=strategy)
    x = torch.randn(N, C, H, W, requires_grad=True).clone()
    storages = saved_storages(block, x)
    activations, vectors = EXPECTED[strategy]
    full = [s for s in storages if s.shape == (N, C, H, W)]
    small = [s for s in storages if s.shape == (C,)]
    assert len(full) == activations and len(small) == vectors
    assert len(storages) == activations + vectors  # nothing else is kept
    assert sum(s.nbytes for s in storages) == activations * x.nbytes + vectors * 4 * C


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown strategy='fast'"):
        BNActConv(4, 4, 3, strategy="fast")
    with pytest.raises(ValueError, match="numeric padding"):
        BNActConv(4, 4, 3, padding="same")
