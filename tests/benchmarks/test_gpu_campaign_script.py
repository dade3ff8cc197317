"""benchmarks/gpu_campaign.py, the GPU campaign, proven on a CPU: its orchestration (a failing
part is recorded and the next one runs; resume skips what is done; the budget stops before a
part that does not fit and kills one that overruns, with every process it started; the bundle
holds the files), its summary (targets from the parts' files only, 'unmeasured' where a figure
is missing or not from a GPU), the GPU commands it will run (valid for their scripts) and
benchmarks/offload_pcie.py's byte count. Most parts are replaced by trivial commands through
the documented --part-command-override; host_overhead runs for real (its quickest CPU case)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shlex
import tarfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@functools.cache
def _load(name: str = "gpu_campaign"):
    return load_script(BENCHMARKS / f"{name}.py")


def _stub(code: str, *args: str) -> str:
    """A part command running ``code`` (no braces: the command is filled with str.format)."""
    return shlex.join(["{python}", "-c", code, *args])


COUNT = "import sys; open(sys.argv[1], 'a').write('x')"


def _count(out: Path, name: str) -> int:
    path = out / f"count_{name}"
    return len(path.read_text()) if path.exists() else 0


def _run(argv, capsys):
    code = _load().main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _state(out: Path) -> dict:
    return json.loads((out / "gpu_campaign_state.json").read_text())


@pytest.mark.slow
def test_failing_part_is_recorded_and_the_next_runs_into_the_bundle(tmp_path, capsys,
                                                                    monkeypatch):
    out, bundle = tmp_path / "campaign", tmp_path / "back" / "campaign.tar.gz"
    # parts are told where to write and measure the default backend, whatever the caller set
    monkeypatch.setenv("IABN_COMMIT_RESULTS", "1")
    monkeypatch.setenv("IABN_BACKEND", "triton")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "elsewhere"))
    env_json = ("import json, os, sys; env = os.environ; json.dump(dict(rows=[], "
                "commit=env.get('IABN_COMMIT_RESULTS'), backend=env.get('IABN_BACKEND'), "
                "path=env.get('PYTHONPATH')), open(sys.argv[1], 'w'))")
    code, printed, _ = _run([
        "--smoke", "--out", str(out), "--bundle", str(bundle),
        "--parts", "suite,slope_errors,host_overhead",
        "--part-command-override",
        "suite=" + _stub("print('boom in the suite'); raise SystemExit(3)"),
        "--part-command-override",
        "slope_errors=" + _stub(env_json, "{out}/slope_errors_cpu.json")], capsys)
    assert code == 1  # every part ran, one failed
    parts = _state(out)["parts"]
    assert parts["suite"]["status"] == "failed" and parts["suite"]["exit_status"] == 3
    assert "boom in the suite" in parts["suite"]["log_tail"]
    assert parts["slope_errors"]["status"] == "done" and parts["host_overhead"]["status"] == "done"
    seen = json.loads((out / "slope_errors_cpu.json").read_text())
    assert seen["commit"] is None and seen["backend"] is None
    assert seen["path"].split(os.pathsep)[0] == str(ROOT / "src")  # the tree, not an install
    # the real part's JSON (host_overhead's quickest CPU run) and the stub's carry the call's
    # machine record
    host = json.loads((out / "host_overhead_cpu.json").read_text())
    assert [row["shape"] for row in host["rows"]] == [[2, 8, 4, 4], [8, 64, 8, 8]]
    for report in (seen, host):
        block = report["campaign"]
        assert torch.__version__.startswith(block["machine"]["torch_version"])
        assert block["machine"]["date_utc"] and block["machine"]["commit"]
        assert set(block["parts"]) <= {"slope_errors", "host_overhead"}
    with tarfile.open(bundle) as tar:
        members = set(tar.getnames())
        state_in_bundle = tar.extractfile("gpu_campaign_state.json").read()
    assert {"gpu_campaign_state.json", "gpu_campaign_summary.md", "gpu_campaign_logs/suite.log",
            "gpu_campaign_logs/slope_errors.log", "slope_errors_cpu.json",
            "host_overhead_cpu.json"} <= members
    assert state_in_bundle == (out / "gpu_campaign_state.json").read_bytes()
    assert not list(bundle.parent.glob("*.partial"))
    # the short table comes last: parts, then targets, all unmeasured on a CPU
    assert printed.rstrip().endswith("finished; failed: suite")
    summary = (out / "gpu_campaign_summary.md").read_text()
    assert "CPU SMOKE RUN" in summary
    rows = [line for line in summary.splitlines() if line.startswith("| ") and "vs " in line]
    assert len(rows) == 16 and all(row.endswith("| unmeasured |") for row in rows)


def test_resume_skips_done_and_failed_parts_and_rerun_repeats(tmp_path, capsys):
    out = tmp_path / "campaign"
    argv = ["--smoke", "--out", str(out), "--parts", "suite,slopes",
            "--part-command-override", "suite=" + _stub(COUNT, "{out}/count_suite"),
            "--part-command-override",
            "slope_errors=" + _stub(COUNT + "; raise SystemExit(1)", "{out}/count_slope")]
    assert _run(argv, capsys)[0] == 1
    assert (_count(out, "suite"), _count(out, "slope")) == (1, 1)
    # an existing campaign is not started over unless asked: one line, nothing changed
    before = (out / "gpu_campaign_state.json").read_bytes()
    code, _, err = _run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "--resume" in err
    assert (out / "gpu_campaign_state.json").read_bytes() == before
    code, _, _ = _run([*argv, "--resume"], capsys)
    assert code == 1 and (_count(out, "suite"), _count(out, "slope")) == (1, 1)
    assert len(_state(out)["calls"]) == 2
    assert _run([*argv, "--resume", "--rerun", "--parts", "slope_errors"], capsys)[0] == 1
    assert (_count(out, "suite"), _count(out, "slope")) == (1, 2)
    assert _run([*argv, "--restart"], capsys)[0] == 1
    assert (_count(out, "suite"), _count(out, "slope")) == (2, 3)
    assert len(_state(out)["calls"]) == 1


def test_budget_stops_before_a_part_that_does_not_fit(tmp_path, capsys):
    out = tmp_path / "campaign"
    argv = ["--smoke", "--out", str(out), "--parts", "suite,slope_errors,host_overhead",
            "--budget-s", "5", "--reserve-s", "0",
            "--part-command-override", "*=" + _stub(COUNT, "{out}/count_any")]
    code, printed, _ = _run(argv, capsys)
    # the first part of a call always starts; the next expects its 30 s smoke allowance (the
    # count of parts run decides, not the wall clock, which load moves)
    assert code == 3 and _count(out, "any") == 1
    assert "slope_errors expects ~30 s" in printed
    assert "Continue: python3 benchmarks/gpu_campaign.py --resume --smoke" in printed
    parts = _state(out)["parts"]
    assert parts["suite"]["status"] == "done" and "slope_errors" not in parts
    # the next call goes on from there
    code, _, _ = _run([*argv, "--resume", "--budget-s", "100"], capsys)
    assert code == 0 and _count(out, "any") == 3


SLEEPER = ("import subprocess, sys, time; "
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
           "open(sys.argv[1], 'w').write(str(child.pid)); time.sleep(60)")


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie is dead, only not yet reaped


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
@pytest.mark.slow
def test_a_part_overrunning_the_budget_is_stopped_with_what_it_started(tmp_path, capsys):
    out = tmp_path / "campaign"
    # started after another part, it is interrupted and runs first in the next call
    argv = ["--smoke", "--out", str(out), "--parts", "suite,slope_errors", "--budget-s", "3",
            "--reserve-s", "0", "--expect-s", "slope_errors=1",
            "--part-command-override", "suite=" + _stub("pass"),
            "--part-command-override", "slope_errors=" + _stub(SLEEPER, "{out}/grandchild")]
    code, printed, _ = _run(argv, capsys)
    # stopped, not waited for: its status and its killed process group say so (the sleeper
    # would run 60 s), whatever the machine's load does to the wall clock
    assert code == 3
    assert "slope_errors was stopped after" in printed
    entry = _state(out)["parts"]["slope_errors"]
    assert entry["status"] == "interrupted" and entry["attempts"] == 1
    # the part's whole process group went, the process it started too
    grandchild = int((out / "grandchild").read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)
    # first in the next call it has the whole budget; stopped again, it is failed
    (out / "grandchild").unlink()
    code, printed, _ = _run([*argv, "--resume"], capsys)
    entry = _state(out)["parts"]["slope_errors"]
    assert code == 1 and entry["status"] == "failed" and entry["attempts"] == 2
    assert "first part of the call" in entry["reason"] and "=== stopped" in entry["log_tail"]
    assert (out / "grandchild").exists()  # it did run again
    # not run again unless asked
    (out / "grandchild").unlink()
    assert _run([*argv, "--resume"], capsys)[0] == 1 and not (out / "grandchild").exists()


@pytest.mark.parametrize("argv", [
    ["--parts", "nosuch"], ["--budget-s", "0"], ["--budget-s", "10", "--reserve-s", "10"],
    ["--commit", "not-a-hash"], ["--bundle", "campaign.zip"],
    ["--part-command-override", "suite"], ["--resume", "--restart"], ["--expect-s", "suite"],
    ["--expect-s", "suite=-1"], ["--bogus"], ["--budget-s", "soon"],
])
def test_usage_errors_exit_2_with_one_line_and_write_nothing(tmp_path, argv, capsys):
    out = tmp_path / "campaign"
    code, _, err = _run(["--smoke", "--out", str(out), *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("gpu_campaign: error:")
    assert not out.exists()


def test_smoke_never_writes_the_committed_results(capsys):
    code, _, err = _run(["--smoke", "--out", str(BENCHMARKS / "results" / "x")], capsys)
    assert code == 2 and "benchmarks/results" in err


def test_gpu_campaign_refuses_a_machine_without_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = _run(["--out", str(tmp_path / "c")], capsys)
    assert code == 2 and "no CUDA device" in err and not (tmp_path / "c").exists()


def test_gpu_campaign_is_tied_to_one_device_and_commits_only_when_asked(tmp_path, monkeypatch,
                                                                         capsys):
    """The GPU run (its machine record faked: no GPU here) writes by default where the
    committed results are only with IABN_COMMIT_RESULTS=1, and a campaign measured on one
    device is not continued on another."""
    campaign = _load()
    monkeypatch.delenv("IABN_COMMIT_RESULTS", raising=False)
    assert campaign.parse_args([]).out == (Path("runs") / "benchmarks" / "campaign").resolve()
    monkeypatch.setenv("IABN_COMMIT_RESULTS", "1")
    assert campaign.parse_args([]).out == (BENCHMARKS / "results").resolve()
    device = {"name": "test GPU A"}
    monkeypatch.setattr(campaign, "machine", lambda smoke, commit: {
        "device_name": device["name"], "cuda_available": True, "commit": commit})
    out = tmp_path / "campaign"
    argv = ["--out", str(out), "--resume", "--parts", "suite", "--commit", "abc1234",
            "--part-command-override", "*=" + _stub("pass")]
    code, printed, _ = _run(argv, capsys)
    assert code == 0 and "test GPU A" in printed
    state = _state(out)
    assert state["smoke"] is False and state["parts"]["suite"]["status"] == "done"
    assert state["calls"][0]["machine"]["commit"] == "abc1234"
    device["name"] = "test GPU B"
    code, _, err = _run(argv, capsys)
    assert code == 2 and "test GPU A" in err and "--out" in err
    assert len(_state(out)["calls"]) == 1
    # nor is a CPU rehearsal mixed into it
    code, _, err = _run([*argv, "--smoke"], capsys)
    assert code == 2 and "a GPU campaign" in err


def test_commit_comes_from_git_or_the_command_line(tmp_path, monkeypatch):
    campaign = _load()
    monkeypatch.setattr(campaign, "ROOT", tmp_path)  # a copy of the tree without .git
    assert campaign.machine(True, "abc1234")["commit"] == "abc1234"
    assert campaign.machine(True, None)["commit"] == "unknown"
    # a stale .git beside the tree (the device machine's copy) does not override the hash given
    (tmp_path / ".git").mkdir()
    monkeypatch.setattr(campaign, "_output", lambda command, timeout=60: "f" * 40)
    record = campaign.machine(True, "abc1234")
    assert (record["commit"], record["git_head"]) == ("abc1234", "f" * 40)
    assert campaign.machine(True, "fffffff")["commit_source"] == "git"


def test_atomic_write_leaves_the_old_file_and_no_temporary_on_failure(tmp_path, monkeypatch):
    campaign = _load()
    path = tmp_path / "state.json"
    path.write_text("old")

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(campaign.os, "replace", broken_replace)
    with pytest.raises(OSError):
        campaign.write_atomic(path, b"new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == [
        "state.json"]


# --- the summary, from files made here (test data, not measurements) ---------------------------

GPU = {"device_name": "test data (not a measurement)", "device_type": "cuda"}
#: The brief's whole-network cells: (mode, model, batch, dtype, layout).
BRIEF_CELLS = {(mode, model, batch, dtype, layout)
               for mode in ("eager", "compile", "reduce_overhead")
               for model, batch, layouts in (("resnet50", 64, ("channels_last", "nchw")),
                                             ("resnext101", 32, ("channels_last",)),
                                             ("wider_resnet38_a2", 16, ("channels_last",)))
               for dtype in ("float32", "bfloat16") for layout in layouts}


def _network(step=0.9, peak=0.5, batch=2.1, budget=12):
    cells = []
    for mode, model, size, dtype, layout in sorted(BRIEF_CELLS):
        ratios = {"step_time": step, "peak_step": peak, "largest_batch_peak": batch}
        cells.append({"model": model, "batch": size, "image_size": 224, "dtype": dtype,
                      "layout": layout, "mode": mode,
                      "providers": {p: {"ms": 1.0} for p in ("bn", "iabn", "iabn_triton")},
                      "ratio_to_bn": {p: dict(ratios) for p in ("bn", "iabn", "iabn_triton")}})
    return {"benchmark": "network_step", "device": "cuda", "machine": dict(GPU),
            "settings": {"budget_gib": budget}, "cells": cells}


def _verdicts(targets) -> dict:
    return {(t.what.split(" vs")[0], t.provider): t.verdict() for t in targets}


def _cell(report, mode, model, dtype="float32", layout="channels_last"):
    return next(c for c in report["cells"] if (c["mode"], c["model"], c["dtype"],
                                                c["layout"]) == (mode, model, dtype, layout))


def test_network_targets_met_missed_and_unmeasured():
    campaign = _load()
    everything = set(_verdicts(campaign.network_targets(_network(), _network())).values())
    assert everything == {"met"}
    # eager steps: 1.0x is the target (0.95x the goal); 1.01x misses every step target
    assert set(_verdicts(campaign.network_targets(_network(step=0.99), _network())).values()) \
        == {"met"}
    verdicts = _verdicts(campaign.network_targets(_network(step=1.01), _network()))
    assert {k[0] for k, v in verdicts.items() if v == "missed"} == {
        "whole-network eager step", "compiled step", "reduce-overhead step"}
    # peak: ResNet-50 within 0.70x, the deeper two within 0.55x
    verdicts = _verdicts(campaign.network_targets(_network(peak=0.6), _network()))
    assert verdicts[("peak step memory", "iabn (default)")] == "missed"
    assert verdicts[("peak step memory", "iabn Triton")] == "missed"
    report = _network()
    _cell(report, "eager", "resnet50")["ratio_to_bn"]["iabn"]["peak_step"] = 0.71
    verdicts = {(t.what, t.provider): t.verdict()
                for t in campaign.network_targets(report, _network())}
    assert verdicts[("peak step memory vs BN, ResNet-50", "iabn (default)")] == "missed"
    assert verdicts[("peak step memory vs BN, ResNet-50", "iabn Triton")] == "met"
    report = _network()
    _cell(report, "eager", "resnext101")["ratio_to_bn"]["iabn"]["step_time"] = 1.02
    report["cells"].remove(_cell(report, "compile", "wider_resnet38_a2", "bfloat16"))
    _cell(report, "reduce_overhead", "resnet50", layout="nchw")["providers"]["iabn_triton"] = {
        "error": "RuntimeError: cudagraphs"}
    verdicts = _verdicts(campaign.network_targets(report, _network()))
    assert verdicts[("whole-network eager step", "iabn (default)")] == "missed"
    assert verdicts[("whole-network eager step", "iabn Triton")] == "met"
    assert verdicts[("compiled step", "iabn (default)")] == "unmeasured"  # 7 of 8 cells
    assert verdicts[("reduce-overhead step", "iabn Triton")] == "missed"  # it must run
    assert verdicts[("reduce-overhead step", "iabn (default)")] == "met"
    # the largest batch comes from the search's own file, measured in 12 GiB
    for batch_report in (None, _network(budget=16)):
        verdicts = _verdicts(campaign.network_targets(_network(), batch_report))
        assert verdicts[("largest batch in 12 GiB", "iabn (default)")] == "unmeasured"
    assert _verdicts(campaign.network_targets(_network(), _network(batch=1.9)))[
        ("largest batch in 12 GiB", "iabn (default)")] == "missed"
    # a CPU run or no file at all: nothing is measured, nothing is estimated
    cpu = _network()
    cpu["machine"] = {"device_name": "cpu (not a GPU figure)"}
    for report in (cpu, None):
        targets = campaign.network_targets(report, report)
        assert {t.verdict() for t in targets} == {"unmeasured"}
        assert {t.value_text() for t in targets} == {"unmeasured"}


def test_tests_target_reads_the_cuda_log(tmp_path):
    campaign = _load()
    log = tmp_path / "gpu_tests_cuda.log"

    def verdict(text, smoke=False):
        log.write_text(text)
        target = campaign.tests_target(log, smoke)
        return target.verdict(), target.value_text()

    assert verdict("...\n==== 233 passed, 12 skipped in 95.1s ====\nexit code: 0\n") == (
        "met", "233")
    assert verdict("==== 3 failed, 230 passed in 95.1s ====\nexit code: 1\n")[0] == "missed"
    assert verdict("==== 1 error, 230 passed in 95.1s ====\n")[0] == "missed"
    # stopped at its cap: what ran passed, but not everything ran
    capped = "!!! KeyboardInterrupt !!!\n==== 120 passed in 140.0s ====\n"
    assert verdict(capped) == ("missed", "1 failed")
    assert verdict("Traceback: ImportError\n") == ("missed", "1 failed")
    assert verdict("==== 233 passed in 9.1s ====\n", smoke=True)[0] == "unmeasured"
    log.unlink()
    assert campaign.tests_target(log, False).verdict() == "unmeasured"


def test_layer_and_offload_targets(tmp_path):
    campaign = _load()
    rows = [{"shape": "32x256x56x56", "dtype": dtype, "layout": layout, "provider": provider,
             "mode": "full", "fraction_of_copy": fraction, "median_ms": 1.0}
            for dtype in ("float32", "bfloat16") for layout in ("nchw", "channels_last")
            for provider, fraction in (("reference", 0.4), ("triton", 0.7))]
    speed = {"machine": dict(GPU), "rows": rows}
    assert _verdicts(campaign.layer_targets(speed)) == {
        ("layer fwd+bwd 32x256x56x56", "iabn (default)"): "missed",
        ("layer fwd+bwd 32x256x56x56", "iabn Triton"): "met"}
    speed["rows"] = [r for r in rows if r["layout"] == "channels_last"]
    assert _verdicts(campaign.layer_targets(speed))[
        ("layer fwd+bwd 32x256x56x56", "iabn Triton")] == "met"  # channels-last is the target
    speed["rows"] = [r for r in rows if r["provider"] == "reference"]
    assert _verdicts(campaign.layer_targets(speed))[
        ("layer fwd+bwd 32x256x56x56", "iabn Triton")] == "unmeasured"
    # the verdict's layer part comes first, the full table fills what it lacks
    layer = {"machine": dict(GPU), "rows": [dict(r, fraction_of_copy=0.3) for r in rows
                                            if r["provider"] == "triton"]}
    assert _verdicts(campaign.layer_targets(layer, {"machine": dict(GPU), "rows": rows}))[
        ("layer fwd+bwd 32x256x56x56", "iabn Triton")] == "missed"
    assert _verdicts(campaign.layer_targets(layer, {"machine": dict(GPU), "rows": rows}))[
        ("layer fwd+bwd 32x256x56x56", "iabn (default)")] == "missed"

    pareto = {"machine": dict(GPU), "args": {"batch": 32, "size": 128},
              "rows": [{"model": "vgg19", "norm_act": "bn", "results": {
                  "eager": {"ms": 100.0, "peak_mib": 1000.0},
                  "offload_all": {"ms": 130.0, "peak_mib": 500.0}}}]}
    pcie = {"machine": dict(GPU), "batch": 32, "size": 128, "copy_ms": 125.0,
            "transferred_bytes": 2**30, "d2h_gbps": 20.0, "h2d_gbps": 20.0}
    target, facts = campaign.offload_target(pareto, pcie)
    assert target.verdict() == "met" and facts["bound_ms"] == 125.0  # 130 / 125 = 1.04
    assert target.cells[0][1] == pytest.approx(130.0 / 125.0)
    pcie["copy_ms"] = 50.0  # the eager step is the bound: 130 / 100
    assert campaign.offload_target(pareto, pcie)[0].verdict() == "missed"
    pareto["rows"][0]["results"]["offload_all"]["ms"] = 105.0  # 105 / 100
    target, facts = campaign.offload_target(pareto, pcie)
    assert target.verdict() == "met" and facts["bound_ms"] == 100.0
    assert campaign.offload_target(pareto, None)[0].verdict() == "unmeasured"
    pcie["batch"] = 2  # another setting than the timed step
    assert campaign.offload_target(pareto, pcie)[0].verdict() == "unmeasured"

    # the summary file reads the same targets from the files in the folder
    out = tmp_path / "campaign"
    out.mkdir()
    names = campaign.files(False)
    (out / names["network"]).write_text(json.dumps(_network()))
    (out / names["speed"]).write_text(json.dumps({"machine": dict(GPU), "rows": rows}))
    state = {"smoke": False, "parts": {}, "calls": []}
    markdown, short = campaign.summarize(out, state, campaign.plan(False))
    verdicts = [line.rsplit("|", 2)[-2].strip() for line in markdown.splitlines()
                if line.startswith("| ") and " vs " in line and line.count("|") == 7]
    # the network targets (largest batch unmeasured: no search file), layer, offload, plan
    assert verdicts == (["met"] * 10 + ["unmeasured"] * 2
                        + ["missed", "met", "unmeasured", "unmeasured"])
    assert "unmeasured" in short.splitlines()[-2]  # the offload target
    assert short.splitlines()[-1].startswith("plan at 1/3 of") and "unmeasured" in short
    pareto["rows"][0]["results"]["save_on_cpu"] = {"ms": 300.0, "peak_mib": None}
    pareto["rows"][0]["failed"] = {"compile_0.5": "RuntimeError: Inductor"}
    (out / names["pareto"]).write_text(json.dumps(pareto))
    (out / names["pcie"]).write_text(json.dumps({**pcie, "batch": 32}))
    markdown, short = campaign.summarize(out, state, campaign.plan(False))
    assert short.splitlines()[-2].endswith(" met")  # 105 ms against the 100 ms eager bound
    assert "| save_on_cpu | 300.0 | 3.00x | - | - |" in markdown
    assert "| compile_0.5 | failed: RuntimeError: Inductor |" in markdown
    (out / names["plan"]).write_text(json.dumps(_plan_report()))
    markdown, short = campaign.summarize(out, state, campaign.plan(False))
    assert short.splitlines()[-1].endswith(" met")
    assert "| plan_0.3333 | 0.320 | 1.080x | 1.070x | 5120 |" in markdown
    assert "| eager | 1.000 | 1.000x | - | 9216 |" in markdown


def _plan_report(ratio=0.32, step=1.08, batch=64, size=224, machine=GPU):
    rows = {"eager": {"bytes": 100, "ratio": 1.0, "step_ratio": 1.0,
                      "peak_step_bytes": 9 * 2**30},
            "plan_0.3333": {"bytes": 32, "ratio": ratio, "step_ratio": step,
                            "predicted_overhead": 0.07, "peak_step_bytes": 5 * 2**30}}
    return {"machine": dict(machine), "args": {"batch": batch, "size": size},
            "results": [{"model": "resnet50", "rows": rows}]}


def test_plan_target_met_missed_and_unmeasured():
    """The plan target reads plan_anchors.py's GPU run of ResNet-50 b64 at 224 x 224: the
    plan's step over the model's as given, a plan above a third of the bytes or none at all
    a miss, anything else (a CPU run, another setting, no file) unmeasured."""
    campaign = _load()

    def verdict(report):
        target, _ = campaign.plan_target(report)
        return target.verdict(), target.value_text()

    assert verdict(_plan_report()) == ("met", "1.080x")
    assert verdict(_plan_report(step=1.12)) == ("missed", "1.120x")
    assert verdict(_plan_report(ratio=0.34)) == ("missed", "1 failed")
    out_of_reach = _plan_report()
    out_of_reach["results"][0]["rows"]["plan_0.3333"] = {"out_of_reach": "too small"}
    assert verdict(out_of_reach)[0] == "missed"
    for report in (_plan_report(machine={"device_name": "cpu (not a GPU figure)"}),
                   _plan_report(batch=2), _plan_report(size=32), None, {}):
        assert verdict(report) == ("unmeasured", "unmeasured")


# --- the GPU commands are valid for the scripts they call --------------------------------------


def _cpu(argv):
    return [("cpu" if a == "cuda" and argv[i - 1] == "--device" else a)
            for i, a in enumerate(argv)]


def test_gpu_commands_are_valid_and_cover_the_brief(monkeypatch):
    campaign = _load()
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # memory_time_pareto imports its neighbour
    network_step, gpu_speed = _load("network_step"), _load("gpu_speed")
    slope_errors, offload_pcie = _load("slope_errors"), _load("offload_pcie")
    pareto, plan_anchors = _load("memory_time_pareto"), _load("plan_anchors")
    parts = campaign.plan(False)
    cells = set()
    for part in parts:
        script, argv = Path(part.argv[0]).name, list(part.argv[1:])
        assert (ROOT / part.argv[0]).is_file()
        if part.group == "network":
            args = network_step.parse_args(_cpu(argv))
            assert args.budget_gib == 12 and args.resume and "iabn" in args.providers
            assert args.no_peak_search and args.profile and args.repeats >= 20
            assert argv[argv.index("--providers") + 1] == "bn,iabn,iabn_triton"
            cells |= {(mode, model, args.batch, dtype, layout) for mode in args.modes
                      for model in args.models for dtype in args.dtypes
                      for layout in args.layouts}
        elif part.group == "batch":
            args = network_step.parse_args(_cpu(argv))
            assert args.budget_gib == 12 and not args.no_peak_search and args.modes == ["eager"]
            assert args.models[0] in campaign.BATCH_MODELS and args.json.name.startswith(
                "network_batch")
        elif part.name == "layer":
            args = gpu_speed.parse_args(_cpu(argv))
            assert args.shapes == [(32, 256, 56, 56)] and args.layouts == ["channels_last"]
            assert args.providers == ["eager", "reference", "triton"] and args.profile
            assert args.dtypes == [torch.float32, torch.bfloat16]
        elif script == "gpu_speed.py":
            assert gpu_speed.parse_args(_cpu(argv)).providers
        elif script == "slope_errors.py":
            assert slope_errors._parse(_cpu(argv)).device == "cpu"
        elif script == "offload_pcie.py":
            args = offload_pcie.parse_args(_cpu(argv))
            assert (args.model, args.batch, args.size) == ("vgg19:bn", 32, 128)
        elif script == "memory_time_pareto.py":
            strategies = argv[argv.index("--strategies") + 1].split(",")
            assert strategies == ["eager", "offload_all", "save_on_cpu", "compile_0.5"]
            assert set(strategies) <= set(pareto.STRATEGIES)
            assert argv[argv.index("--models") + 1] == "vgg19:bn"
            assert argv[argv.index("--batch") + 1] == "32"
        elif script == "plan_anchors.py":
            args = plan_anchors.parse_args(_cpu(argv))
            assert (args.models, args.batch, args.size) == (["resnet50"], 64, 224)
            assert args.plan_budgets == (campaign.PLAN_BUDGET,) and args.compile_budgets == ()
            assert args.anchor_plans and argv[argv.index("--device") + 1] == "cuda"
        elif part.name == "gpu_tests":
            assert argv[1].endswith("gpu_tests_cuda.log")
            assert argv[argv.index("-m") + 1] == "gpu" and "--maxfail=20" in argv
            assert argv[argv.index("-n") + 1] == "8"
        elif script == "suite_log.py":
            assert argv[1].endswith("suite_cuda.log")
            assert argv[-4:] == ["-n", "8", "-m", "slow or not slow"]  # the slow tests too
    assert cells == BRIEF_CELLS
    assert sum(p.group == "network" for p in parts) == len(BRIEF_CELLS)  # one cell a part


@pytest.mark.parametrize("smoke", [False, True], ids=["gpu", "smoke"])
def test_the_first_call_gives_the_verdict_first_and_fits_its_budget(smoke):
    """Ordered by value: CUDA tests, the layer, ResNet-50 eager bf16 and fp32, then its compiled
    bf16 step; the CPU rehearsal runs the same parts in the same order; on a GPU the verdict's
    caps bound the first call within 480 s."""
    campaign = _load()
    parts = campaign.plan(smoke)
    names = [p.name for p in parts]
    assert names[:5] == ["gpu_tests", "layer", "net_eager_r50_bf16_cl", "net_eager_r50_fp32_cl",
                         "net_compile_r50_bf16_cl"]
    assert names == [p.name for p in campaign.plan(not smoke)]
    assert len(set(names)) == len(names)
    assert names.index("suite") > names.index("net_eager_wrn38_bf16_cl")
    if smoke:
        return
    verdict = [p for p in parts if p.name in campaign.VERDICT]
    assert [p.name for p in verdict] == names[:4]
    assert all(p.cap_s is not None and p.expect_s == p.cap_s + campaign.CAP_GRACE_S
               for p in verdict)
    assert campaign.first_call_seconds(parts) <= campaign.FIRST_CALL_BUDGET_S == 480
    # the gpu tests stop at about 150 s, as planned
    assert 120 <= parts[0].cap_s <= 150


@pytest.mark.slow  # 6 s on 2 cores: a child that runs until its cap stops it
def test_a_part_is_stopped_at_its_own_cap_with_its_report(tmp_path, capsys, monkeypatch):
    """A capped part gets SIGINT first (pytest then prints its failures; here a script that
    reports on KeyboardInterrupt), is recorded failed with the reason, and the next part runs."""
    campaign = _load()
    # a cap of 5 s: the child must be past Python's start-up (-S: without site, shorter) and
    # in its try block when SIGINT comes; with 2 s it failed once on a loaded 2-core machine
    # (the whole suite on 2 workers) and passed alone
    capped = dataclasses.replace(
        next(p for p in campaign.plan(True) if p.name == "gpu_tests"), cap_s=5.0,
        argv=("--override--", "{python}", "-S", "-c",
              "import time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n"
              "    print('reported on SIGINT', flush=True)\n    raise SystemExit(2)"))
    out = tmp_path / "campaign"
    entry = campaign.run_part(capped, out, None, 1, {"device_name": "cpu"})
    # stopped by the cap (SIGINT reported, exit 2), not by the child's own 30 s end (exit 0)
    assert entry["status"] == "failed" and entry["capped"] and "cap of 5 s" in entry["reason"]
    assert "reported on SIGINT" in entry["log_tail"] and entry["exit_status"] == 2
    # the budget's limit, when shorter, stops it as interrupted instead
    entry = campaign.run_part(capped, out, 1.0, 1, {"device_name": "cpu"})
    assert entry["status"] == "interrupted" and "capped" not in entry


# --- benchmarks/offload_pcie.py ----------------------------------------------------------------


@pytest.mark.without_gpu  # with CUDA visible the offloader leaves CPU tensors where they are
def test_offload_pcie_counts_the_conv_and_pool_inputs(tmp_path):
    """The bytes OffloadModel transfers equal an independent count: the distinct storages of
    the inputs of every convolution and pooling layer (kept alive, so none is reused) of at
    least the offloader's 64 KiB."""
    offload_pcie = _load("offload_pcie")
    out = tmp_path / "pcie.json"
    assert offload_pcie.main(["--device", "cpu", "--model", "resnet18:bn", "--batch", "2",
                              "--size", "64", "--copy-mib", "4", "--repeats", "2", "--json",
                              str(out)]) == 0
    report = json.loads(out.read_text())
    torch.manual_seed(0)
    model = offload_pcie.create("resnet18", norm_act="bn")
    inputs = []
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.MaxPool2d, nn.AvgPool2d)):
            module.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    model(torch.randn(2, 3, 64, 64))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in inputs}
    expected = sum(n for n in storages.values() if n >= 64 * 1024)
    assert expected > 0 and report["offloaded_bytes"] == expected
    assert report["transferred_bytes"] == expected  # no compression
    assert report["copy_ms"] == pytest.approx(
        expected / (report["d2h_gbps"] * 1e9) * 1e3 + expected / (report["h2d_gbps"] * 1e9) * 1e3)
    assert report["machine"]["device_name"].startswith("cpu")


@pytest.mark.parametrize("argv", [
    ["--model", "vgg19"], ["--model", "nope:bn"], ["--batch", "1"], ["--repeats", "0"],
    ["--device", "tpu"],
])
def test_offload_pcie_usage_errors(tmp_path, argv, capsys):
    offload_pcie = _load("offload_pcie")
    out = tmp_path / "x.json"
    assert offload_pcie.main(["--device", "cpu", *argv, "--json", str(out)]) == 2
    assert not out.exists()
    assert capsys.readouterr().err.startswith("offload_pcie: error:")
