"""A bad argument is rejected before torch is imported: exit status 2, one line on stderr
naming the argument, and ``torch`` not in ``sys.modules`` at that point (importing torch,
torchvision or timm takes seconds; checking an argument should not). Not a timing test: what
is checked is what was imported."""

import json
import subprocess
import sys

import pytest

# Each case runs in one fresh interpreter, one after the other: main() must return 2 with one
# line on stderr, and torch must still be absent afterwards.
SCRIPT = """
import contextlib, io, json, sys
from iabn.tools.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([code, err.getvalue(), "torch" in sys.modules])
print()
print(json.dumps(results))
"""


def _cases(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "good.json").write_text("{}")
    (tmp_path / "images").mkdir()
    good, bad = str(tmp_path / "good.json"), str(tmp_path / "bad.json")
    afile = tmp_path / "afile"
    afile.write_text("")
    return [
        # (argv, what the one line says)
        (["memory", "resnet5O"], "unknown model 'resnet5O'; close matches: resnet50"),
        (["memory", "no_such_module_for_iabn:f"], "cannot import 'no_such_module_for_iabn'"),
        (["memory", "resnet50:"], "expected pkg.module:factory"),
        (["memory", "resnet50", "--input", "8,3,224"], None),  # valid: rank 3 is allowed
        (["memory", "resnet50", "--input", "8,3,x,224"], "argument --input: expected positive"),
        (["memory", "resnet50", "--compile-budget", "2"], "argument --compile-budget: 2.0 is "
                                                          "outside [0, 1]"),
        (["memory", "resnet50", "--json", str(folder)], "is a folder; give a file name"),
        (["plan", "resnet5O"], "unknown model 'resnet5O'"),
        (["plan", "resnet50", "--budget", "0"], "argument --budget: a fraction must be in"),
        (["plan", "resnet50", "--allow", "swap"], "argument --allow: expected a comma-separated"),
        (["plan", "resnet50", "--json", str(afile / "x.json")], "afile is a file, not a folder"),
        (["bench", "--batch", "0"], "argument --batch: must be at least 1, got 0"),
        (["bench", "--batch", "1", "--size", "1"], "--batch x --size^2 must be at least 2"),
        (["bench", "--json", str(folder)], "is a folder; give a file name"),
        (["segment", "x.pth", str(tmp_path / "nope"), str(tmp_path / "out")],
         "IN_DIR"),
        (["segment", "x.pth", str(tmp_path / "images"), str(afile / "out")],
         "afile is a file, not a folder"),
        (["segment", str(tmp_path / "none.pth"), str(tmp_path / "images"),
          str(tmp_path / "out")], "snapshot"),
        (["segment", "x.pth", "a", "b", "--scales", "0"], "argument --scales: scales must be "
                                                          "positive"),
        (["train", str(tmp_path / "nosuch.json")], "config file"),
        (["train", bad], "is not valid JSON"),
        (["train", good, "--set", "lr"], "--set 'lr': expected SECTION.KEY=VALUE"),
        (["train", good, "a", "--data-root", "b"], "DATA_ROOT 'a' and --data-root 'b' differ"),
        (["train", good, "--log-dir", str(afile / "run")], "afile is a file, not a folder"),
        (["train-seg", bad], "is not valid JSON"),
        (["test", bad, "x.pth"], "is not valid JSON"),
        (["test", good, "x.pth", "--crop", "99999"], "--crop must be at most 16384"),
        (["test", good, "x.pth", "--json", str(folder)], "is a folder; give a file name"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
    ]


def test_bad_arguments_exit_2_before_torch_is_imported(tmp_path):
    cases = [c for c in _cases(tmp_path) if c[1] is not None]
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([a for a, _ in cases])],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    for (argv, text), (code, err, torch_loaded) in zip(cases, outcomes, strict=True):
        assert code == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith("iabn"), (argv, err)
        assert text in err, (argv, err)
        assert not torch_loaded, f"{argv}: torch was imported before the argument was refused"


def test_a_valid_command_line_passes_the_checks_and_then_loads_torch(tmp_path):
    """The control: the same script sees torch once a command gets past its checks (here to
    a device this machine lacks, which takes torch to tell)."""
    argv = [["memory", "torch.nn:Identity", "--device", "cuda:99", "--quiet"]]
    result = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(argv)],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [(code, err, torch_loaded)] = json.loads(result.stdout.splitlines()[-1])
    assert code == 2 and "--device 'cuda:99'" in err and torch_loaded


def test_import_iabn_loads_torch_only_when_a_name_is_used():
    script = ("import sys, iabn; assert 'torch' not in sys.modules; "
              "from iabn import InPlaceABN; import torch; "
              "assert InPlaceABN is sys.modules['iabn.layers.batch_norm'].InPlaceABN; "
              "assert isinstance(iabn.InPlaceABN(2), torch.nn.Module); "
              "assert {'InPlaceABN', 'convert', 'debug'} <= set(dir(iabn)); "
              "assert all(hasattr(iabn, name) for name in iabn.__all__); print('ok')")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-3000:]


def test_model_names_read_from_the_sources_are_the_libraries_own():
    """The names found without importing torchvision and timm are exactly what they list."""
    from iabn.tools import arguments

    torchvision = pytest.importorskip("torchvision")
    assert sorted(arguments.torchvision_names()) == sorted(torchvision.models.list_models(
        module=torchvision.models))
    timm = pytest.importorskip("timm")
    assert sorted(arguments.timm_names()) == sorted(timm.list_models())
    assert arguments.model_source("resnet50") == "torchvision"  # torchvision wins
    assert arguments.model_source("tresnet_m") == "timm"
    assert arguments.model_source("torch.nn:Identity") == "factory"


def test_the_light_copies_agree_with_their_sources():
    from iabn.planning import ALLOWED
    from iabn.tools import arguments
    from iabn.tools.bench import blocks

    assert tuple(ALLOWED) == arguments.PLAN_CHOICES
    assert blocks.BenchConfig is arguments.BenchConfig
