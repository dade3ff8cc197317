"""Running iabn.convert's tests on both of its ways to a graph: ``torch.fx``'s symbolic trace
(taken where it works) and the recorded run (taken where fx fails), which a test forces by
making the trace fail."""

import pytest
from torch.fx.proxy import TraceError

ANALYSES = ("torch.fx", "recorded run")


def force_recording(monkeypatch):
    """Make ``iabn.convert``'s fx trace fail, as it does on an untraceable model."""
    from iabn.conversion import converter

    def untraceable(model, training):
        raise TraceError("forced by the test: torch.fx is not used")

    monkeypatch.setattr(converter, "trace", untraceable)


@pytest.fixture(params=ANALYSES)
def analysis(request, monkeypatch):
    """Parametrises a test over both ways; the value is the way."""
    if request.param == "recorded run":
        force_recording(monkeypatch)
    return request.param
