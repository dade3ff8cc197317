"""Run configurations: defaults, merging, overrides, and errors that name the key and the fix."""

import json
from pathlib import Path

import pytest

from iabn.models import MODELS
from iabn.tools.cli import main
from iabn.tools.training.commands import SCHEMA, load_run_config
from iabn.tools.training.config import (
    ENGINE_SCHEMA,
    ConfigError,
    Option,
    combine,
    defaults,
    differences,
    load_config,
    merge,
    parse_override,
)

# runs the CLI, which picks CUDA when it sees one.
pytestmark = pytest.mark.without_gpu

# The classification configs (other tools keep theirs in configs/ too).
CONFIGS = [Path(__file__).parents[2] / "configs" / f"{name}.json" for name in (
    "digits", "resnext101_bn_lrelu_256", "resnext101_iabn_lrelu_512",
    "resnext152_iabn_lrelu_256", "wider_resnet38_iabn_lrelu_256",
    "resnext101_iabn_sync_lrelu_256", "densenet264_iabn_lrelu_256",
    "resnet34_iabn_sync_lrelu_512", "resnet50_iabn_sync_lrelu_512",
    "resnet101_iabn_sync_lrelu_512")]


def _write(tmp_path, content) -> Path:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(content))
    return path


def test_every_option_is_documented_and_its_default_is_valid():
    for section, options in SCHEMA.items():
        for key, option in options.items():
            assert option.doc.strip(), f"{section}.{key} has no documentation"
            # The default itself passes the checks a user value goes through.
            merged = merge(SCHEMA, {section: {key: option.default}})
            assert merged[section][key] == option.default


def test_file_values_are_merged_over_the_defaults_section_by_section(tmp_path):
    path = _write(tmp_path, {"optimizer": {"lr": 0.5}, "network": {"arch": "resnet18"}})
    config = load_config(path, SCHEMA)
    expected = defaults(SCHEMA)
    expected["optimizer"]["lr"] = 0.5
    expected["network"]["arch"] = "resnet18"
    assert config == expected


def test_ints_are_accepted_for_floats_and_stored_as_floats(tmp_path):
    config = load_config(_write(tmp_path, {"optimizer": {"lr": 1}}), SCHEMA)
    assert config["optimizer"]["lr"] == 1.0 and isinstance(config["optimizer"]["lr"], float)


def test_overrides_are_parsed_as_json_or_text_and_applied_last(tmp_path):
    path = _write(tmp_path, {"optimizer": {"lr": 0.5}})
    config = load_config(path, SCHEMA, ["optimizer.lr=0.25", "network.arch=resnet34",
                                        "schedule.milestones=[2, 4]"])
    assert config["optimizer"]["lr"] == 0.25
    assert config["network"]["arch"] == "resnet34"
    assert config["schedule"]["milestones"] == [2, 4]
    assert parse_override("data.root=/a=b") == ("data", "root", "/a=b")


def test_data_root_argument_overrides_the_config(tmp_path):
    path = _write(tmp_path, {"data": {"root": "/elsewhere"}})
    assert load_run_config(path, "/data/imagenet", [])["data"]["root"] == "/data/imagenet"
    assert load_run_config(path, None, [])["data"]["root"] == "/elsewhere"


@pytest.mark.parametrize(("content", "overrides", "expected"), [
    ({"optimiser": {}}, [], r"unknown section 'optimiser' \(did you mean 'optimizer'\?\)"),
    ({"optimizer": {"learning_rate": 0.1}}, [], r"\[optimizer\]: unknown key 'learning_rate'"),
    ({"optimizer": {"lr": "fast"}}, [], r"optimizer.lr: expected a float, got \"fast\""),
    ({"optimizer": {"nesterov": 1}}, [], r"optimizer.nesterov: expected a bool, got 1"),
    ({"data": {"batch_size": 2.5}}, [], r"data.batch_size: expected a int, got 2.5"),
    ({"data": {"batch_size": 0}}, [], r"data.batch_size: must be at least 1"),
    ({"network": {"arch": "resnet19"}}, [], r"network.arch: unknown value 'resnet19' "
                                            r"\(did you mean 'resnet18'\?\)"),
    ({"optimizer": {"type": "lamb"}}, [], r"optimizer.type: unknown value 'lamb'.*sgd, adam"),
    ({"schedule": {"type": "exponential"}}, [], r"schedule.type: unknown value"),
    ({"input": {"mean": [0.5, 0.5]}}, [], r"input.mean: expected 3 numbers, got 2"),
    ({"network": {"num_classes": None, "arch": None}}, [], r"network.arch: null is not allowed"),
    ({"optimizer": 0.1}, [], r"section 'optimizer' must be an object"),
    ({}, ["optimizer.lr"], r"expected SECTION.KEY=VALUE"),
    ({}, ["schedule.epochs=ten"], r"schedule.epochs: expected a int"),
])
def test_bad_values_name_the_key(tmp_path, content, overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_run_config(_write(tmp_path, content), None, overrides)


@pytest.mark.parametrize(("content", "expected"), [
    ({"schedule": {"milestones": [60, 30]}}, r"schedule.milestones must be increasing"),
    ({"schedule": {"epochs": 5, "warmup_epochs": 5}}, r"warmup_epochs=5.0 must be less"),
    ({"schedule": {"warmup_factor": 2}}, r"warmup_factor must be at most 1"),
    ({"network": {"norm_act": "iabn", "activation": "relu"}}, r"not invertible"),
    ({"input": {"crop_val": 300}}, r"input.crop_val=300 is larger than input.scale_val=256"),
    ({"input": {"scale_train": 200}}, r"input.scale_train=200 is smaller than"),
    ({"input": {"area_range_train": [0.5, 0.1]}}, r"input.area_range_train must be"),
    ({"input": {"std": [0.2, 0.0, 0.2]}}, r"input.std must be positive"),
    ({"data": {"digits_val_fraction": 1.0}}, r"data.digits_val_fraction"),
])
def test_combinations_that_cannot_run_are_refused(tmp_path, content, expected):
    with pytest.raises(ConfigError, match=expected):
        load_run_config(_write(tmp_path, content), None, [])


def test_relu_is_accepted_with_standard_batch_norm(tmp_path):
    path = _write(tmp_path, {"network": {"norm_act": "bn", "activation": "relu"}})
    assert load_run_config(path, None, [])["network"]["activation"] == "relu"


@pytest.mark.parametrize(("text", "expected"), [
    ("{", r"is not valid JSON"), ("[1, 2]", r"expected a JSON object of sections"),
])
def test_unreadable_files_are_reported_with_their_path(tmp_path, text, expected):
    path = tmp_path / "broken.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected) as info:
        load_config(path, SCHEMA)
    assert str(path) in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json", SCHEMA)


def test_combine_refuses_a_key_defined_twice():
    with pytest.raises(ValueError, match="defined twice"):
        combine(ENGINE_SCHEMA, {"optimizer": {"lr": Option(1.0, "again", float)}})


def test_differences_list_changed_keys_and_skip_ignored_ones():
    old = defaults(SCHEMA)
    new = defaults(SCHEMA)
    new["optimizer"]["lr"] = 0.2
    new["logging"]["log_every"] = 1
    new["data"]["workers"] = 0
    assert differences(old, new, ignore=("logging", "data.workers")) == [
        "optimizer.lr: 0.1 -> 0.2"]


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_are_valid(path):
    config = load_run_config(path, None, [])
    assert config["network"]["arch"] in MODELS


def test_the_paper_config_follows_the_paper():
    paper = load_run_config(CONFIGS[0].with_name("resnext101_iabn_lrelu_512.json"), None, [])
    # Paper §4.1: ResNeXt-101, InPlace-ABN, LeakyReLU(0.01), batch 512, SGD with Nesterov,
    # lr 0.1, momentum 0.9, weight decay 1e-4, 90 epochs, lr / 10 every 30 epochs.
    network = paper["network"]
    assert (network["arch"], network["norm_act"], network["activation"],
            network["activation_param"]) == ("resnext101", "iabn", "leaky_relu", 0.01)
    assert paper["data"]["batch_size"] == 512
    assert (paper["optimizer"]["type"], paper["optimizer"]["nesterov"]) == ("sgd", True)
    assert (paper["optimizer"]["lr"], paper["optimizer"]["momentum"],
            paper["optimizer"]["weight_decay"]) == (0.1, 0.9, 1e-4)
    assert (paper["schedule"]["epochs"], paper["schedule"]["type"],
            paper["schedule"]["step_size"], paper["schedule"]["gamma"]) == (90, "step", 30, 0.1)


def test_print_config_shows_the_merged_config_and_writes_nothing(tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path, {"optimizer": {"lr": 0.5}})
    assert main(["train", str(path), "--set", "schedule.epochs=3", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == load_run_config(path, None, ["schedule.epochs=3"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no runs/ folder
