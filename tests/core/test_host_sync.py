"""No host synchronisation in a training step with iabn layers, eager and compiled: nothing in
the step reads tensor values on the host (tests/support/host_sync.py). The synchronised layers are
checked across processes in tests/core/test_distributed.py."""

import pytest
import torch
from torch import nn

import iabn
from host_sync import HostSyncError, NoHostSync


def _model():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), iabn.InPlaceABN(8),
        nn.Conv2d(8, 8, 3, padding=1), iabn.ABN(8, activation="relu"),
        nn.Conv2d(8, 8, 3, padding=1), iabn.InPlaceABN(8, activation="elu", activation_param=1.0),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def _step(forward, optimizer, x, y):
    optimizer.zero_grad()
    nn.functional.cross_entropy(forward(x), y).backward()
    optimizer.step()


def test_the_mode_finds_host_reads():
    x = torch.randn(4)
    for read in (lambda: x.sum().item(), lambda: bool(x[0] > 0), lambda: torch.equal(x, x),
                 lambda: x[x > 0], lambda: float(x.max())):
        with pytest.raises(HostSyncError), NoHostSync():
            read()
    with NoHostSync():
        x[torch.tensor([0, 2])].sum()  # an integer index reads nothing on the host


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("channels_last", [False, True])
def test_training_step_reads_nothing_on_the_host(mode, channels_last):
    """Forward, backward and SGD step, in training and then an eval forward. Compiled with
    ``aot_eager``: the step runs AOTAutograd's graphs and run-time wrappers, those Inductor
    uses too (its CPU kernels are C++, which reads no values on the host)."""
    torch._dynamo.reset()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = _model().to(memory_format=fmt)
    forward = torch.compile(model, backend="aot_eager", fullgraph=True) if mode == "compiled" \
        else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=fmt)
    y = torch.randint(0, 4, (4,))
    _step(forward, optimizer, x, y)  # compiles; the first SGD step makes its momentum buffers
    before = model[1].running_mean.clone()
    with NoHostSync():
        _step(forward, optimizer, x, y)
        model.eval()
        with torch.no_grad():
            forward(x)
    assert not torch.equal(model[1].running_mean, before)  # the step ran inside the mode
