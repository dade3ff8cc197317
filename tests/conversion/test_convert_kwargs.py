"""iabn.convert's example_kwargs: ``model(*example_input, **example_kwargs)`` in every step
(the analysis, the byte counts, verify), on fx's graphs and on a recorded run, and clear
errors naming the argument before anything runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import iabn


class Block(nn.Module):
    """A pre-norm block whose forward takes its inputs by keyword, one of them keyword-only."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.fc, self.act = nn.Linear(8, 8), nn.GELU()

    def forward(self, hidden, mask=None, *, scale=1.0):
        hidden = self.proj(hidden)
        h = hidden + self.act(self.fc(self.norm(hidden)))
        return h * scale if mask is None else h * mask * scale


def _inputs():
    torch.manual_seed(0)
    return torch.randn(4, 8), torch.ones(4, 1)


@pytest.mark.parametrize(("args", "kwargs", "path"), [
    ((), {"hidden": "x", "mask": "m"}, "modules swapped"),  # positional parameters: fx
    (("x",), {"scale": 2.0}, "modules swapped"),             # keyword-only: a recorded run
])
def test_keyword_arguments_reach_every_step(args, kwargs, path):
    x, m = _inputs()
    values = {"x": x, "m": m}
    args = tuple(values.get(a, a) for a in args)
    kwargs = {k: values.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    model = Block()
    converted, report = iabn.convert(model, args or None, example_kwargs=kwargs)
    assert report.result == path
    assert [row.decision for row in report.rows] == [
        "InPlaceLayerNorm(overwrite_input=False)", "InPlaceGELU"]
    assert report.saved_after < report.saved_before
    torch.testing.assert_close(converted(*args, **kwargs), model(*args, **kwargs),
                               rtol=0, atol=0)
    assert report.max_difference_train == 0


def test_a_keyword_only_argument_is_recorded_and_named():
    x, _ = _inputs()
    _, report = iabn.convert(Block(), (x,), example_kwargs={"scale": 2.0})
    assert "keyword-only arguments (scale)" in report.result_reason


@pytest.mark.parametrize(("args", "kwargs", "error", "words"), [
    (None, None, TypeError, "example_input must be a tensor"),
    (None, {"hidden": 1.0}, TypeError, "example_kwargs a dict"),
    (None, [("hidden", 1)], TypeError, "example_kwargs must be a dict"),
    ((), {"hiden": "x"}, TypeError, "do not fit Block.forward"),
    (("x",), {"hidden": "x"}, TypeError, "multiple values for argument 'hidden'"),
])
def test_bad_combinations_are_refused_before_anything_runs(args, kwargs, error, words):
    x, _ = _inputs()
    if isinstance(kwargs, dict):
        kwargs = {k: x if v == "x" else v for k, v in kwargs.items()}
    args = tuple(x if a == "x" else a for a in args) if args is not None else None
    model = Block()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(error, match=words):
        iabn.convert(model, args, example_kwargs=kwargs)
    assert not calls
