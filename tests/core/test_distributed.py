"""InPlaceABNSync with real processes (gloo on CPU, on any machine): exact against one process
on the whole batch, uneven and empty per-rank batches, one collective each way, clear
cross-rank errors."""

import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import dist_workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, scenario: str) -> None:
    mp.spawn(dist_workers.run, args=(world, _free_port(), scenario), nprocs=world, join=True)


KERNELS = ["reference", pytest.param("triton", marks=pytest.mark.slow)]


def _use_kernels(kernels: str, monkeypatch) -> None:
    """The ranks inherit the environment: IABN_BACKEND picks their kernels; the Triton case
    runs under the interpreter on every machine (gloo moves CPU tensors)."""
    if kernels == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("IABN_BACKEND", kernels)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_matches_single_process_on_the_whole_batch(world, kernels, monkeypatch):
    _use_kernels(kernels, monkeypatch)
    _spawn(world, "matches_single_process")


@pytest.mark.slow
def test_half_inputs_work_in_float32_pieces():
    _spawn(2, "half_inputs_in_pieces")


@pytest.mark.slow  # 8 s on 2 cores (two spawned ranks); the two-rank LeakyReLU case runs by default
@pytest.mark.parametrize("kernels", KERNELS)
def test_silu_and_gelu_match_single_process_on_the_whole_batch(kernels, monkeypatch):
    _use_kernels(kernels, monkeypatch)
    _spawn(2, "branch_activations_match_single_process")


@pytest.mark.slow
@pytest.mark.parametrize("kernels", KERNELS)
def test_silu_and_gelu_bfloat16_within_the_local_layer_s_bound(kernels, monkeypatch):
    _use_kernels(kernels, monkeypatch)
    _spawn(2, "branch_half_inputs")


@pytest.mark.slow
def test_one_collective_each_way_and_none_in_eval():
    _spawn(2, "counts_collectives")


@pytest.mark.slow
def test_training_step_reads_nothing_on_the_host():
    """The merged count stays on the device: a step waits for no device value."""
    _spawn(2, "no_host_sync")


@pytest.mark.slow
def test_mismatched_channels_fail_clearly_on_every_rank():
    _spawn(2, "rejects_mismatched_ranks")


@pytest.mark.slow
def test_functional_conversion_and_active_group():
    _spawn(3, "functional_and_conversion")


def test_without_process_group_behaves_like_inplace_abn_and_warns_once(monkeypatch):
    import iabn.distributed.groups

    monkeypatch.setattr(iabn.distributed.groups, "_warned_single_process", False)
    torch.manual_seed(0)
    sync_layer, local_layer = iabn.InPlaceABNSync(4), iabn.InPlaceABN(4)
    x = torch.randn(3, 4, 5, 5)
    with pytest.warns(UserWarning, match="without a torch.distributed process group"):
        out = sync_layer(x.clone())
    torch.testing.assert_close(out, local_layer(x.clone()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sync_layer(x.clone())  # no second warning


@pytest.mark.slow
def test_abn_sync_across_ranks_leaves_its_input():
    _spawn(2, "abn_sync_matches_single_process")


def test_abn_sync_is_abn_not_an_in_place_layer(monkeypatch):
    """ABNSync subclasses ABN (it was an InPlaceABNSync that copied its input); without a
    process group it is nn.BatchNorm2d + activation exactly, zero weights included."""
    import iabn.distributed.groups

    monkeypatch.setattr(iabn.distributed.groups, "_warned_single_process", True)
    layer = iabn.ABNSync(4, activation="leaky_relu", activation_param=0.1).double()
    assert isinstance(layer, iabn.ABN) and not isinstance(layer, iabn.InPlaceABN)
    assert not layer._in_place
    reference = torch.nn.BatchNorm2d(4).double()
    with torch.no_grad():
        for module in (layer, reference):
            module.weight.copy_(torch.tensor([0.0, -1.5, 2.0, 1e-7]))
            module.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.4]))
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64, requires_grad=True)  # a leaf: allowed
    out = layer(x)
    expected = torch.nn.functional.leaky_relu(reference(x), 0.1)
    assert torch.equal(out, expected)  # the same ATen calls
    assert torch.equal(layer.running_var, reference.running_var)
    with pytest.raises(ValueError, match="relu is not invertible"):
        iabn.ABNSync(4, activation="relu")
    converted = iabn.convert_sync(torch.nn.Sequential(layer))
    assert converted[0] is layer  # already synchronised: left as it is
