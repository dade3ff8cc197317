"""``iabn test`` and its pieces: top-k against scikit-learn, ten-crop averaging, weights moved
between norm/activation variants, clear key reports, and 2 ranks counting every image once."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import top_k_accuracy_score
from torch import nn

from iabn.models import create
from iabn.tools.cli import main
from iabn.tools.training.classification import TopKMeter, log_probabilities
from iabn.tools.training.evaluate import load_weights
from iabn.tools.training.snapshot import SnapshotError
from train_tiny import DIGITS_VAL_IMAGES, one_torch_thread, run_iabn, write_config

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu

ONE_IMAGE = 100.0 / DIGITS_VAL_IMAGES  # one image, in percent


def test_top_k_meter_matches_scikit_learn_and_adds_up_over_ranks():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 10, generator=generator)
    targets = torch.randint(0, 10, (50,), generator=generator)
    log_probs = F.log_softmax(logits, dim=1)
    halves = [TopKMeter(torch.device("cpu")) for _ in range(2)]
    for meter, part in zip(halves, (slice(0, 23), slice(23, 50)), strict=True):
        meter.update(log_probs[part], targets[part], F.nll_loss(log_probs[part], targets[part]))
    metrics = halves[0].summarize(halves[0].sums + halves[1].sums)  # as all-reduced
    labels = list(range(10))
    assert metrics["top1"] == pytest.approx(
        100 * top_k_accuracy_score(targets, logits, k=1, labels=labels))
    assert metrics["top5"] == pytest.approx(
        100 * top_k_accuracy_score(targets, logits, k=5, labels=labels))
    assert metrics["loss"] == pytest.approx(F.cross_entropy(logits, targets).item(), rel=1e-6)
    assert metrics["count"] == 50


def test_ten_crop_outputs_are_the_log_of_the_mean_softmax():
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 7))
    crops = torch.randn(5, 10, 3, 4, 4)
    expected = torch.stack([
        torch.stack([F.softmax(model(crops[b, k:k + 1]), dim=1)[0] for k in range(10)]).mean(0)
        for b in range(5)]).log()
    torch.testing.assert_close(log_probabilities(model, crops), expected)
    torch.testing.assert_close(log_probabilities(model, crops[:, 0]),
                               F.log_softmax(model(crops[:, 0]), dim=1))


def _trained_like(model: nn.Module) -> nn.Module:
    """Non-trivial BN statistics and affine parameters, as after training."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase):
                module.weight.uniform_(0.5, 1.5, generator=generator)
                module.bias.normal_(0, 0.1, generator=generator)
                module.running_mean.normal_(0, 0.1, generator=generator)
                module.running_var.uniform_(0.5, 2.0, generator=generator)
    return model.eval()


def test_weights_move_between_norm_act_layers_and_activations(tmp_path):
    bn = _trained_like(create("resnet18", num_classes=10, norm_act="bn"))
    path = tmp_path / "ddp_state.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in bn.state_dict().items()}}, path)
    inplace = create("resnet18", num_classes=10, norm_act="iabn").eval()
    report, trained_config = load_weights(inplace, path)
    assert report.ok and trained_config is None
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(inplace(x.clone()), bn(x.clone()), rtol=1e-4, atol=1e-5)
    relu = create("resnet18", num_classes=10, norm_act="bn", activation="relu")
    assert load_weights(relu, path)[0].ok  # activations have no weights


def test_keys_that_do_not_fit_are_listed(tmp_path):
    state = create("resnet18", num_classes=10, norm_act="bn").state_dict()
    state["extra.weight"] = torch.zeros(1)
    path = tmp_path / "resnet18.pth"
    torch.save(state, path)
    deeper = create("resnet34", num_classes=10, norm_act="iabn")
    before = {k: v.clone() for k, v in deeper.state_dict().items()}
    with pytest.raises(SnapshotError, match=r"missing: mod2\.block3.*unexpected: extra\.weight"
                                            r".*--non-strict") as info:
        load_weights(deeper, path)
    assert str(path) in str(info.value)
    assert all(torch.equal(v, before[k]) for k, v in deeper.state_dict().items())  # untouched
    report, _ = load_weights(deeper, path, strict=False)
    assert report.unexpected == ["extra.weight"] and "mod2.block3.convs.conv1.weight" in (
        report.missing)
    torch.testing.assert_close(deeper.state_dict()["mod1.conv1.weight"],
                               state["mod1.conv1.weight"])
    fewer_classes = create("resnet18", num_classes=3, norm_act="bn")
    report, _ = load_weights(fewer_classes, path, strict=False)
    assert any(m.startswith("classifier.fc.weight (10, 512) vs (3, 512)")
               for m in report.shape_mismatches)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    """A tiny digits training run (one epoch, in this process): (config, last.pth, metrics)."""
    root = tmp_path_factory.mktemp("eval")
    config = write_config(root / "tiny.json", schedule={"epochs": 1, "warmup_epochs": 0},
                          logging={"tensorboard": False})
    with one_torch_thread():
        assert main(["train", str(config), "--log-dir", str(root / "run")]) == 0
    path = root / "run" / "last.pth"
    return config, path, torch.load(path, weights_only=True)["val_metrics"]


def _test(*args, tmp_path, name="result.json"):
    out = tmp_path / name
    with one_torch_thread():
        code = main(["test", *map(str, args), "--json", str(out), "--quiet"])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_centre_crop_test_reproduces_the_training_validation(snapshot, tmp_path, capsys):
    config, path, trained = snapshot
    code, result = _test(config, path, tmp_path=tmp_path)
    assert code == 0
    metrics = result["metrics"]
    assert metrics["count"] == trained["count"] == DIGITS_VAL_IMAGES
    assert metrics["top1"] == pytest.approx(trained["top1"], abs=ONE_IMAGE)
    assert metrics["loss"] == pytest.approx(trained["loss"], rel=1e-4)
    # The same weights as standard BatchNorm: an InPlace-ABN network evaluates the same.
    code, as_bn = _test(config, path, "--set", "network.norm_act=bn", tmp_path=tmp_path,
                        name="as_bn.json")
    assert code == 0 and as_bn["metrics"]["top1"] == pytest.approx(metrics["top1"],
                                                                   abs=ONE_IMAGE)
    assert "evaluating with a different network than trained: network.norm_act: " \
           "\"iabn_sync\" -> \"bn\"" in capsys.readouterr().out


def test_bad_checkpoints_and_crops_are_refused(snapshot, tmp_path, capsys):
    config, path, _ = snapshot
    code, _ = _test(config, path, "--set", "network.arch=resnet34", tmp_path=tmp_path)
    assert code == 2
    assert "missing: mod2.block3" in capsys.readouterr().err
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"junk")
    assert _test(config, junk, tmp_path=tmp_path)[0] == 2
    assert f"cannot read checkpoint {junk}" in capsys.readouterr().err
    assert _test(config, path, "--crop", "20", tmp_path=tmp_path)[0] == 2
    assert "--crop 20 is larger than --scale 16" in capsys.readouterr().err


def test_ten_crops_mirror_only_what_the_config_trained_with(snapshot, tmp_path, capsys):
    """The tiny config trains without flips, so --ten-crops evaluates the five crops of the
    image itself, not their mirrors. Its crop is the whole 16x16 image: the five crops are the
    centre crop five times, and the result is the single-crop one. With flips in the config
    the mirrors come back (ten crops), and the result differs."""
    config, path, _ = snapshot
    code, single = _test(config, path, tmp_path=tmp_path, name="single.json")
    assert code == 0 and single["crops_per_image"] == 1
    capsys.readouterr()
    code, five = _test(config, path, "--ten-crops", tmp_path=tmp_path, name="five.json")
    assert code == 0 and five["crops_per_image"] == 5
    assert "5 crops (corners and centre; not mirrored: input.flip_train is false)" in (
        capsys.readouterr().out)
    assert five["metrics"]["top1"] == pytest.approx(single["metrics"]["top1"], abs=1e-9)
    assert five["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-5)
    code, ten = _test(config, path, "--ten-crops", "--set", "input.flip_train=true",
                      tmp_path=tmp_path, name="ten.json")
    assert code == 0 and ten["crops_per_image"] == 10
    assert "10 crops (corners and centre, and their mirrors)" in capsys.readouterr().out
    assert ten["metrics"]["loss"] != pytest.approx(single["metrics"]["loss"], rel=1e-3)


@pytest.mark.slow
def test_two_ranks_count_every_image_once_with_ten_crops(snapshot, tmp_path):
    config, path, _ = snapshot
    code, single = _test(config, path, "--ten-crops", "--batch-size", "32", tmp_path=tmp_path)
    assert code == 0
    out = tmp_path / "ddp.json"
    process = run_iabn("test", str(config), str(path), "--ten-crops", "--batch-size", "64",
                       "--json", str(out), "--quiet", ranks=2)
    assert process.returncode == 0, process.stderr
    ddp = json.loads(out.read_text())
    assert ddp["world_size"] == 2 and ddp["ten_crops"]
    assert ddp["metrics"]["count"] == single["metrics"]["count"] == DIGITS_VAL_IMAGES
    for name in ("top1", "top5"):
        assert ddp["metrics"][name] == pytest.approx(single["metrics"][name], abs=ONE_IMAGE)
    assert ddp["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-4)
    assert math.isfinite(ddp["metrics"]["loss"])
