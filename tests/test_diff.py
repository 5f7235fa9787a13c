"""`stratagem diff`: empty for identical plans, every change named with its % change, regressions trip the exit
status, the markdown is a well-formed GitHub table, and the input files are never written."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from plan_factory import GIB, make_plan, with_step_time

from costmodel.sharding.rules import Style
from costmodel.strategy import Recompute, Schedule, StageSpec
from planner.cli.main import main
from planner.plan import ModelInfo, ModuleSharding, Plan, SearchInfo
from planner.reports.diff import DiffFormat, diff_plans, render, render_markdown, render_text


def write(tmp_path, name: str, plan: Plan):
    path = tmp_path / name
    path.write_text(plan.to_json())
    return path


def run(argv, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def changes(old: Plan, new: Plan) -> dict[tuple[str, str], tuple]:
    return {(c.section, c.field): (c.old, c.new, c.pct) for c in diff_plans(old, new).changes}


# ------------------------------------------------------------------------------------------ library


def test_identical_plans_give_an_empty_diff_even_with_another_search_time():
    plan = make_plan()
    rerun = replace(plan, search=replace(plan.search, time_s=99.0))
    diff = diff_plans(plan, rerun)
    assert diff.is_empty and diff.changes == () and diff.regressions(0.0) == ()
    assert render_text(diff) == ""
    assert json.loads(render(diff, DiffFormat.JSON))["identical"] is True


def test_strategy_changes_are_named_rows():
    old = make_plan(tp=2, m=8)
    new = make_plan(tp=4, m=16, schedule=Schedule.GPIPE, recompute=Recompute.FULL, recompute_frac=0.2)
    got = changes(old, new)
    assert got[("strategy", "tp")] == (2, 4, None)  # a choice, not a quantity: no % change
    assert got[("strategy", "num_microbatches")][:2] == (8, 16)
    assert got[("strategy", "schedule")][:2] == ("1f1b", "gpipe")
    assert got[("strategy", "recompute")][:2] == ("none", "full")
    assert got[("stages", "stage 0 recompute")][:2] == ("none", "full")
    assert got[("training", "global_batch")][:2] == (16, 32)


def test_stage_boundaries_and_stage_count():
    old = make_plan(pp=4, layers=24)
    stages = (StageSpec(0, 8), StageSpec(8, 14), StageSpec(14, 20), StageSpec(20, 24))
    new = replace(old, strategy=replace(old.strategy, stages=stages))
    got = changes(old, new)
    assert got[("stages", "stage 0 segments")][:2] == ("0-5", "0-7")
    assert got[("stages", "stage 3 segments")][:2] == ("18-23", "20-23")
    assert ("stages", "stage 1 recompute") not in got
    fewer = make_plan(pp=2, layers=24)
    got = changes(old, fewer)
    assert got[("strategy", "pp")][:2] == (4, 2)
    assert got[("stages", "count")][:2] == (4, 2)
    assert got[("stages", "stage 3 segments")][:2] == ("18-23", None)
    assert got[("predicted", "peak_memory_bytes stage 3")][1] is None


def test_predictions_carry_their_percent_change():
    old = make_plan()
    new = with_step_time(old, 1.25)
    got = changes(old, new)
    assert got[("predicted", "step_time_s")][2] == pytest.approx(25.0, rel=1e-12)
    assert got[("predicted", "tokens_per_s")][2] == pytest.approx(-20.0, rel=1e-12)
    assert got[("predicted", "mfu")][2] == pytest.approx(-20.0, rel=1e-12)
    assert got[("predicted", "breakdown.bubble_s")][2] == pytest.approx(25.0, rel=1e-12)
    assert ("predicted", "peak_memory_bytes (max)") not in got  # memory did not change


def test_fingerprints_of_model_and_cluster():
    old = make_plan()
    new = replace(old, model=replace(old.model, fingerprint="ffff0000ffff0000"),
                  cluster={"name": "8x8xh100-sxm",
                           "groups": [{"device": {"name": "h100-sxm"}, "num_nodes": 8, "devices_per_node": 8}]})
    got = changes(old, new)
    assert got[("cluster", "devices")][:2] == ("4x8 a100-80gb", "8x8 h100-sxm")
    assert got[("model", "fingerprint")][:2] == ("ab12cd34ef567890", "ffff0000ffff0000")
    assert got[("cluster", "name")][:2] == ("4x8xa100-80gb", "8x8xh100-sxm")
    a, b, _ = got[("cluster", "fingerprint")]
    assert re.fullmatch(r"[0-9a-f]{16}", a) and re.fullmatch(r"[0-9a-f]{16}", b) and a != b


def test_sharding_added_removed_changed():
    old = make_plan()
    new = replace(old, sharding=(ModuleSharding("blocks.*.attn.q_proj", Style.ROWWISE),
                                 ModuleSharding("embed", Style.VOCAB)))
    got = changes(old, new)
    assert got[("sharding", "blocks.*.attn.q_proj")][:2] == ("colwise", "rowwise")
    assert got[("sharding", "blocks.*.attn.o_proj")][:2] == ("rowwise", None)
    assert got[("sharding", "embed")][:2] == (None, "vocab")


def test_any_other_changed_value_shows_in_details():
    old = make_plan()
    stages = list(old.predicted.stages)
    stages[1] = replace(stages[1], in_flight_microbatches=7)
    new = replace(old, predicted=replace(old.predicted, stages=tuple(stages)))
    diff = diff_plans(old, new)
    assert [(c.section, c.field, c.old, c.new) for c in diff.changes] == [
        ("details", "predicted.stages[1].in_flight_microbatches", 3, 7)]


def test_regressions_step_time_memory_and_fit():
    old = make_plan()
    slower = with_step_time(old, 1.10)
    assert [r.metric for r in diff_plans(old, slower).regressions(5.0)] == ["step_time_s"]
    assert diff_plans(old, slower).regressions(10.5) == ()
    assert diff_plans(slower, old).regressions(0.0) == ()  # faster is never a regression
    bigger = make_plan(memory_gib=[40, 42, 44, 46 * 1.2])
    (r,) = diff_plans(old, bigger).regressions(15.0)
    assert r.metric == "peak_memory_bytes" and r.pct == pytest.approx(20.0, rel=1e-6)
    overflow = make_plan(memory_gib=[40, 42, 44, 46], capacity_gib=45.0)
    assert [r.metric for r in diff_plans(old, overflow).regressions(50.0)] == ["fits"]
    with pytest.raises(ValueError, match=">= 0"):
        diff_plans(old, old).regressions(-1.0)


def _cells(row: str) -> list[str]:
    assert row.startswith("| ") and row.endswith(" |"), row
    return re.split(r"(?<!\\)\|", row[1:-1])


def assert_wellformed_tables(md: str) -> int:
    """Every table: a header, a separator row of --- cells, and rows with the header's column count."""
    lines = md.splitlines()
    tables = 0
    i = 0
    while i < len(lines):
        if lines[i].startswith("|"):
            header = _cells(lines[i])
            separator = _cells(lines[i + 1])
            assert len(separator) == len(header)
            assert all(re.fullmatch(r" ?:?-{3,}:? ?", c) for c in separator), lines[i + 1]
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                assert len(_cells(lines[j])) == len(header), lines[j]
                j += 1
            assert j == len(lines) or lines[j] == "", "a table must end with a blank line"
            tables += 1
            i = j
        i += 1
    return tables


def test_markdown_is_a_wellformed_table_even_with_pipes_in_values():
    old = make_plan()
    new = with_step_time(old, 1.2)
    new = replace(new, model=ModelInfo(name="my|model", fingerprint="00", params=old.model.params,
                                       settings=(("note", "a|b"), ("layers", 24))),
                  search=SearchInfo(1.0, 7, "feasible", 0.1, 1.0))
    md = render_markdown(diff_plans(old, new), threshold_pct=5.0)
    assert assert_wellformed_tables(md) == 2  # named changes, and the folded details
    assert "> **Regression:** predicted step time +20.00% exceeds the 5% threshold." in md
    assert "| model | name | gpt | my\\|model |  |" in md
    assert "| predicted | step_time_s |" in md and "| +20.00% |" in md


def test_markdown_for_identical_plans_says_so():
    plan = make_plan()
    md = render_markdown(diff_plans(plan, plan))
    assert md.endswith("No changes.\n") and "|" not in md


# ------------------------------------------------------------------------------------------ command line


def test_cli_identical_plans_print_nothing_and_exit_0(tmp_path, capsys):
    a = write(tmp_path, "a.json", make_plan())
    b = write(tmp_path, "b.json", replace(make_plan(), search=replace(make_plan().search, time_s=3.0)))
    assert run(["diff", a, b, "--fail-on-regression", "0"], capsys) == (0, "", "")


def test_cli_worse_plan_trips_fail_on_regression(tmp_path, capsys):
    old = make_plan()
    a = write(tmp_path, "old.json", old)
    b = write(tmp_path, "new.json", with_step_time(old, 1.08))
    before = (a.read_bytes(), b.read_bytes())
    code, out, _ = run(["diff", a, b, "--fail-on-regression", "5"], capsys)
    assert code == 1
    assert "step_time_s:" in out and "(+8.00%)" in out and "REGRESSION: predicted step time +8.00%" in out
    assert run(["diff", a, b, "--fail-on-regression", "10"], capsys)[0] == 0
    assert run(["diff", a, b], capsys)[0] == 0  # reporting alone never fails
    assert (a.read_bytes(), b.read_bytes()) == before  # inputs are never written


def test_cli_markdown_and_json_formats(tmp_path, capsys):
    old = make_plan()
    a = write(tmp_path, "old.json", old)
    b = write(tmp_path, "new.json", make_plan(tp=4, memory_gib=[40, 42, 44, 60]))
    code, md, _ = run(["diff", a, b, "--format", "md", "--fail-on-regression", "10"], capsys)
    assert code == 1 and assert_wellformed_tables(md) >= 1
    assert "peak memory per device +30.43% exceeds the 10% threshold" in md
    code, out, _ = run(["diff", a, b, "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["identical"] is False and data["regressions"] == []
    rows = {(c["section"], c["field"]): c for c in data["changes"]}
    assert rows[("strategy", "tp")]["old"] == 2 and rows[("strategy", "tp")]["new"] == 4
    assert rows[("predicted", "peak_memory_bytes (max)")]["new"] == 60 * GIB
    assert rows[("predicted", "peak_memory_bytes (max)")]["pct"] == pytest.approx((60 / 46 - 1) * 100)


@pytest.mark.parametrize("argv,message", [
    (["diff", "{a}", "{missing}"], "does not exist"),
    (["diff", "{a}", "{corrupt}"], "not valid JSON"),
    (["diff", "{a}", "{a}", "--fail-on-regression", "-3"], "percentage >= 0"),
    (["diff", "{a}", "{a}", "--format", "html"], "invalid choice"),
    (["diff", "{a}", "{newer}"], "newer than this Stratagem reads"),
])
def test_cli_user_errors_are_one_line_exit_2(tmp_path, capsys, argv, message):
    a = write(tmp_path, "a.json", make_plan())
    (tmp_path / "corrupt.json").write_text(make_plan().to_json()[:200])
    newer = make_plan().to_dict()
    newer["schema_version"] = 99
    (tmp_path / "newer.json").write_text(json.dumps(newer))
    paths = {"a": a, "missing": tmp_path / "missing.json", "corrupt": tmp_path / "corrupt.json",
             "newer": tmp_path / "newer.json"}
    code, out, err = run([x.format(**paths) for x in argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
