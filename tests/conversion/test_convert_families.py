"""iabn.convert on model families torch.fx cannot trace (tests/support/model_families.py): a
detector whose forward loops over its layers routed by stored indices (conv + BN + SiLU, CSP
blocks of chunk + cat), and encoder-decoder segmenters (a size check in forward, decoders
that loop over skip lists and dicts). Each is analysed from a recorded run: outputs and the
gradients of the input and every parameter equal the original model's in train and eval
mode (float64, the unconverted model of plain PyTorch layers as the reference), and the
report's bytes are the bytes each model saves."""

import copy

import pytest
import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

import iabn
from conversion_checks import RELATIVE_TOLERANCE, assert_bytes_are_real, assert_same_model
from model_families import DECODERS, Detector, Segmenter


def _randomise(model):
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm)):
            m.weight.data = torch.rand(m.weight.shape, generator=g) + 0.5
            m.bias.data = torch.randn(m.bias.shape, generator=g)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.data = torch.randn(m.running_mean.shape, generator=g)
            m.running_var.data = torch.rand(m.running_var.shape, generator=g) + 0.5
    return model.double()


def test_the_families_do_not_trace():
    """The premise: torch.fx fails on each (the conversion would otherwise not record)."""
    for model in (Detector(), *(Segmenter(name) for name in DECODERS)):
        with pytest.raises(Exception):  # noqa: B017  (fx raises several kinds)
            fx.symbolic_trace(model)


def test_detector_with_routed_layers_goes_in_place_exactly():
    torch.manual_seed(0)
    model = _randomise(Detector())
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    assert type(converted) is Detector and report.result == "modules swapped"
    assert report.counts == {"InPlaceABN": 32}  # every conv + BN + SiLU
    assert all(type(m) is not nn.SiLU for m in converted.modules())
    assert "decided on one recorded run" in report.result_reason
    assert "input shape 2x3x64x64" in report.result_reason
    assert_bytes_are_real(model, converted, report, x)
    # the target: a lossless conversion keeps at most 0.60x of the activation bytes
    # (measured 0.487x here: each layer keeps its output and one bit an element)
    assert report.saved_after <= 0.60 * report.saved_before
    assert_same_model(model, converted, x)


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("policy", ["lossless", "leaky_relu"])
def test_segmentation_decoders_are_analysed_and_exact(decoder, policy):
    torch.manual_seed(0)
    model = _randomise(Segmenter(decoder))
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    converted, report = iabn.convert(model, x, policy=policy)
    assert type(converted) is Segmenter and report.result == "modules swapped"
    norms = [n for n, m in model.named_modules()
             if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))]
    assert [row.name for row in report.rows] == norms
    assert not any(row.decision == "untouched" for row in report.rows), report
    assert_bytes_are_real(model, converted, report, x)
    if policy == "lossless":  # conv + BN + ReLU: ABN keeps what they kept
        assert report.saved_after <= report.saved_before
        assert_same_model(model, converted, x)
    else:  # the reference: the same model with LeakyReLU(0.01) for every ReLU after a norm
        assert report.saved_after < report.saved_before
        assert report.counts.get("InPlaceABN", 0) + report.counts.get(
            "InPlaceGroupNormAct", 0) > 0
        reference = copy.deepcopy(model)
        for name, m in list(reference.named_modules()):
            if type(m) is nn.ReLU:
                reference.set_submodule(name, nn.LeakyReLU(0.01))
        assert_same_model(reference, converted, x)


class ValueBranch(nn.Module):
    """Which path runs depends on the input's values: on one, the norm's input is read
    again after the norm (an in-place layer would have overwritten it)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.act = nn.LeakyReLU(0.1)

    def forward(self, x):
        routed = [x]  # a list of proxies: fx fails here before the branch
        h = self.conv(routed[-1])
        y = self.act(self.bn(h))
        if x.mean() > 0:
            return y
        return y + h


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_branch_on_values_is_never_made_unsafe_on_the_other_path(sign):
    model = _randomise(ValueBranch())
    x = torch.rand(2, 3, 5, 5, dtype=torch.float64) * sign  # decides on one path
    with pytest.warns(iabn.conversion.ConversionWarning, match=r"reads tensor values into "
                      r"Python \(bool\(\) at test_convert_families.py:\d+\)"):
        converted, report = iabn.convert(model, x)
    assert report.result == "converted by parts"
    assert report.rows[0].decision == "untouched"  # called by the forward that reads
    for other in (x, -x):  # both paths give the original's outputs and gradients
        assert_same_model(model, converted, other)


def test_a_recorded_run_finds_a_later_write_through_a_list():
    """The write to the norm's output goes through a list of tensors and an index."""

    class WrittenViaList(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 6, 3, padding=1)
            self.bn = nn.BatchNorm2d(6)
            self.act = nn.SiLU()

        def forward(self, x):
            outs = [self.act(self.bn(self.conv(x)))]
            for i in range(len(outs)):
                outs[i][:, :1] *= 2
            return outs[0]

    model = _randomise(WrittenViaList())
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    converted, report = iabn.convert(model, x)
    assert report.rows[0].decision == "untouched", report.rows[0]
    assert "writes into the norm's output" in report.rows[0].reason
    assert_same_model(model, converted, x)


class ImageList(nn.Module):
    """A detector-style forward taking a list of images (iterated: fx cannot trace it)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.act = nn.SiLU()
        self.head = nn.Conv2d(6, 2, 1)

    def forward(self, images):
        x = torch.stack([image * 2 - 1 for image in images])
        return self.head(self.act(self.bn(self.conv(x))))


def test_an_input_given_as_a_list_of_tensors():
    model = _randomise(ImageList())
    images = [torch.rand(3, 5, 5, dtype=torch.float64) for _ in range(2)]
    converted, report = iabn.convert(model, (images,))
    assert report.example_shape == [[3, 5, 5], [3, 5, 5]]
    assert report.rows[0].decision == "InPlaceABN"
    for training in (True, False):  # the forward's operations are the same: equal (measured)
        expected = copy.deepcopy(model).train(training)(images)
        got = copy.deepcopy(converted).train(training)(images)
        assert torch.equal(got, expected)


@pytest.mark.slow
def test_torchvision_detector_reading_values_is_converted_by_parts():
    """torchvision's SSDlite: fx cannot trace it, and its transform and box matching read
    tensor values (.item(), bool()): its backbone and head, which read none, are converted
    each on its own; losses (train) and detections (eval) equal the original's, and so do
    the gradients of every parameter."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.get_model("ssdlite320_mobilenet_v3_large", weights=None,
                                         weights_backbone=None, num_classes=3).double()
    _randomise(model)
    images = [torch.rand(3, 96, 128, dtype=torch.float64) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[4.0, 4.0, 40.0, 50.0]], dtype=torch.float64),
                "labels": torch.tensor([1])} for _ in range(2)]
    with pytest.warns(iabn.conversion.ConversionWarning, match="converted part by part"):
        converted, report = iabn.convert(model, (images, targets))
    assert report.result == "converted by parts"
    assert "part by part: backbone, head" in report.result_reason
    assert report.counts.get("InPlaceABN", 0) > 0 and report.counts.get("ABN", 0) > 0
    assert_bytes_are_real(model, converted, report, (images, targets))
    for training in (True, False):
        runs = []
        for m in (model, converted):
            m = copy.deepcopy(m).train(training)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(1)
                out = m(images, targets)
            leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if training:  # by name: a converted part may order its parameters otherwise
                names, weights = zip(*sorted(m.named_parameters()), strict=True)
                grads = torch.autograd.grad(sum(t.sum() for t in leaves), weights,
                                            allow_unused=True)
                leaves += [g for _, g in sorted(zip(names, grads, strict=True)) if g is not None]
            runs.append(leaves)
        # relative to the tensor's largest value, at least 1e-3 of the largest of all: some
        # gradients are zero but for rounding (a norm's bias whose output goes through a
        # convolution into another norm), measured 3.8e-16 there, as in test_convert_zoo.py
        floor = 1e-3 * max(float(b.abs().max()) for b in runs[0] if b.numel())
        worst = max(float((a - b).abs().max()) / max(float(b.abs().max()), floor)
                    for a, b in zip(*runs, strict=True) if b.numel())
        print(f"{'train' if training else 'eval'}: largest relative difference {worst:.3g}")
        assert worst <= RELATIVE_TOLERANCE, worst
