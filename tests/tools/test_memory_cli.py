"""``iabn memory``: its figures against independent counts, the fitting batch against its
definition, JSON output, and the exit status of user errors."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import iabn
from iabn.memory import saved_tensor_bytes
from iabn.tools import arguments
from iabn.tools.bench import model_memory
from iabn.tools.cli import main

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu

FACTORY = "memory_cli_models:small_net"
FACTORY_SHAPE = (4, 3, 16, 16)
RESNET_SHAPE = (2, 3, 32, 32)
ROW = re.compile(r"^(as given|convert, lossless|convert, leaky_relu)\s+(\d+)\s", re.M)


def _run(*args):
    """``main(["memory", *args])`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["memory", *args])
    return status, out.getvalue(), err.getvalue()


def _shape_text(shape):
    return ",".join(map(str, shape))


def _printed(stdout):
    """{row: bytes} and {policy: fitting batch} as printed."""
    rows = {name: int(n) for name, n in ROW.findall(stdout)}
    line = next(t for t in stdout.splitlines() if t.startswith("batch that fits"))
    batches = {p: int(n) for p, n in re.findall(r"(lossless|leaky_relu) (\d+) ", line)}
    return rows, batches


def _check_figures(build, shape, stdout, report, dtype=torch.float32):
    """Every printed figure against a count of this test's own (same random weights)."""
    torch.manual_seed(0)
    model = build()
    x = torch.randn(*shape, dtype=dtype)
    before = saved_tensor_bytes(model.train(), x)
    rows, batches = _printed(stdout)
    assert rows["as given"] == before == report["saved_bytes"]
    for policy in ("lossless", "leaky_relu"):
        converted, conversion = iabn.convert(model, x, policy=policy, verify=False)
        assert rows[f"convert, {policy}"] == conversion.saved_after
        entry = report["converted"][policy]
        assert entry["saved_bytes"] == conversion.saved_after
        assert entry["counts"] == conversion.counts
        assert entry["norm_saved_before"] == conversion.norm_saved_before
        assert entry["norm_saved_after"] == conversion.norm_saved_after
        # the definition: the converted model at N' fits the original's bytes at N, at N'+1
        # it does not; counted here on real CPU tensors (the command counts on meta)
        fitting = batches[policy]
        assert fitting == entry["fitting_batch"]

        def at(n, converted=converted):
            return saved_tensor_bytes(converted.train(), torch.randn(n, *shape[1:], dtype=dtype))

        assert at(fitting) <= before < at(fitting + 1), policy
    return batches


@pytest.fixture(scope="module")
def factory_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "small.json"
    status, stdout, stderr = _run(FACTORY, "--input", _shape_text(FACTORY_SHAPE), "--json",
                                  str(path), "--table")
    return status, stdout, stderr, path


def test_factory_model_figures_match_independent_counts(factory_run):
    from memory_cli_models import small_net

    status, stdout, stderr, path = factory_run
    assert status == 0, stderr
    report = json.loads(path.read_text())
    batches = _check_figures(small_net, FACTORY_SHAPE, stdout, report)
    # the point of the command: in-place layers leave room for a larger batch
    assert batches["leaky_relu"] > FACTORY_SHAPE[0]
    assert report["source"] == "factory" and report["input_shape"] == list(FACTORY_SHAPE)
    assert report["converted"]["leaky_relu"]["counts"] == {"InPlaceABN": 2}
    assert report["converted"]["leaky_relu"]["counted_on"] == "meta"
    assert {"machine", "versions", "date", "arguments", "wall_time_s"} <= report.keys()
    assert report["versions"]["torch"] == torch.__version__
    assert os.listdir(path.parent) == [path.name]  # the temporary file was renamed
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0600


def test_progress_on_stderr_table_and_wall_time(factory_run):
    status, stdout, stderr, _ = factory_run
    assert status == 0, stderr
    assert "leaky_relu: tracing the model" in stderr and "searching the batch" in stderr
    assert "decision" in stdout and "ReLU becomes LeakyReLU(0.01)" in stdout  # --table
    assert re.search(r"^wall time \d+\.\d s \(\d+ threads\)$", stdout, re.M)
    quiet = _run(FACTORY, "--input", "2,3,8,8", "--quiet")
    assert quiet[0] == 0 and quiet[2] == ""


def test_a_total_that_moves_outside_the_norm_part_is_explained(factory_run):
    """A norm whose output a later layer saves (a squeeze-excitation multiply, as in TResNet):
    in place, that output is the norm's own saved storage, so the total drops by the output's
    bytes while the norm + activation part stays; the output says so. small_net, whose totals
    move by the part alone, gets no note."""
    status, stdout, stderr = _run("memory_cli_models:excite_net", "--input", "4,3,16,16",
                                  "--quiet")
    assert status == 0, stderr
    rows, _ = _printed(stdout)
    parts = re.findall(r"^convert, (\w+) .*?(\d+\.\d+ MiB -> \d+\.\d+ MiB)", stdout, re.M)
    assert len(parts) == 2 and parts[0][1] == parts[1][1]  # the same part for both policies
    output = 4 * 8 * 16 * 16 * 4  # the norm's float32 output at 4x3x16x16
    assert rows["convert, lossless"] - rows["convert, leaky_relu"] == output
    notes = [line for line in stdout.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"note: outside the norm + activation part, convert, "
                               f"leaky_relu keeps {output} bytes (0.03 MiB) less than the "
                               f"model as given: later layers save some norms' outputs")
    assert factory_run[0] == 0 and "outside the norm + activation part" not in factory_run[1]


def test_torchvision_model_figures_match_independent_counts(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    path = tmp_path / "resnet18.json"
    status, stdout, stderr = _run("resnet18", "--input", _shape_text(RESNET_SHAPE), "--quiet",
                                  "--json", str(path))
    assert status == 0, stderr
    report = json.loads(path.read_text())
    assert report["source"] == "torchvision"
    _check_figures(lambda: torchvision.models.get_model("resnet18", weights=None),
                   RESNET_SHAPE, stdout, report)
    # a ReLU network: the output says in one line why lossless saves nothing, and what does
    lossless = report["converted"]["lossless"]
    assert lossless["saved_bytes"] == report["saved_bytes"] and lossless["counts"]["ABN"] == 9
    ratio = report["converted"]["leaky_relu"]["saved_bytes"] / report["saved_bytes"]
    notes = [line for line in stdout.splitlines() if line.startswith("note: lossless")]
    assert notes == [f"note: lossless saves little here: 9 norms are followed by ReLU, which "
                     f"cannot be inverted (they became ABN, exact, keeping what BN + ReLU "
                     f"kept); policy leaky_relu (ReLU -> LeakyReLU(0.01), which changes the "
                     f"model: fine-tune after) keeps {ratio:.3f}x"]


def test_bf16_counts_the_cast_model_and_searches_on_cpu_where_meta_differs(tmp_path):
    from memory_cli_models import input_norm_net

    path = tmp_path / "bf16.json"
    status, stdout, stderr = _run("memory_cli_models:input_norm_net", "--input", "2,3,8,8",
                                  "--dtype", "bf16", "--quiet", "--json", str(path))
    assert status == 0, stderr
    report = json.loads(path.read_text())
    assert "bfloat16" in stdout.splitlines()[0]
    _check_figures(lambda: input_norm_net().to(torch.bfloat16), (2, 3, 8, 8), stdout, report,
                   torch.bfloat16)
    entry = report["converted"]["leaky_relu"]
    assert entry["counts"]["untouched"] == 1
    assert entry["counted_on"] == "cpu" and "meta count differs" in entry["search_note"]


def test_compile_budgets_measure_the_original_model_in_order(monkeypatch):
    calls = []

    def fake(model, x, activation_memory_budget):
        calls.append((type(model).__name__, tuple(x.shape), activation_memory_budget))
        return 1000 + int(100 * activation_memory_budget)

    monkeypatch.setattr(model_memory, "compiled_saved_bytes", fake)
    status, stdout, _ = _run(FACTORY, "--input", "2,3,8,8", "--quiet",
                             "--compile-budget", "1,0.5", "--compile-budget", "0,1")
    assert status == 0
    assert calls == [("Sequential", (2, 3, 8, 8), b) for b in (1.0, 0.5, 0.0)]
    for budget, n in ((1, 1100), (0.5, 1050), (0, 1000)):
        assert re.search(rf"^torch.compile, budget {budget}\s+{n}\s", stdout, re.M), stdout


@pytest.mark.parametrize("args", [
    ["resnet18", "--input", "8,x,224,224"], ["resnet18", "--input", "0,3,224,224"],
    ["resnet18", "--input", "8"], ["resnet18", "--dtype", "int8"],
    ["resnet18", "--compile-budget", "1.5"],
])
def test_bad_arguments_exit_2(args, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["memory", *args])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err  # one line, no usage block
    assert err.startswith("iabn memory: error: argument ")


def test_unknown_name_suggests_close_matches():
    pytest.importorskip("torchvision")
    status, _, stderr = _run("resnet5", "--quiet")
    assert status == 2
    assert "unknown model 'resnet5'" in stderr and "resnet50" in stderr


def test_missing_packages_are_named(monkeypatch):
    monkeypatch.setattr(arguments, "torchvision_names", lambda: None)
    monkeypatch.setattr(arguments, "timm_names", lambda: None)
    status, _, stderr = _run("resnet50", "--quiet")
    assert status == 2 and "pip install torchvision" in stderr
    monkeypatch.setattr(arguments, "timm_names", lambda: ["efficientnet_b0"])
    status, _, stderr = _run("resnet50", "--quiet")
    assert status == 2 and "pip install torchvision" in stderr


@pytest.mark.parametrize(("spec", "message"), [
    ("memory_cli_models:nope", "has no 'nope'"),
    ("no_such_module_for_iabn:f", "cannot import 'no_such_module_for_iabn'"),
    ("memory_cli_models:not_a_module", "returned a str, not a torch.nn.Module"),
    ("memory_cli_models:broken", "raised RuntimeError: the factory failed"),
    ("memory_cli_models:NOT_CALLABLE", "is a int, not a function"),
    ("memory_cli_models:", "expected pkg.module:factory"),
])
def test_bad_factory_exits_2(spec, message):
    status, _, stderr = _run(spec, "--quiet")
    assert status == 2
    assert message in stderr and "Traceback" not in stderr


def test_unwritable_json_path_exits_2_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, _, stderr = _run(FACTORY, "--json", str(blocker / "out.json"))
    assert status == 2 and "is a file, not a folder" in stderr
    assert "building" not in stderr  # no progress: nothing was measured
    status, _, stderr = _run(FACTORY, "--json", str(tmp_path))
    assert status == 2 and "is a folder" in stderr


def test_parse_input():
    assert model_memory.parse_input("8, 3,224,224") == (8, 3, 224, 224)
    assert model_memory.parse_input("2,16") == (2, 16)
    for text in ("", "8", "8,3,-1", "a,b"):
        with pytest.raises(ValueError, match="N,C,H,W"):
            model_memory.parse_input(text)


# --- an --input the model cannot take, factories that exit, names listed once ---


class Measured(Exception):
    """Raised where the minutes of measuring would start."""


@pytest.fixture()
def no_measuring(monkeypatch):
    def measured(*_args, **_kwargs):
        raise Measured

    monkeypatch.setattr(model_memory, "measure", measured)


@pytest.mark.parametrize(("shape", "message"), [
    # the count of numbers first, where it differs from what the first layer takes
    ("3,16,16", "has 3 numbers: memory_cli_models:small_net takes 4, N,3,H,W"),
    ("4,3,16", "has 3 numbers: memory_cli_models:small_net takes 4, N,3,H,W"),
    ("4,3", "has 2 numbers: memory_cli_models:small_net takes 4, N,3,H,W"),
    ("4,3,8,8,5", "has 5 numbers: memory_cli_models:small_net takes 4, N,3,H,W"),
    ("4,5,8,8", "to have 3 channels, but got 5 channels"),
    ("1,3,1,1", "more than one value per channel"),
])
def test_input_the_model_cannot_take_exits_2_before_measuring(shape, message, no_measuring,
                                                              capsys):
    assert main(["memory", FACTORY, "--input", shape, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("iabn memory: error: --input ") and err.count("\n") == 1, err
    assert message in err and "its first layer, 0 (Conv2d)" in err and "takes N,3,H,W" in err


@pytest.mark.parametrize("command", ["memory", "plan"])
def test_a_named_image_model_given_another_count_exits_2_before_building(command, monkeypatch,
                                                                         capsys):
    """``--input 8,3,224`` for resnet50: one line saying it takes N,C,H,W, before the model
    is built (it used to fail seconds later with torch's reading of the shape as unbatched:
    "expected input[1, 8, 3, 224] to have 3 channels, but got 8 channels")."""
    pytest.importorskip("torchvision")

    def built(*_args):
        raise AssertionError("the model was built")

    monkeypatch.setattr(model_memory, "build_model", built)
    assert main([command, "resnet50", "--input", "8,3,224", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (f"iabn {command}: error: --input 8,3,224 has 3 numbers: resnet50 "
                   f"(torchvision) takes images, 4 numbers N,C,H,W such as 8,3,224,224\n")


def test_one_value_per_channel_deep_in_a_torchvision_model_is_explained(no_measuring, capsys):
    pytest.importorskip("torchvision")
    # resnet18 at 32x32: layer4's norms see 1x1 maps, one value per channel at batch 1
    assert main(["memory", "resnet18", "--input", "1,3,32,32", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "in layer4.0.bn1 (BatchNorm2d)" in err
    assert "batch norm in training needs more than one value per channel" in err


def test_input_check_falls_back_to_the_device_where_meta_cannot_run(monkeypatch):
    """A model without meta kernels is checked with a real forward, without autograd and
    without touching its running statistics."""
    from memory_cli_models import small_net

    real = model_memory._try_forward

    def no_meta(model, shape, dtype, device):
        if device.type == "meta":
            return NotImplementedError("no meta kernel"), ""
        return real(model, shape, dtype, device)

    monkeypatch.setattr(model_memory, "_try_forward", no_meta)
    model = small_net()
    stats = model[1].running_mean.clone()
    model_memory.check_input(model, "small", (2, 3, 8, 8), "fp32", torch.device("cpu"))
    assert torch.equal(model[1].running_mean, stats) and model[1].num_batches_tracked == 0
    with pytest.raises(model_memory.ModelMemoryError, match="to have 3 channels"):
        model_memory.check_input(model, "small", (2, 4, 8, 8), "fp32", torch.device("cpu"))


@pytest.mark.parametrize(("spec", "message"), [
    ("memory_cli_models:exits", "calling exits() raised SystemExit(0)"),
    ("memory_cli_models:exits_in_forward", "its forward raised SystemExit(3)"),
    ("iabn_test_exit_on_import:f", "importing iabn_test_exit_on_import raised SystemExit(1)"),
    ("iabn_test_fails_on_import:f", "importing iabn_test_fails_on_import raised "
                                    "ZeroDivisionError"),
])
def test_user_code_that_exits_or_fails_is_an_error_naming_it(spec, message, tmp_path,
                                                            monkeypatch, no_measuring, capsys):
    (tmp_path / "iabn_test_exit_on_import.py").write_text("import sys\nsys.exit(1)\n")
    (tmp_path / "iabn_test_fails_on_import.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["memory", spec, "--input", "2,3,8,8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"iabn memory: error: model {spec!r}"), err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_close_matches_are_listed_once(monkeypatch):
    monkeypatch.setattr(arguments, "torchvision_names", lambda: ["resnet50", "resnet18"])
    monkeypatch.setattr(arguments, "timm_names",
                        lambda: ["resnet50", "resnet18", "resnet26", "resnet50d"])
    status, _, stderr = _run("resnet5", "--quiet")
    assert status == 2
    listed = re.search(r"close matches: ([^.;]*)", stderr).group(1).split(", ")
    assert len(listed) == len(set(listed)) and {"resnet50", "resnet50d"} <= set(listed)


def test_a_device_this_machine_lacks_exits_2_before_building(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # but no cuda:99

    def built(_spec):
        raise AssertionError("the model was built")

    monkeypatch.setattr(model_memory, "build_model", built)
    assert main(["memory", FACTORY, "--device", "cuda:99", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--device 'cuda:99': not usable here" in err and err.count("\n") == 1


def test_an_input_too_large_for_the_machine_is_one_line(monkeypatch, capsys):
    def allocate(*_args, **_kwargs):  # what the CPU allocator raises for an impossible size
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 960000000000 bytes.")

    monkeypatch.setattr(model_memory, "measure", allocate)
    assert main(["memory", FACTORY, "--input", "2,3,200000,200000", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == ("iabn memory: error: out of cpu memory at --input 2,3,200000,200000: use a "
                   "smaller batch or image\n")


@pytest.mark.slow  # 7 s on 2 cores: a child process that imports torch and converts
def test_a_reader_that_goes_away_ends_quietly_with_141():
    """``iabn memory ... | head``: the reader of stdout closes before the command writes; the
    command stops as one that SIGPIPE ends (status 141), without a traceback."""
    support = Path(__file__).resolve().parents[1] / "support"  # memory_cli_models
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(support), os.environ.get("PYTHONPATH", "")])}
    args = ["memory", FACTORY, "--input", _shape_text(FACTORY_SHAPE)]
    proc = subprocess.Popen([sys.executable, "-m", "iabn", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before the child has even started Python
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_model_torch_fx_cannot_trace_is_converted():
    """A detector whose forward loops over its layers routed by stored indices: fx fails on
    it, and the figures come from a recorded run (every conv + BN + SiLU in place)."""
    status, stdout, stderr = _run("model_families:detector", "--input", "2,3,32,32")
    assert status == 0, stderr
    assert "recording a run in train and eval mode" in stderr
    rows, _ = _printed(stdout)
    assert rows["convert, lossless"] <= 0.6 * rows["as given"]
    assert "32 InPlaceABN" in stdout
