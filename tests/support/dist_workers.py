"""Code that runs inside the worker processes of test_distributed.py (gloo, CPU).

Every rank builds the same full batch from the same seed and takes its own slice, so each rank
can compute the single-process reference on the whole batch by itself and compare locally.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import Counter

import torch
import torch.distributed as dist

import iabn

from helpers import (
    ACTIVATION_PARAMS,
    BRANCH,
    INVERTIBLE,
    WITH_PARAMETER,
    randomise_,
    torch_activation,
    torch_batchnorm,
    torch_minimum,
)


def run(rank: int, world: int, port: int, scenario: str) -> None:
    """``torch.multiprocessing.spawn`` entry point: one rank of one scenario."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    SCENARIOS[scenario](rank, world)
    # All ranks finish before any tears gloo down (see ddp_train.py). A failing rank skips
    # this and exits with its exception, which ends the whole spawn.
    dist.barrier()
    dist.destroy_process_group()


def _slice(full: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return full[start : start + sizes[rank]]


def _compare_with_single_process(rank, world, sizes, activation, dtype, atol, steps=2,
                                 momentum=0.1, channels_last=False, shape=(6, 5, 4),
                                 layer_class=None):
    channels = shape[0]
    param = ACTIVATION_PARAMS[activation] or 0.01
    torch.manual_seed(1)
    reference = torch_batchnorm(len(shape) + 1, channels, momentum=momentum)
    reference = randomise_(reference).to(dtype)
    act = torch_activation(activation, param)
    layer_class = layer_class or iabn.InPlaceABNSync
    layer = layer_class(channels, momentum=momentum, activation=activation,
                        activation_param=param).to(dtype)
    layer.load_state_dict(reference.state_dict())
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for step in range(steps):
        torch.manual_seed(100 + step)
        full = (torch.randn(sum(sizes), *shape, dtype=dtype) * 2 + 0.5)
        upstream = torch.randn(sum(sizes), *shape, dtype=dtype)
        reference.zero_grad()
        layer.zero_grad()
        x_ref = full.clone().requires_grad_()
        out_ref = act(reference(x_ref))
        out_ref.backward(upstream)

        x_leaf = _slice(full, sizes, rank).contiguous(memory_format=fmt).requires_grad_()
        before = x_leaf.detach().clone()
        # ABNSync leaves its input untouched, so it takes the leaf itself
        out = layer(x_leaf if layer_class is iabn.ABNSync else x_leaf.clone())
        assert torch.equal(x_leaf.detach(), before)
        out.backward(_slice(upstream, sizes, rank).contiguous(memory_format=fmt))

        torch.testing.assert_close(out, _slice(out_ref, sizes, rank), atol=atol, rtol=0)
        torch.testing.assert_close(x_leaf.grad, _slice(x_ref.grad, sizes, rank), atol=atol,
                                   rtol=0)
        # DDP averages the ranks' parameter gradients; times the world size that is the sum,
        # which must be the whole batch's gradient.
        for name in ("weight", "bias"):
            grad = getattr(layer, name).grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, getattr(reference, name).grad, atol=atol * 10,
                                       rtol=0, msg=f"{name} grad")
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(layer, name), getattr(reference, name),
                                       atol=atol, rtol=0, msg=name)


def _sizes_for(world: int) -> list[list[int]]:
    return {2: [[3, 5], [1, 4], [4, 0]], 3: [[3, 5, 1], [2, 0, 3]]}[world]


def matches_single_process(rank: int, world: int) -> None:
    for sizes in _sizes_for(world):
        for activation in INVERTIBLE:
            _compare_with_single_process(rank, world, sizes, activation, torch.float64, 1e-10)
        _compare_with_single_process(rank, world, sizes, "leaky_relu", torch.float32, 2e-5,
                                     channels_last=True)
    _compare_with_single_process(rank, world, _sizes_for(world)[0], "leaky_relu",
                                 torch.float64, 1e-10, steps=3, momentum=None)
    _compare_with_single_process(rank, world, _sizes_for(world)[0], "leaky_relu",
                                 torch.float64, 1e-10, shape=(3,))  # (N, C) input


def abn_sync_matches_single_process(rank: int, world: int) -> None:
    """ABNSync: the same statistics over all ranks, its input left as it was."""
    for sizes in _sizes_for(world):
        _compare_with_single_process(rank, world, sizes, "leaky_relu", torch.float64, 1e-10,
                                     layer_class=iabn.ABNSync)


def counts_collectives(rank: int, world: int) -> None:
    for activation in ("leaky_relu", "silu"):  # silu: the branch-bit layer, the same two
        _count_collectives(rank, activation)


def _count_collectives(rank: int, activation: str) -> None:
    calls: Counter[str] = Counter()
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    layer = iabn.InPlaceABNSync(4, activation=activation)
    layer(torch.randn(3, 4, 5, 5))  # the first step also checks the ranks agree
    dist.all_gather, dist.all_reduce = counting("all_gather"), counting("all_reduce")
    try:
        for _ in range(3):
            x = torch.randn(2 + rank, 4, 5, 5, requires_grad=True)
            layer(x.clone()).sum().backward()
        assert calls == {"all_gather": 3, "all_reduce": 3}, (activation, calls)
        layer.eval()
        with torch.no_grad():
            layer(torch.randn(2, 4, 5, 5))
        x = torch.randn(2, 4, 5, 5, requires_grad=True)
        layer(x.clone()).sum().backward()
        assert calls == {"all_gather": 3, "all_reduce": 3}, f"eval communicated: {calls}"
    finally:
        dist.all_gather, dist.all_reduce = originals["all_gather"], originals["all_reduce"]


def rejects_mismatched_ranks(rank: int, world: int) -> None:
    layer = iabn.InPlaceABNSync(4 + rank)
    x = torch.randn(3, 4 + rank, 2, 2)
    before = x.clone()
    try:
        layer(x)
    except ValueError as error:
        assert "differ across ranks" in str(error) and "rank 1: 5 channels" in str(error)
    else:
        raise AssertionError("mismatched channel counts were not detected")
    assert torch.equal(x, before) and layer.num_batches_tracked.item() == 0


def functional_and_conversion(rank: int, world: int) -> None:
    from iabn.functional import inplace_abn_sync

    torch.manual_seed(0)
    full = torch.randn(6, 3, 4, dtype=torch.float64)
    mine = full[rank * 3 : rank * 3 + 3].clone()
    expected = torch.nn.functional.leaky_relu(
        torch.nn.functional.batch_norm(full, None, None, training=True), 0.01
    )[rank * 3 : rank * 3 + 3]
    out = inplace_abn_sync(mine, None, None, training=True)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), iabn.InPlaceABN(4),
                                torch.nn.Sequential(iabn.ABN(4, activation="elu")))
    weight = model[1].weight
    synced = iabn.convert_sync(model)
    assert type(synced[1]) is iabn.InPlaceABNSync and type(synced[2][0]) is iabn.ABNSync
    assert synced[1].weight is weight and synced[2][0].activation == "elu"
    back = iabn.convert_local(synced)
    assert type(back[1]) is iabn.InPlaceABN and type(back[2][0]) is iabn.ABN
    assert back[1].weight is weight

    from iabn.distributed import active_group

    sub = active_group(rank != 0)
    if rank != 0:
        assert dist.get_world_size(sub) == world - 1


def debug_poisons(rank: int, world: int) -> None:
    """iabn.debug.poison_overwritten on the synchronised branch: the result equals the
    single-process reference on the whole batch (float64, 1e-12 as functional_and_conversion
    above), the input is poisoned and
    reading it raises; module and functional."""
    from iabn.debug import OverwrittenTensorError, poison_overwritten
    from iabn.distributed import inplace_abn_sync

    torch.manual_seed(0)
    full = torch.randn(6, 3, 4, dtype=torch.float64)
    expected = torch.nn.functional.leaky_relu(
        torch.nn.functional.batch_norm(full, None, None, training=True), 0.01
    )[rank * 3 : rank * 3 + 3]
    layer = iabn.InPlaceABNSync(3, affine=False, track_running_stats=False,
                                dtype=torch.float64)
    calls = {"InPlaceABNSync": layer,
             "inplace_abn_sync": lambda x: inplace_abn_sync(x, None, None, training=True)}
    for name, call in calls.items():
        leaf = full[rank * 3 : rank * 3 + 3].clone().requires_grad_()
        with poison_overwritten():
            h = leaf.clone()
            out = call(h)
            assert out is not h
            torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
            with torch._C.DisableTorchFunction():
                assert h.isnan().all()
            try:
                h + 1
            except OverwrittenTensorError as error:
                assert name in str(error), str(error)
            else:
                raise AssertionError(f"{name}: reading the overwritten input did not raise")
            out.sum().backward()
        assert leaf.grad is not None and torch.isfinite(leaf.grad).all()


def no_host_sync(rank: int, world: int) -> None:
    """A training step of InPlaceABNSync and ABNSync layers (forward, backward with its
    all-reduce, SGD) reads no tensor value on the host, after the first step (which checks
    once that the ranks agree: tests/support/host_sync.py)."""
    from host_sync import NoHostSync

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), iabn.InPlaceABNSync(4),
        torch.nn.Conv2d(4, 4, 3, padding=1), iabn.ABNSync(4, activation="elu"),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 2),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(2 + rank, 3, 5, 5), torch.randint(0, 2, (2 + rank,))
    for step in range(2):
        with NoHostSync() if step else contextlib.nullcontext():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert model[1].num_batches_tracked.item() == 2


def half_inputs_in_pieces(rank: int, world: int) -> None:
    """bfloat16 and float16 inputs (float32 parameters, as under autocast): the input
    gradient within twice PyTorch's own error of a float64 reference on the whole batch, and
    a backward that makes no float32 tensor of a whole rank's activation (it works on float32
    slices: kernels/common.pieces)."""
    from iabn.kernels import common as parts
    from iabn.measure import traffic

    parts.MIN_PIECE = 1  # slices at this tiny size (a process of its own)
    sizes = [20, 13][:world] + [7] * max(0, world - 2)
    for dtype in (torch.bfloat16, torch.float16):
        for activation in WITH_PARAMETER:
            param = ACTIVATION_PARAMS[activation] or 0.01
            torch.manual_seed(3)
            bn = randomise_(torch.nn.BatchNorm2d(6))
            layer = iabn.InPlaceABNSync(6, activation=activation, activation_param=param)
            layer.load_state_dict(bn.state_dict())
            act = torch_activation(activation, param)
            full = (torch.randn(sum(sizes), 6, 5, 4) * 2 + 0.5).to(dtype)
            upstream = torch.randn(sum(sizes), 6, 5, 4).to(dtype)
            grads = {}
            for name, module, cast in (("float64", bn, torch.float64), ("torch", bn, None)):
                ref = (torch.nn.Sequential(module, act).double() if cast else
                       torch.nn.Sequential(module, act))
                x = full.to(cast or dtype).clone().requires_grad_()
                ref(x).backward(upstream.to(cast or dtype))
                grads[name] = _slice(x.grad.double(), sizes, rank)
                bn.float()
            leaf = _slice(full, sizes, rank).clone().requires_grad_()
            out = layer(leaf.clone())
            with traffic.TrafficCounter(leaf.numel()) as counter:
                out.backward(_slice(upstream, sizes, rank))
            assert all(t.dtype == dtype for t in counter.allocations), counter.allocations
            # dx and the float32 slices: under two activations in the input's dtype
            assert counter.peak_all_bytes < 2 * leaf.numel() * leaf.element_size()
            torch_error = (grads["torch"] - grads["float64"]).abs().max().item()
            error = (leaf.grad.double() - grads["float64"]).abs().max().item()
            assert error <= 2 * torch_error + 1e-6, (dtype, activation, error, torch_error)


# ------------------------------------------------------------------ silu, gelu: the branch bit

#: Where the derivatives of torch's modules vanish (float64 bisection): elements below it are
#: on the left branch, which only the bit names.
Y_STAR = {name: torch_minimum(name) for name in BRANCH}


def _torch_branch_activation(name: str) -> torch.nn.Module:
    return torch_activation(name)


def _relative(mine: torch.Tensor, theirs: torch.Tensor, scale: torch.Tensor) -> float:
    """Largest difference relative to the largest value of the reference (``scale``: the
    whole batch's, so that a rank with few or no samples is judged on the same scale)."""
    if mine.numel() == 0:
        return 0.0
    return ((mine.double() - theirs.double()).abs().max() / scale.double().abs().max()).item()


def _branch_layer(form: str, activation: str, reference: torch.nn.Module):
    """``(call, parameters, statistics)`` of the synchronised form under test, with the
    reference's parameters and running statistics."""
    if form == "functional":
        from iabn.functional import inplace_abn_sync

        weight = reference.weight.detach().clone().requires_grad_()
        bias = reference.bias.detach().clone().requires_grad_()
        mean, var = reference.running_mean.clone(), reference.running_var.clone()

        def call(x: torch.Tensor) -> torch.Tensor:
            return inplace_abn_sync(x.clone(), mean, var, weight, bias, training=True,
                                    activation=activation)

        return call, {"weight": weight, "bias": bias}, {"running_mean": mean, "running_var": var}
    cls = {"InPlaceABNSync": iabn.InPlaceABNSync, "ABNSync": iabn.ABNSync}[form]
    layer = cls(reference.num_features, activation=activation).to(reference.weight.dtype)
    layer.load_state_dict(reference.state_dict())
    # ABNSync leaves its input untouched, so it takes the leaf itself
    call = layer if form == "ABNSync" else (lambda x: layer(x.clone()))
    return call, dict(layer.named_parameters()), {
        "running_mean": layer.running_mean, "running_var": layer.running_var, "layer": layer}


def branch_activations_match_single_process(rank: int, world: int) -> None:
    """InPlaceABNSync, ABNSync and inplace_abn_sync with silu/gelu in float64, two training
    steps and one eval step: outputs, each rank's input gradient, the parameter gradients
    summed over the ranks and the running statistics equal nn.BatchNorm2d + nn.SiLU/nn.GELU
    on the whole batch in one process, to 1e-10 of each quantity's largest value (measured:
    at most 3.2e-13; the bound is that of the local layer's float64 test). Batches of 3 and 5
    samples, and of 4 and 0. The kernels are the ones IABN_BACKEND names (the Triton ones
    keep their own bits and invert in their own passes)."""
    worst = 0.0
    for sizes in ([3, 5], [4, 0]):
        for activation in BRANCH:
            for form in ("InPlaceABNSync", "ABNSync", "functional"):
                torch.manual_seed(1)
                reference = randomise_(torch.nn.BatchNorm2d(6)).double()
                act = _torch_branch_activation(activation)
                call, parameters, statistics = _branch_layer(form, activation, reference)
                for step in range(3):
                    training = step < 2
                    if not training:
                        if form == "functional":
                            break
                        reference.eval()
                        statistics["layer"].eval()
                    torch.manual_seed(100 + step)
                    full = torch.randn(sum(sizes), 6, 5, 4, dtype=torch.float64) * 2 + 0.5
                    upstream = torch.randn(sum(sizes), 6, 5, 4, dtype=torch.float64)
                    reference.zero_grad()
                    for p in parameters.values():
                        p.grad = None
                    x_ref = full.clone().requires_grad_()
                    y_ref = reference(x_ref)
                    mine_y = _slice(y_ref.detach(), sizes, rank)
                    # both branches on every rank with samples: a layer without the bit
                    # could not tell them apart
                    assert not mine_y.numel() or ((mine_y < Y_STAR[activation]).any()
                                                  and (mine_y > Y_STAR[activation]).any())
                    out_ref = act(y_ref)
                    out_ref.backward(upstream)
                    x_leaf = _slice(full, sizes, rank).clone().requires_grad_()
                    before = x_leaf.detach().clone()
                    out = call(x_leaf)
                    assert torch.equal(x_leaf.detach(), before)
                    out.backward(_slice(upstream, sizes, rank))
                    errors = {
                        "out": _relative(out.detach(), _slice(out_ref.detach(), sizes, rank),
                                         out_ref),
                        "dx": _relative(x_leaf.grad, _slice(x_ref.grad, sizes, rank),
                                        x_ref.grad),
                    }
                    for name, p in parameters.items():
                        grad = p.grad.clone()
                        dist.all_reduce(grad)  # DDP's average times the world size
                        theirs = getattr(reference, name).grad
                        errors[name] = _relative(grad, theirs, theirs)
                    for name in ("running_mean", "running_var"):
                        theirs = getattr(reference, name)
                        errors[name] = _relative(statistics[name], theirs, theirs)
                    case = (sizes, activation, form, step)
                    assert max(errors.values()) <= 1e-10, (case, errors)
                    worst = max(worst, *errors.values())
    if os.environ.get("IABN_PRINT_MEASURED"):
        print(f"rank {rank}: largest relative difference {worst:.3g}")


def _gather_batches(mine: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The ranks' batches (``sizes`` samples each) concatenated, on every rank."""
    padded = torch.zeros(max(sizes), *mine.shape[1:], dtype=mine.dtype)
    padded[: mine.shape[0]] = mine
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, sizes, strict=True)])


def branch_half_inputs(rank: int, world: int) -> None:
    """bfloat16 inputs (float32 parameters, as under autocast) with silu/gelu, batches of 8
    and 5: each rank's input gradient and the summed parameter gradients within the bound
    of the local layer's low-precision test (tests/core/test_branch_activation.py): twice the
    larger of PyTorch's own error in bfloat16 and the error of an exact float64 computation
    from the stored ``z`` and branch (its ``exact_from_output`` on the whole batch), both
    against float64 nn.BatchNorm2d + the activation on the whole batch, plus 1e-6 of the
    largest value (measured: at most 1.0x that larger error). The backward makes no float32
    tensor of a whole rank's activation (Newton on float32 slices) and holds at most one
    activation in bfloat16 more than nn.BatchNorm2d + the activation on the rank's batch."""
    from iabn.kernels import common as parts
    from iabn.measure import traffic
    from test_branch_activation import exact_from_output

    # slices at this tiny size (a process of its own); Newton's in 32 parts, not 64: each
    # part's operations are seen in Python by the counter below
    parts.MIN_PIECE, parts.PIECES = 1, 8
    sizes = [8, 5]
    dtype = torch.bfloat16
    ratios = []
    for activation in BRANCH:
        torch.manual_seed(3)
        bn = randomise_(torch.nn.BatchNorm2d(6))
        layer = iabn.InPlaceABNSync(6, activation=activation)
        layer.load_state_dict(bn.state_dict())
        act = _torch_branch_activation(activation)
        full = (torch.randn(sum(sizes), 6, 5, 4) * 1.5).to(dtype)
        upstream = torch.randn(sum(sizes), 6, 5, 4).to(dtype)
        grads = {}
        for name, cast in (("float64", torch.float64), ("torch", None)):
            ref = copy.deepcopy(torch.nn.Sequential(bn, act))
            ref = ref.double() if cast else ref
            x = full.to(cast or dtype).clone().requires_grad_()
            ref(x).backward(upstream.to(cast or dtype))
            grads[name] = {"dx": x.grad.double(), "weight": ref[0].weight.grad.double(),
                           "bias": ref[0].bias.grad.double()}
        leaf = _slice(full, sizes, rank).clone().requires_grad_()
        out = layer(leaf.clone())
        # counted for silu on rank 0 only (each operation is seen in Python: 4 s a run
        # here); gelu's backward is the same code with another phi and phi'
        counted = activation == "silu" and rank == 0
        with traffic.TrafficCounter(leaf.numel()) if counted else (
                contextlib.nullcontext()) as counter:
            out.backward(_slice(upstream, sizes, rank))
        if counter is not None:
            assert all(t.dtype != torch.float32 for t in counter.allocations), counter.allocations
            local = traffic.count_step(torch.nn.Sequential(copy.deepcopy(bn), act),
                                       leaf.detach().clone().requires_grad_(),
                                       _slice(upstream, sizes, rank)).backward
            activation_bytes = leaf.numel() * leaf.element_size()
            assert counter.peak_all_bytes <= local.peak_all_bytes + activation_bytes, (
                counter.peak_all_bytes, local.peak_all_bytes, activation_bytes)
        from_z = dict(zip(("dx", "weight", "bias"), exact_from_output(
            full, _gather_batches(out.detach(), sizes), upstream, bn.weight.detach(),
            bn.bias.detach(), activation), strict=True))
        mine = {"dx": leaf.grad.double()}
        for name in ("weight", "bias"):
            grad = getattr(layer, name).grad.clone()
            dist.all_reduce(grad)
            mine[name] = grad.double()
        for name, value in mine.items():
            exact, theirs, stored = grads["float64"][name], grads["torch"][name], from_z[name]
            if name == "dx":
                exact, theirs, stored = (_slice(t, sizes, rank) for t in (exact, theirs, stored))
            allowed = max((theirs - exact).abs().max().item(),
                          (stored - exact).abs().max().item())
            error = (value - exact).abs().max().item()
            scale = grads["float64"][name].abs().max().item()
            assert error <= 2 * allowed + 1e-6 * scale, (activation, name, error, allowed)
            ratios.append(error / allowed)
    if os.environ.get("IABN_PRINT_MEASURED"):
        print(f"rank {rank}: error / the larger error at most {max(ratios):.3g}")


SCENARIOS = {
    "branch_activations_match_single_process": branch_activations_match_single_process,
    "branch_half_inputs": branch_half_inputs,
    "half_inputs_in_pieces": half_inputs_in_pieces,
    "no_host_sync": no_host_sync,
    "abn_sync_matches_single_process": abn_sync_matches_single_process,
    "debug_poisons": debug_poisons,
    "matches_single_process": matches_single_process,
    "counts_collectives": counts_collectives,
    "rejects_mismatched_ranks": rejects_mismatched_ranks,
    "functional_and_conversion": functional_and_conversion,
}
