"""`stratagem plan` and `stratagem estimate` through the real CLI: output, --fix, --top, --time-limit, -o,
determinism, and user errors (exit 2, one line, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli.main import main
from planner.plan import Plan

TINY = ["gpt", "--set", "layers=4", "--set", "hidden=256", "--set", "heads=8", "--set", "vocab=1000",
        "--set", "seq=128"]
PLAN = ["plan", *TINY, "--cluster", "1x8xa100-80gb", "--batch", "32"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    code, out, err = run_cli(capsys, *PLAN, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_plan_prints_mesh_stages_and_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *PLAN, "--fix", "pp=2", "--fix", "tp=2")
    assert code == 0, err
    assert "mesh: tp=2 (node) x dp=2 (node) x pp=2 (node)  = 8 devices" in out
    assert "stages:" in out and "memory / capacity" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("      ")]
    assert [r[0] for r in rows] == ["0", "1"]            # one row per pipeline stage
    assert all(r[2] == "4" for r in rows)                # tp * dp devices per stage
    for key in ("step time:", "tokens/s", "TFLOP/s per device", "MFU", "breakdown: compute", "search: optimal"):
        assert key in out
    assert err == ""                                     # stderr is not a terminal: no progress line


def test_plan_json_keys_and_estimate_agree(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys)
    s, p = plan["strategy"], plan["predicted"]
    for key in ("dp", "tp", "pp", "microbatch_size", "num_microbatches", "schedule", "zero_stage", "stages"):
        assert key in s
    assert s["dp"] * s["tp"] * s["pp"] * s["cp"] <= 8
    assert s["dp"] * s["microbatch_size"] * s["num_microbatches"] == 32
    assert p["fits"] and len(p["peak_memory_bytes"]) == s["pp"]
    # Proven within the default 1% gap (no tie here); --gap 0 proves the same plan optimal.
    assert plan["search"]["status"] == "optimal" and plan["search"]["optimality_gap"] <= 0.01 / 1.01
    exact = plan_json(capsys, "--gap", "0")
    assert exact["search"]["optimality_gap"] == 0.0 and exact["strategy"] == s
    assert exact["search"]["candidates"] >= plan["search"]["candidates"]
    # `stratagem estimate` of the same degrees on one stage per rank prices the same strategy when pp == 1.
    fixed = plan_json(capsys, "--fix", "pp=1", "--fix", "recompute=none")
    fs = fixed["strategy"]
    sched = fs["schedule"]
    code, out, err = run_cli(capsys, "estimate", *TINY, "--cluster", "1x8xa100-80gb", "--batch", "32",
                             "--dp", str(fs["dp"]), "--tp", str(fs["tp"]), "--pp", "1", "--cp", str(fs["cp"]),
                             "--ep", str(fs["ep"]), "--mbs",
                             str(fs["microbatch_size"]), "--schedule", sched, "--zero", str(fs["zero_stage"]),
                             *(["--sp"] if fs["sequence_parallel"] else []), "--json")
    assert code == 0, err
    est = json.loads(out)
    assert est["predicted"]["step_time_s"] == pytest.approx(fixed["predicted"]["step_time_s"], rel=1e-9)
    assert est["search"]["status"] == "fixed"


def test_estimate_prices_context_parallelism_as_the_search_does(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("gpt-tiny", "--set", "seq=2048", "--cluster", "1x4xcpu", "--batch", "4")
    code, out, err = run_cli(capsys, "plan", *args, "--fix", "cp=2", "--fix", "pp=1", "--fix", "tp=1",
                             "--fix", "recompute=none", "--fix", "zero=0", "--fix", "mbs=1", "--json")
    assert code == 0, err
    fixed = json.loads(out)
    assert (fixed["strategy"]["cp"], fixed["strategy"]["dp"]) == (2, 2)
    code, out, err = run_cli(capsys, "estimate", *args, "--tp", "1", "--pp", "1", "--dp", "2", "--cp", "2",
                             "--mbs", "1", "--schedule", fixed["strategy"]["schedule"], "--json")
    assert code == 0, err
    est = json.loads(out)
    assert est["strategy"]["cp"] == 2
    assert est["predicted"]["step_time_s"] == pytest.approx(fixed["predicted"]["step_time_s"], rel=1e-9)


def test_fix_pins_every_kind_of_dimension(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--fix", "tp=2", "--fix", "pp=2", "--fix", "recompute=full", "--fix", "zero=1",
                     "--fix", "mbs=2", "--fix", "sp=true", "--fix", "schedule=1f1b")
    s = plan["strategy"]
    assert (s["tp"], s["pp"], s["zero_stage"], s["microbatch_size"], s["sequence_parallel"], s["schedule"]) == (
        2, 2, 1, 2, True, "1f1b")
    assert {st["recompute"] for st in s["stages"]} == {"full"}
    plan = plan_json(capsys, "--fix", "schedule=interleaved:2", "--fix", "pp=2")
    assert (plan["strategy"]["schedule"], plan["strategy"]["virtual_stages"]) == ("interleaved", 2)
    assert len(plan["strategy"]["stages"]) == 4


def test_top_k_returns_distinct_strategies_best_first(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *PLAN, "--top", "3", "--json")
    assert code == 0, err
    plans = json.loads(out)
    assert isinstance(plans, list) and len(plans) == 3
    times = [p["predicted"]["step_time_s"] for p in plans]
    assert times == sorted(times)
    keys = {json.dumps({k: v for k, v in p["strategy"].items() if k not in ("stages", "sharding")}, sort_keys=True)
            for p in plans}
    assert len(keys) == 3
    code, out, _ = run_cli(capsys, *PLAN, "--top", "2")
    assert "=== #1 of 2 ===" in out and "=== #2 of 2 ===" in out


def test_time_limit_returns_best_so_far(capsys: pytest.CaptureFixture[str]) -> None:
    full = plan_json(capsys)
    cut = plan_json(capsys, "--time-limit", "0.000001")
    assert cut["search"]["status"] == "feasible"
    assert cut["predicted"]["fits"]
    assert cut["predicted"]["step_time_s"] >= full["predicted"]["step_time_s"] * (1 - 1e-12)
    assert 0 <= cut["search"]["optimality_gap"] < 1
    code, out, _ = run_cli(capsys, *PLAN, "--time-limit", "0.000001")
    assert "cut short by --time-limit" in out


def test_output_file_round_trips_and_never_overwrites_inputs(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    out_file = tmp_path / "plan.json"
    code, _, err = run_cli(capsys, *PLAN, "-o", str(out_file))
    assert code == 0, err
    plan = Plan.from_json(out_file.read_text())
    assert plan.search.status == "optimal"
    cluster = tmp_path / "c.yaml"
    cluster.write_text("groups:\n  - device: a100-80gb\n    num_nodes: 1\n    devices_per_node: 8\n")
    before = cluster.read_text()
    code, _, err = run_cli(capsys, "plan", *TINY, "--cluster", str(cluster), "--batch", "32", "-o", str(cluster))
    assert code == 2 and "is an input file of this command; refusing to overwrite it" in err
    assert cluster.read_text() == before
    code, _, err = run_cli(capsys, *PLAN, "-o", str(tmp_path / "missing" / "plan.json"))
    assert code == 2 and "does not exist" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--fix", "tpp=2"], "unknown key 'tpp'; valid: dp, tp, pp"),
    (["--fix", "tp=3"], "no valid strategy: tp=3 does not divide the 8 devices per node"),
    (["--fix", "tp=8", "--fix", "pp=2"], "no strategy matches: pinned: tp=8, pp=2; 8 devices"),
    (["--fix", "dp=3"], "no valid strategy: dp=3 does not divide the global batch 32"),
    (["--fix", "pp=7"], "no valid strategy: pp=7 is more than the 6 segments"),
    (["--top", "0"], "expected a positive integer"),
    (["--time-limit", "-1"], "expected a number of seconds >= 0 (0: no limit), got -1"),
    (["--objective", "cost"], "--objective cost needs a price for every device"),
])
def test_plan_user_errors(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, *PLAN, *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--tp", "3", "--pp", "1", "--dp", "1", "--mbs", "1"], "tp=3 does not divide heads=8"),
    (["--tp", "2", "--pp", "1", "--dp", "3", "--mbs", "1"], "--batch 32 is not a multiple of dp*mbs = 3*1 = 3"),
    (["--tp", "4", "--pp", "2", "--dp", "2", "--mbs", "1"], "16 devices, the cluster has 8 available"),
    (["--tp", "1", "--pp", "1", "--dp", "1", "--mbs", "1", "--sp"], "sequence parallelism needs tp > 1"),
    (["--tp", "1", "--pp", "2", "--dp", "1", "--mbs", "1", "--schedule", "interleaved"], "interleaved needs :V"),
    (["--tp", "1", "--pp", "1", "--dp", "1", "--mbs", "1", "--schedule", "interleaved:2"],
     "the interleaved schedule needs pp > 1"),
    (["--tp", "1", "--pp", "3", "--dp", "1", "--mbs", "2", "--schedule", "interleaved:2"],
     "needs the number of micro-batches (16) to be a multiple of pp (3)"),
    (["--tp", "1", "--pp", "4", "--dp", "1", "--mbs", "2", "--schedule", "interleaved:2"],
     "pp*virtual_stages = 8 is more than the 6 segments"),
])
def test_estimate_says_why_a_strategy_is_invalid(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 message: str) -> None:
    code, _, err = run_cli(capsys, "estimate", *TINY, "--cluster", "1x8xa100-80gb", "--batch", "32", *argv)
    assert code == 2, err
    assert message in err and "Traceback" not in err


def test_estimate_reports_a_strategy_that_does_not_fit(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cluster = tmp_path / "small.yaml"
    cluster.write_text("groups:\n  - device: a100-80gb\n    num_nodes: 1\n    devices_per_node: 8\n"
                       "    memory: 1GB\n")
    code, out, err = run_cli(capsys, "estimate", *TINY, "--cluster", str(cluster), "--batch", "32", "--tp", "1",
                             "--pp", "1", "--dp", "1", "--mbs", "32", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert not plan["predicted"]["fits"]
    assert any("GiB >" in p for p in plan["predicted"]["problems"])


def test_nothing_fits_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("groups:\n  - device: a100-80gb\n    num_nodes: 1\n    devices_per_node: 2\n"
                       "    memory: 0.8GB\n")
    code, _, err = run_cli(capsys, "plan", *TINY, "--cluster", str(cluster), "--batch", "32")
    assert code == 2
    assert "nothing fits in 0.75 GiB per device: the least memory any strategy needs is" in err
    assert "what would help" in err and err.count("\n") == 1


def _run(argv: list[str], seed: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    return subprocess.run([sys.executable, "-m", "planner.cli.main", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


def test_identical_json_across_runs_and_hash_seeds(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*PLAN, "--json", "--top", "2"]
    runs = [_run(argv, seed) for seed in ("0", "12345")]
    outs = []
    for r in runs:
        assert r.returncode == 0, r.stderr
        plans = json.loads(r.stdout)
        for p in plans:
            p["search"].pop("time_s")
        outs.append(plans)
    in_process = json.loads(run_cli(capsys, *argv)[1])
    for p in in_process:
        p["search"].pop("time_s")
    assert outs[0] == outs[1] == in_process


def test_user_error_in_a_subprocess_has_no_traceback() -> None:
    r = _run(["plan", *TINY, "--cluster", "1x8xa100", "--batch", "32"], "0")
    assert r.returncode == 2
    assert r.stderr.startswith("stratagem: error: --cluster 1x8xa100:") and "Traceback" not in r.stderr
