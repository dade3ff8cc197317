"""Loading checkpoints laid out like the original inplace_abn package's (built here with
random values: the released weights cannot be downloaded)."""

import pytest
import torch

from iabn.models import create, load_original

from helpers import randomise_


def _original_checkpoint(model):
    """The original ImageNet format: 'module.' prefixes, no num_batches_tracked."""
    state = {f"module.{k}": v.clone() for k, v in model.state_dict().items()
             if not k.endswith("num_batches_tracked")}
    return {"epoch": 90, "arch": "resnet34", "state_dict": state, "best_prec1": 0.0}


def _randomised(name, **kw):
    torch.manual_seed(0)
    model = create(name, num_classes=10, **kw)
    for module in model.modules():
        if hasattr(module, "running_var") and module.running_var is not None:
            randomise_(module)
    return model.eval()


def test_original_checkpoint_reproduces_the_original_computation(tmp_path):
    source = _randomised("resnet34")
    path = tmp_path / "resnet34.pth.tar"
    torch.save(_original_checkpoint(source), path)

    ours = create("resnet34", num_classes=10).eval()
    report = load_original(ours, path)
    assert report.ok, str(report)

    # Independent reference: plain BatchNorm2d whose weight is |w| + eps, the original formula.
    reference = create("resnet34", num_classes=10, norm_act="bn").eval()
    reference.load_state_dict(source.state_dict())
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.weight.copy_(module.weight.abs() + module.eps)
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(ours(x.clone()), reference(x), rtol=1e-4, atol=1e-5)

    as_bn = create("resnet34", num_classes=10, norm_act="bn").eval()
    assert load_original(as_bn, path).ok
    torch.testing.assert_close(as_bn(x), reference(x), rtol=1e-4, atol=1e-5)


def test_mismatch_is_reported_before_anything_is_loaded(tmp_path):
    source = _randomised("resnet34")
    checkpoint = _original_checkpoint(source)
    del checkpoint["state_dict"]["module.mod2.block1.convs.bn1.bias"]
    checkpoint["state_dict"]["module.extra.weight"] = torch.zeros(1)
    target = create("resnet34", num_classes=10)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ValueError, match=r"missing: mod2\.block1\.convs\.bn1\.bias.*"
                                         r"unexpected: extra\.weight"):
        load_original(target, checkpoint)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    report = load_original(target, checkpoint, strict=False)
    assert report.missing == ["mod2.block1.convs.bn1.bias"]
    assert report.unexpected == ["extra.weight"]


def test_corrupt_file_names_the_file(tmp_path):
    path = tmp_path / "broken.pth.tar"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"cannot read checkpoint .*broken\.pth\.tar"):
        load_original(create("resnet34"), path)


def test_vistas_style_snapshot_body_section(tmp_path):
    source = _randomised("wider_resnet16_a2", dilation=True)
    body = {k: v for k, v in source.state_dict().items()
            if not k.startswith("classifier") and not k.endswith("num_batches_tracked")}
    snapshot = {"state_dict": {"body": body, "head": {"map_bn.weight": torch.ones(256)},
                               "cls": {"weight": torch.zeros(65, 256, 1, 1)}}}
    trunk = create("wider_resnet16_a2", dilation=True, num_classes=None).eval()
    assert load_original(trunk, snapshot, section="body").ok
    with pytest.raises(KeyError, match="no section 'trunk'"):
        load_original(trunk, snapshot, section="trunk")
