"""Table 3 machinery (iabn.tools.bench.pixels): byte counts on the meta device equal real CPU counts
from iabn.memory, the offloading rule equals OffloadModel's choice, the size searches equal a
brute-force scan, and the benchmark script's quick run reports what it measured."""

import gc
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import iabn
from iabn.memory import saved_storages
from iabn.memory.offloading import DEFAULT_LAYERS
from iabn.models import norm_act_factory
from iabn.tools.bench.pixels import (
    ByteCounter,
    activation_bytes,
    largest_fitting,
    pixels_per_batch,
    segmentation_model,
)

from helpers import load_script

# compares with OffloadModel's host-copy path, taken only without CUDA.
pytestmark = pytest.mark.without_gpu

# The smaller members of both families keep real CPU forwards cheap; the layers are the same.
SMALL = {"resnext101": 50, "wider_resnet38_a2": 16}
BATCH, HEIGHT, WIDTH, CLASSES = 2, 40, 48, 5
BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "pixels_per_batch.py"


@pytest.fixture(scope="module")
def cpu_models():
    built = {}

    def get(body, norm_act):
        if (body, norm_act) not in built:
            torch.manual_seed(0)
            built[body, norm_act] = segmentation_model(body, norm_act, CLASSES,
                                                       SMALL[body]).train()
        return built[body, norm_act]

    return get


def _inputs(device="cpu"):
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(BATCH, 3, HEIGHT, WIDTH, generator=generator).to(device)
    target = torch.randint(0, CLASSES, (BATCH, HEIGHT, WIDTH), generator=generator).to(device)
    return images, target


@pytest.mark.parametrize("norm_act", ["bn", "iabn"])
@pytest.mark.parametrize("body", ["resnext101",
                                  pytest.param("wider_resnet38_a2", marks=pytest.mark.slow)])
def test_meta_counts_equal_real_cpu_counts(body, norm_act, cpu_models):
    model = cpu_models(body, norm_act)
    images, target = _inputs()
    # reference: iabn.memory's counter (storages keyed by data pointer) on real tensors
    reference = saved_storages(lambda x, y: F.cross_entropy(model(x), y), images, target,
                               exclude=[*model.parameters(), *model.buffers()])
    on_cpu = activation_bytes(model, images, target)
    with torch.device("meta"):
        meta_model = segmentation_model(body, norm_act, CLASSES, SMALL[body]).train()
    on_meta = activation_bytes(meta_model, *_inputs("meta"))
    assert on_cpu.total == sum(s.nbytes for s in reference)
    assert on_meta == on_cpu
    # the loss is counted: its log-probabilities are one of the saved storages
    assert (BATCH, CLASSES, HEIGHT, WIDTH) in [s.shape for s in reference]


def _offload_model_stats(model, images, min_bytes):
    """OffloadModel's own accounting of one forward."""
    # OffloadModel recognises conv inputs by storage address; hold every one alive so that no
    # later tensor can reuse an address and be mistaken for one.
    held = []
    hooks = [m.register_forward_pre_hook(lambda _, args: held.append(args[0]))
             for m in model.modules() if isinstance(m, DEFAULT_LAYERS)]
    wrapped = iabn.OffloadModel(model, min_bytes=min_bytes)
    try:
        output = wrapped(images.clone())
        stats = wrapped.stats
        del output
    finally:
        for hook in hooks:
            hook.remove()
        wrapped.remove_hooks()
        held.clear()
        del wrapped
        gc.collect()
    return stats


@pytest.mark.parametrize(("body", "norm_act", "min_bytes"), [
    pytest.param("resnext101", "bn", 0, marks=pytest.mark.slow),  # the benchmark's setting
    ("resnext101", "iabn", 64 * 1024),  # OffloadModel's default size threshold
    pytest.param("wider_resnet38_a2", "iabn", 0, marks=pytest.mark.slow),
])
def test_offload_rule_equals_offload_model(body, norm_act, min_bytes, cpu_models):
    model = cpu_models(body, norm_act)
    images, _ = _inputs()
    counted = activation_bytes(model, images, offload_min_bytes=min_bytes)
    stats = _offload_model_stats(model, images, min_bytes)
    assert stats.offloaded_bytes > 0
    assert counted.kept_with_offload == stats.kept_bytes
    assert counted.offloaded == stats.offloaded_bytes


@pytest.mark.parametrize("body", ["resnext101", "wider_resnet38_a2"])
def test_bodies_have_output_stride_8(body):
    with torch.device("meta"):
        model = segmentation_model(body, "iabn", CLASSES, SMALL[body])
        features = model.body(torch.zeros(1, 3, 100, 76))
    assert features.shape[-2:] == (math.ceil(100 / 8), math.ceil(76 / 8))


@pytest.mark.parametrize("guess", [2, 30, 37, 38, 500])
def test_largest_fitting_walks_to_the_threshold_from_any_guess(guess):
    calls = []

    def fits(value):
        calls.append(value)
        return value <= 37

    assert largest_fitting(fits, guess, minimum=2) == 37
    assert largest_fitting(lambda v: v <= 517, guess, 8) == 512
    assert largest_fitting(lambda v: v <= 8, guess, 8) == 8
    if guess in (37, 38):  # a close guess costs two calls
        assert len(calls) == 2


@pytest.mark.parametrize("guess", [2, 1_000_000])
def test_largest_fitting_needs_logarithmically_many_calls_from_a_far_guess(guess):
    calls = []

    def fits(value):
        calls.append(value)
        return value <= 1000

    assert largest_fitting(fits, guess, minimum=2) == 1000
    assert len(calls) <= 2 * math.log2(abs(guess - 1000)) + 2


def test_largest_fitting_rejects_what_cannot_fit():
    with pytest.raises(ValueError, match="does not fit"):
        largest_fitting(lambda v: v < 2, 10, minimum=2)
    with pytest.raises(ValueError, match="multiple of step"):
        largest_fitting(lambda v: True, 16, 8, minimum=12)


def _tiny_segmenter(norm_act):
    """Two norm layers and a stride-2 stage: enough for the searches, a few ms per forward."""
    make = norm_act_factory(norm_act)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), make(8),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), make(16),
        nn.Conv2d(16, CLASSES, 1), nn.Upsample(scale_factor=2),
    )


def test_table_rows_equal_a_brute_force_scan():
    counter = ByteCounter(_tiny_segmenter, "tiny")
    baseline_batch, baseline_crop = 3, 64
    rows = pixels_per_batch(counter, baseline_batch, baseline_crop)
    budget = counter.device_bytes("bn", baseline_batch, baseline_crop)
    batches, crops = range(2, 40), range(8, 240, 8)
    for row in rows:
        best_batch = max(b for b in batches
                         if counter.device_bytes(row.method, b, baseline_crop) <= budget)
        best_crop = max(c for c in crops
                        if counter.device_bytes(row.method, baseline_batch, c) <= budget)
        assert best_batch < batches[-1] and best_crop < crops[-1]  # the scan went far enough
        assert row.budget == budget
        assert row.fixed_crop == (best_batch, baseline_crop)
        assert row.fixed_batch == (baseline_batch, best_crop)
        assert row.fixed_crop_gain == pytest.approx(best_batch / baseline_batch - 1)
        assert row.fixed_batch_gain == pytest.approx((best_crop / baseline_crop) ** 2 - 1)
    by_method = {row.method: row for row in rows}
    assert by_method["bn"].fixed_crop == by_method["bn"].fixed_batch == (3, 64)
    assert by_method["iabn"].fixed_crop_gain > 0 and by_method["iabn"].fixed_batch_gain > 0


def test_bad_arguments_are_named():
    counter = ByteCounter(_tiny_segmenter, "tiny")
    with pytest.raises(ValueError, match="method="):
        counter.device_bytes("gn", 2, 32)
    with pytest.raises(ValueError, match="crop=30"):
        pixels_per_batch(counter, 2, 30)
    with pytest.raises(ValueError, match="batch=1"):
        pixels_per_batch(counter, 1, 32)
    with pytest.raises(ValueError, match="body="):
        ByteCounter.for_body("vgg19")


def test_benchmark_script_prints_and_writes_what_it_measured(tmp_path, capsys, monkeypatch):
    script = load_script(BENCHMARK)
    # the script's own bodies are covered above; the tiny model keeps this run to a second
    monkeypatch.setattr(script.ByteCounter, "for_body", classmethod(
        lambda cls, body, depth=None: cls(_tiny_segmenter, body)))
    path = tmp_path / "pixels.json"
    assert script.main(["--quick", "--bodies", "resnext101", "--batch", "3", "--crop", "64",
                        "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    assert "NOT GPU peak memory" in printed and "resnext50" in printed
    report = json.loads(path.read_text())
    assert report["machine"]["torch_version"] == torch.__version__
    rows = {row["method"]: row for row in report["rows"]}
    assert set(rows) == {"bn", "iabn", "iabn_offload", "iabn_offload_working"}
    assert rows["bn"]["fixed_crop"] == [3, 64] and rows["bn"]["relative_bytes_at_baseline"] == 1
    # offloading keeps less than InPlace-ABN alone, and its floor lies between the two
    kept = {m: rows[m]["bytes_at_baseline"] for m in rows}
    assert kept["iabn_offload"] < kept["iabn_offload_working"] <= kept["iabn"] < kept["bn"]
    counter = ByteCounter(_tiny_segmenter, "tiny")
    for method, row in rows.items():  # the JSON holds the counts, not something else
        assert row["bytes_at_baseline"] == counter.device_bytes(method, 3, 64)
