"""A converted model's returned outputs are the caller's: writing into them after the call
works as it does on the model as given (``out.mul_(2)``, then backward), float64. convert
leaves untouched a site whose output, or a view of it, the model returns: the in-place and
output-only layers keep their output for backward."""

import torch
import torch.nn.functional as F
from torch import nn

import iabn

C = 4
#: measured: the converted models' gradients differ from the originals' by at most 5.9e-17
#: of the largest (float64; 0 where only the returned site converts); 100x
TOLERANCE = 5.9e-15


class EndsWithNormAct(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class EndsWithLayerNormView(nn.Module):
    """A pre-norm MLP whose final norm's output is returned through a view."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        h = x.flatten(2).transpose(1, 2)
        return self.norm(self.fc(h)).transpose(1, 2)


class EndsWithGelu(nn.Module):
    """A dict output: features from a GELU, and logits from a head beside it."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 3, padding=1)
        self.bn = nn.BatchNorm2d(C)
        self.conv2 = nn.Conv2d(C, C, 1)
        self.act = nn.GELU()
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        h = F.leaky_relu(self.bn(self.conv(x)), 0.2)
        return {"features": self.act(self.conv2(h)), "logits": self.head(h)}


def _outputs(result):
    return list(result.values()) if isinstance(result, dict) else [result]


def _step_writing_outputs(model, x):
    """The gradients of ``sum(out * 2)`` over the outputs, each scaled in place first."""
    model.zero_grad()
    outputs = _outputs(model(x))
    for out in outputs:
        out.mul_(2)
    sum(out.square().sum() for out in outputs).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _randomised(model):
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return model.double().train()


def _check(model_class, returned):
    model = _randomised(model_class())
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    converted, report = iabn.convert(model, x)
    rows = {row.name: row for row in report.rows}
    for name in returned:
        assert rows[name].decision == "untouched", rows[name]
        assert "returned by the model" in rows[name].reason
    want = _step_writing_outputs(model, x)
    got = _step_writing_outputs(converted, x)
    largest = max(float(g.abs().max()) for g in want.values())
    assert max(float((got[k] - want[k]).abs().max()) for k in want) <= TOLERANCE * largest
    return rows


def test_a_returned_norm_and_activation_stay():
    _check(EndsWithNormAct, ["bn"])


def test_a_norm_returned_through_a_view_stays():
    _check(EndsWithLayerNormView, ["norm"])


def test_a_returned_activation_stays_and_the_rest_converts():
    rows = _check(EndsWithGelu, ["act"])
    assert rows["bn"].decision == "InPlaceABN"
