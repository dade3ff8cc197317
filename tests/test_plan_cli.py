"""``iabn plan``: its figures against independent counts, JSON output, and the exit status and
one-line message of user errors."""

import contextlib
import io
import json
import re

import pytest
import torch

import iabn
from iabn.memory import saved_tensor_bytes
from iabn.tools.bench.model_plan import parse_allow, parse_budget
from iabn.tools.cli import main

# the tools pick CUDA when they see one; these check their CPU runs.
pytestmark = pytest.mark.without_gpu

FACTORY = "memory_cli_models:small_net"
SHAPE = "4,3,16,16"


def _run(*args):
    """``main(["plan", *args])`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["plan", *args])
    return status, out.getvalue(), err.getvalue()


def _as_given():
    from memory_cli_models import small_net

    torch.manual_seed(0)
    model = small_net()
    return model, saved_tensor_bytes(model.train(), torch.randn(4, 3, 16, 16))


def test_plan_prints_and_writes_the_plan(tmp_path):
    path = tmp_path / "plan.json"
    status, stdout, stderr = _run(FACTORY, "--input", SHAPE, "--budget", "0.5", "--json",
                                  str(path), "--quiet")
    assert status == 0, stderr
    assert stderr == ""
    assert "segment" in stdout and "solver: optimal" in stdout
    data = json.loads(path.read_text())
    plan = data["plan"]
    model, as_given = _as_given()
    assert plan["as_given"] == as_given
    assert plan["budget"] == as_given // 2
    assert plan["measured"] == plan["predicted"] <= plan["budget"]
    assert data["input_shape"] == [4, 3, 16, 16] and data["arguments"]["budget"] == 0.5
    # the printed table is the report's
    for row in plan["rows"]:
        assert re.search(rf"^{re.escape(row['segment'])}\s+{re.escape(row['choice'])}\s",
                         stdout, re.M)
    # the same plan as the library's, on the same weights
    _, report = iabn.plan(model, torch.randn(4, 3, 16, 16), 0.5, verify=False)
    assert [(r.segment, r.choice) for r in report.rows] == [
        (r["segment"], r["choice"]) for r in plan["rows"]]


def test_budget_in_bytes_and_allow(tmp_path):
    _, as_given = _as_given()
    budget = int(as_given * 0.8)
    path = tmp_path / "plan.json"
    status, _, stderr = _run(FACTORY, "--input", SHAPE, "--budget", str(budget),
                                  "--allow", "recompute", "--json", str(path), "--quiet")
    assert status == 0, stderr
    plan = json.loads(path.read_text())["plan"]
    assert plan["budget"] == budget and plan["allow"] == ["recompute"]
    assert plan["measured"] <= budget
    assert {r["choice"] for r in plan["rows"]} <= {"keep", "recompute"}


def test_refuses_to_overwrite_without_the_flag(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("mine")
    status, stdout, stderr = _run(FACTORY, "--input", SHAPE, "--json", str(path), "--quiet")
    assert status == 2 and stdout == ""
    assert stderr.count("\n") == 1 and "--overwrite" in stderr
    assert path.read_text() == "mine"
    status, _, stderr = _run(FACTORY, "--input", SHAPE, "--json", str(path), "--overwrite",
                             "--quiet")
    assert status == 0, stderr
    assert json.loads(path.read_text())["plan"]["measured"] > 0


@pytest.mark.parametrize("args, text", [
    (["--budget", "0.001"], r"--budget 0.001: budget=0.001 \(\d+ bytes\) is out of reach: .*"
                            r"give budget >= \d+"),
    (["--budget", "0.01", "--allow", "offload"], r"allow=\('offload',\).*or allow more"),
    (["--device", "meta"], "plan counts on meta by itself"),
    (["--input", "4,1,16,16"], r"--input 4,1,16,16 does not fit"),
])
def test_user_errors_exit_2_with_one_line(args, text, capsys, tmp_path):
    path = tmp_path / "plan.json"
    status = main(["plan", FACTORY, "--input", SHAPE, *args, "--json", str(path), "--quiet"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.count("\n") == 1 and err.startswith("iabn plan: error: "), err
    assert re.search(text, err), err
    assert not path.exists()


@pytest.mark.parametrize("args, text", [
    (["--budget", "1.5"], "a fraction must be in"),
    (["--budget", "0"], "a fraction must be in"),
    (["--budget", "12furlongs"], "unknown unit 'furlongs'"),
    (["--budget", "half"], "expected a fraction in"),
    (["--allow", "inplace,swap"], "expected a comma-separated list"),
    (["--time-limit", "0"], "must be a positive number of seconds"),
    (["--policy", "fast"], "invalid choice: 'fast'"),
])
def test_bad_arguments_exit_2_before_anything_runs(args, text, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["plan", FACTORY, *args])
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("iabn plan: error: argument ")
    assert text in err


def test_unknown_model_exits_2(capsys):
    assert main(["plan", "no_such_model_xyz", "--input", SHAPE, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model 'no_such_model_xyz'" in err


def test_parse_budget():
    assert parse_budget("0.5") == 0.5 and parse_budget("1") == 1.0
    assert parse_budget("1000") == 1000 and isinstance(parse_budget("1000"), int)
    assert parse_budget("2MiB") == 2 * 2**20 and parse_budget("1.5 GiB") == 3 * 2**29
    assert parse_budget("3kB") == 3000
    for bad in ("-1", "0", "1.5", "nan", "inf", "0B", "x"):
        with pytest.raises(ValueError):
            parse_budget(bad)


def test_parse_allow():
    assert parse_allow("inplace, recompute,inplace") == ("inplace", "recompute")
    for bad in ("", ",", "swap", "inplace,all"):
        with pytest.raises(ValueError):
            parse_allow(bad)
