"""Exact saved-activation bytes (docs/design.md, "Memory accounting"): InPlace-ABN keeps one
activation per block."""

import pytest
import torch
from torch import nn

import iabn
from iabn.memory import saved_storages, saved_tensor_bytes

N, C, H, W = 4, 6, 9, 7


def _block(kind, channels=C):
    conv = nn.Conv2d(channels, 5, 3)
    if kind == "iabn":
        return nn.Sequential(iabn.InPlaceABN(channels), conv)
    if kind == "abn":
        return nn.Sequential(iabn.ABN(channels), conv)
    inplace = kind == "bn_inplace"
    return nn.Sequential(nn.BatchNorm2d(channels), nn.LeakyReLU(0.01, inplace=inplace), conv)


# (activations of the block input's size, per-channel float32 vectors) kept for backward
EXPECTED = {
    "iabn": (1, 2),        # z (shared with the conv's input) + invstd, scale(gamma)
    "bn_inplace": (2, 2),  # x, z + save_mean, save_invstd
    "bn": (3, 2),          # x, y, z + save_mean, save_invstd
    "abn": (2, 2),         # x, z + save_mean, save_invstd (signed: the weight as it is)
}


# (The backward variant does not change what forward saves, so it is not a parameter here.)
@pytest.mark.parametrize("kind", EXPECTED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_bn_act_conv_block_saved_bytes_are_exact(kind, dtype, channels_last):
    block = _block(kind)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(N, C, H, W, requires_grad=True).to(dtype).contiguous(memory_format=fmt)
    x = x.clone()  # the block's input is an intermediate, as in a network

    if dtype == torch.bfloat16:
        # the conv runs under autocast; the norm layers get the bfloat16 activation
        def fn(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return block(t)
    else:
        fn = block
    activations, vectors = EXPECTED[kind]
    storages = saved_storages(fn, x, exclude=[*block.parameters(), *block.buffers()])
    full = [s for s in storages if s.nbytes >= x.nbytes]
    # under autocast the conv also saves a bfloat16 copy of its float32 weight
    small = [s for s in storages if s.nbytes < x.nbytes and s.shape == (C,)]
    assert sum(s.nbytes for s in full) == activations * x.numel() * x.element_size()
    assert len(small) == vectors and all(s.dtype == torch.float32 for s in small)


@pytest.mark.parametrize("kind", ["iabn", "bn_inplace", "bn"])
def test_two_blocks_match_design_figures(kind):
    """The two-block example of docs/design.md, "Memory accounting": two
    BN->LeakyReLU->Conv blocks keep 1, 2 and 3 activations per block."""
    def block():
        layers = {
            "iabn": lambda: [iabn.InPlaceABN(C)],
            "bn_inplace": lambda: [nn.BatchNorm2d(C), nn.LeakyReLU(0.01, inplace=True)],
            "bn": lambda: [nn.BatchNorm2d(C), nn.LeakyReLU(0.01)],
        }[kind]()
        return [*layers, nn.Conv2d(C, C, 3, padding=1)]

    model = nn.Sequential(*block(), *block())
    x = torch.randn(N, C, H, W, requires_grad=True).clone()
    activations, vectors = EXPECTED[kind]
    assert saved_tensor_bytes(model, x) == 2 * (activations * x.nbytes + vectors * 4 * C)


def test_saved_bytes_deduplicate_by_storage_and_exclude():
    a = torch.randn(10, requires_grad=True)
    b = torch.randn(10, requires_grad=True)

    def fn(a, b):
        return (a * b) * a  # a is saved twice, b once, and a*b once

    assert saved_tensor_bytes(fn, a, b) == 3 * 40
    assert saved_tensor_bytes(fn, a, b, exclude=[a]) == 2 * 40
    view_of_a = a[2:]
    assert saved_tensor_bytes(lambda t: t * t, view_of_a) == 40  # whole storage of a


def test_module_parameters_and_buffers_are_not_counted():
    conv = nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    assert saved_tensor_bytes(conv, x) == x.nbytes


@pytest.mark.parametrize("budget,activations", [(1.0, 3), (0.5, 1)])
def test_compiled_saved_bytes_two_blocks(budget, activations):
    """The torch.compile figures of docs/design.md, "Memory accounting", read from the
    compiled graphs. With the default budget the compiled standard blocks keep what eager BN +
    out-of-place LeakyReLU keeps (3 activations a block, cross-checked against the saved-tensor
    hooks); with
    ``activation_memory_budget=0.5`` they keep 1 a block — what InPlace-ABN keeps in eager
    mode, with no recomputation."""
    def block():
        return [nn.BatchNorm2d(C), nn.LeakyReLU(0.01), nn.Conv2d(C, C, 3, padding=1)]

    model = nn.Sequential(*block(), *block())
    x = torch.randn(N, C, H, W, requires_grad=True).clone()
    compiled = iabn.memory.compiled_saved_bytes(model, x, activation_memory_budget=budget)
    # full-size activations, plus a few per-channel statistics (each far below one activation)
    assert compiled // x.nbytes == 2 * activations
    assert compiled % x.nbytes <= 2 * 4 * 4 * C
    if budget == 1.0:
        eager = saved_tensor_bytes(model, x)
        assert eager // x.nbytes == compiled // x.nbytes


def test_compiled_saved_bytes_rejects_a_budget_outside_0_1():
    with pytest.raises(ValueError, match=r"activation_memory_budget=1\.5"):
        iabn.memory.compiled_saved_bytes(nn.Linear(2, 2), torch.randn(1, 2),
                                         activation_memory_budget=1.5)


def test_counts_on_the_meta_device_equal_real_ones():
    """Meta tensors all have data pointer 0; storages must still count one by one."""
    model = nn.Sequential(iabn.InPlaceABN(C), nn.Conv2d(C, C, 3, padding=1),
                          nn.BatchNorm2d(C), nn.LeakyReLU(0.01), nn.Conv2d(C, 2, 1))
    x = torch.randn(N, C, H, W, requires_grad=True)
    real = saved_tensor_bytes(model, x.clone())
    meta_model = model.to("meta")
    meta = saved_tensor_bytes(meta_model, torch.empty(N, C, H, W, device="meta",
                                                      requires_grad=True).clone())
    assert meta == real > 0
