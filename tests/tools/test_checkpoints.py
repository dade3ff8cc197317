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


def test_the_one_checkpoint_reader(tmp_path):
    """read_checkpoint: what snapshots, load_original, iabn test and iabn segment all use."""
    from iabn.models.checkpoints import CheckpointError, read_checkpoint

    with pytest.raises(CheckpointError, match=r"snapshot .*missing\.pth does not exist"):
        read_checkpoint(tmp_path / "missing.pth", "snapshot")
    path = tmp_path / "junk.pth"
    path.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint .*junk\.pth \(corrupt"):
        read_checkpoint(path)
    good = tmp_path / "good.pth"
    torch.save({"w": torch.arange(3)}, good)
    assert torch.equal(read_checkpoint(good)["w"], torch.arange(3))
    # weights_only: a file that would run code on loading is refused, not executed
    torch.save({"f": print}, tmp_path / "code.pth")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        read_checkpoint(tmp_path / "code.pth")


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


def _bn_reference(source):
    """Independent reference: the same network with nn.BatchNorm2d and the weights as stored
    (the original ABN is standard batch norm + activation)."""
    reference = create("resnet34", num_classes=10, norm_act="bn").eval()
    reference.load_state_dict(source.state_dict())
    return reference


@pytest.mark.parametrize("how", [pytest.param("origin", marks=pytest.mark.slow), "file name",
                                 pytest.param("bn_mode", marks=pytest.mark.slow)])
def test_original_abn_checkpoint_keeps_signed_weights(tmp_path, how):
    """A checkpoint of the original's ABN (standard BN) must not be read with
    |w| + eps; before, load_original forced gamma_mode='abs' on every layer."""
    source = _randomised("resnet34")
    checkpoint = _original_checkpoint(source)
    kwargs = {}
    if how == "origin":
        kwargs["origin"] = "ABN"
        target = checkpoint
    elif how == "file name":
        target = tmp_path / "resnext101_stdbn_lr_256.pth.tar"
        torch.save(checkpoint, target)
    else:
        target = {**checkpoint, "config": {"network": {"bn_mode": "standard"}}}
    ours = create("resnet34", num_classes=10).eval()
    report = load_original(ours, target, **kwargs)
    assert report.ok and report.origin == "ABN"
    assert set(report.layers.values()) == {"signed"} and len(report.layers) == 36
    assert "origin ABN" in str(report) and "36 signed" in str(report)
    x = torch.randn(2, 3, 64, 64)
    torch.testing.assert_close(ours(x.clone()), _bn_reference(source)(x), rtol=1e-4, atol=1e-5)

    as_bn = create("resnet34", num_classes=10, norm_act="bn").eval()
    report = load_original(as_bn, target, **kwargs)
    assert set(report.layers.values()) == {"bn"}
    torch.testing.assert_close(as_bn(x), _bn_reference(source)(x), rtol=1e-4, atol=1e-5)


def test_origin_is_reported_and_checked():
    source = _randomised("resnet34")
    checkpoint = _original_checkpoint(source)
    ours = create("resnet34", num_classes=10)
    report = load_original(ours, checkpoint)
    assert report.origin == "InPlaceABN" and "default" in report.origin_reason
    assert set(report.layers.values()) == {"abs"}
    for name in ("InPlaceABNSync", "inplace", "sync"):
        assert load_original(ours, checkpoint, origin=name).origin == "InPlaceABN"
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    with pytest.raises(ValueError, match=r"unknown origin='bn'.*'InPlaceABN'.*'ABN'"):
        load_original(ours, checkpoint, origin="bn")
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in before.items())


def test_iabn_test_original_loads_a_stdbn_file_with_signed_weights(tmp_path):
    """`iabn test --original` loads through training.evaluate.load_weights: an original
    standard-BN file (by its name or --origin ABN) must keep its signed weights (item 2)."""
    from iabn.tools.cli import build_parser
    from iabn.tools.training.evaluate import load_weights

    source = _randomised("resnet34")
    path = tmp_path / "resnet34_stdbn.pth.tar"
    torch.save(_original_checkpoint(source), path)
    x = torch.randn(2, 3, 64, 64)
    expected = _bn_reference(source)(x)
    for origin in ("auto", "ABN"):
        ours = create("resnet34", num_classes=10).eval()
        report, _ = load_weights(ours, path, original=True, origin=origin)
        assert report.origin == "ABN", origin
        torch.testing.assert_close(ours(x.clone()), expected, rtol=1e-4, atol=1e-5)
    args = build_parser().parse_args(["test", "config.json", str(path), "--original",
                                      "--origin", "standard"])
    assert args.origin == "ABN"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["test", "config.json", str(path), "--origin", "bn"])


def test_a_folder_given_as_checkpoint_is_called_a_folder(tmp_path):
    """Was "does not exist" for a folder that exists (a run folder given to iabn test)."""
    from iabn.models.checkpoints import CheckpointError, read_checkpoint

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(CheckpointError, match=r"run is a folder, not a file: give the"):
        read_checkpoint(run, "snapshot")
    torch.save({}, run / "last.pth")
    torch.save({}, run / "best.pth")
    names = r"e\.g\. .*best\.pth \(it has best\.pth, last\.pth\)"
    with pytest.raises(CheckpointError, match=names):
        read_checkpoint(run)
