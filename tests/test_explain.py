"""`stratagem explain`: the breakdown with shares, the bottleneck stage, memory against capacity, and the
alternatives that lost with by how much and why; the CLI reads the plan and never writes it."""

from __future__ import annotations

import json

import pytest
from plan_factory import GIB, make_plan

from costmodel.strategy import Schedule
from planner.cli.main import main
from planner.plan import Alternative
from planner.reports.explain import explain_plan, render_explanation
from planner.reports.timeline import build_timeline
from planner.search.candidates import Candidate
from planner.search.meshes import PP_INSIDE_DP, MeshCandidate
from planner.strategy_label import Detail, strategy_label

ALTERNATIVES = (
    Alternative("dp=1 tp=8 pp=4", None, "does not fit: stage 0 needs 93.1 GiB > 80.0 GiB"),
    Alternative("dp=2 tp=4 pp=2", 4.0, "its all-reduce crosses nodes"),
    Alternative("dp=4 tp=2 pp=1", 3.5, "no pipeline: optimizer state does not shard"),
)


def test_shares_add_up_and_name_every_term():
    plan = make_plan(p2p_s=0.004, end_comm_s=0.06, optimizer_s=0.02, tp_frac=0.1)
    e = explain_plan(plan)
    step = plan.predicted.step_time_s
    terms = {t.key: t for t in e.terms}
    assert list(terms) == ["compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s",
                           "optimizer_s", "framework_s", "comm_total"]
    assert sum(t.share for t in e.terms if t.key != "comm_total") == pytest.approx(1.0, rel=1e-12)
    bd = plan.predicted.breakdown
    assert terms["bubble_s"].share == pytest.approx(bd.bubble_s / step, rel=1e-12)
    assert terms["comm_total"].seconds == pytest.approx(bd.tp_comm_s + bd.pp_comm_s + bd.dp_comm_s, rel=1e-12)


def test_bottleneck_is_the_stage_with_most_work_per_microbatch():
    plan = make_plan(fwd=[0.1, 0.1, 0.15, 0.1], bwd=[0.2, 0.2, 0.3, 0.2])
    e = explain_plan(plan)
    assert e.bottleneck_stage == 2
    # 0.45 s vs a mean of 0.3375 s: 33.3% above.
    assert "stage 2 (segments 12-17, a100-80gb): 450 ms per micro-batch (forward 150 ms + backward 300 ms)" \
        in e.bottleneck
    assert "33.3% above the mean stage" in e.bottleneck
    assert explain_plan(make_plan()).bottleneck_stage == 0  # a tie: the first stage


def test_memory_rows_and_tightest_stage():
    plan = make_plan(memory_gib=[70, 50, 79.2, 60])
    e = explain_plan(plan)
    assert e.tightest_stage == 2
    assert [r.peak_bytes for r in e.stages] == [plan.predicted.stages[i].memory.total for i in range(4)]
    assert e.stages[2].utilization == pytest.approx(79.2 / 80, rel=1e-6)
    assert e.stages[0].largest_part == "activations"
    assert any("stage 2 uses 99.0% of its memory" in n for n in e.notes)


def test_alternatives_sorted_with_their_margin_and_reason():
    plan = make_plan(alternatives=ALTERNATIVES)
    step = plan.predicted.step_time_s
    e = explain_plan(plan)
    assert [a.summary for a in e.alternatives] == ["dp=4 tp=2 pp=1", "dp=2 tp=4 pp=2", "dp=1 tp=8 pp=4"]
    assert e.alternatives[0].delta_pct == pytest.approx((3.5 / step - 1) * 100, rel=1e-12)
    assert e.alternatives[2].delta_pct is None
    text = render_explanation(e, plan)
    assert f"dp=2 tp=4 pp=2: {(4.0 / step - 1) * 100:+.1f}% step time (4 s): its all-reduce crosses nodes" in text
    assert "dp=1 tp=8 pp=4: does not fit: stage 0 needs 93.1 GiB > 80.0 GiB" in text
    short = render_explanation(e, plan, max_alternatives=1)
    assert "... and 2 more" in short and "dp=2 tp=4" not in short


def test_a_reason_that_repeats_the_margin_is_not_said_twice():
    plan = make_plan(alternatives=[Alternative("dp=8 tp=1 pp=1", 3.5, "+3.9% step time: slower compute")])
    (alt,) = explain_plan(plan).alternatives
    assert alt.describe() == f"dp=8 tp=1 pp=1: {alt.delta_pct:+.1f}% step time (3.5 s): slower compute"


def test_notes_bubble_and_overflow():
    bubbly = make_plan(m=2)  # (p-1)/m = 150%: the bubble dominates
    e = explain_plan(bubbly)
    assert any(n.startswith("the pipeline bubble is") and "(p-1)/(v m) = 150%" in n for n in e.notes)
    assert not any("bubble" in n for n in explain_plan(make_plan(m=64)).notes)
    over = make_plan(memory_gib=[90, 40, 40, 40])
    assert any("stage 0 needs 90.00 GiB, more than its 80.00 GiB" in n for n in explain_plan(over).notes)


def test_timeline_gap_becomes_a_note():
    plan = make_plan(pp=3, v=4, m=6, schedule=Schedule.INTERLEAVED, fwd=[1.0, 2.0, 1.5], bwd=[2.0, 4.0, 4.5])
    e = explain_plan(plan, timeline=build_timeline(plan))
    assert any("takes 1.125 s longer than the cost model's closed form" in n for n in e.notes)


def test_one_strategy_label_at_every_level_of_detail():
    plan = make_plan(schedule=Schedule.INTERLEAVED, v=2)
    assert explain_plan(plan).strategy == strategy_label(plan.strategy)
    assert strategy_label(plan.strategy) == "dp=2 tp=2 pp=4 mbs=1 m=8 interleaved:2 zero=1 sp recompute=none"
    assert strategy_label(plan.strategy, Detail.DEGREES) == "dp=2 tp=2 pp=4"
    assert strategy_label(plan.strategy, Detail.MESH) == "dp=2 tp=2 pp=4 (dp inside pp)"
    cand = Candidate(MeshCandidate(dp=2, tp=1, pp=2, cp=2, mesh_order=PP_INSIDE_DP), 1, 4, Schedule.ONE_F_ONE_B, 1,
                     1, False)
    assert cand.label == "dp=2 tp=1 pp=2 cp=2 (pp inside dp) mbs=1 m=4 1f1b zero=1"
    assert cand.mesh.label == strategy_label(cand.strategy(), Detail.MESH)


def test_render_has_every_section():
    plan = make_plan(alternatives=ALTERNATIVES, memory_gib=[40, 41, 42, 43])
    text = render_explanation(explain_plan(plan), plan)
    for heading in ("Where the step time goes:", "Bottleneck: stage 0", "Memory per stage",
                    "Alternatives that lost:", "all exposed communication"):
        assert heading in text
    assert f"{43.0:>7.2f} GiB" in text and "<- tightest" in text


# ------------------------------------------------------------------------------------------ command line


def test_cli_explain_text_json_timeline_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plan = make_plan(alternatives=ALTERNATIVES)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    before = path.read_bytes()
    trace, png = tmp_path / "t.json", tmp_path / "p.png"
    assert main(["explain", str(path), "--timeline", str(trace), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan for gpt (1.3 B parameters) on 4x8xa100-80gb, global batch 16, seq 2048")
    assert json.loads(trace.read_text())["traceEvents"] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["explain", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bottleneck_stage"] == 0 and len(data["alternatives"]) == 3
    assert data["stages"][3]["peak_bytes"] == plan.predicted.stages[3].memory.total
    assert data["stages"][3]["capacity_bytes"] == 80 * GIB
    assert path.read_bytes() == before


@pytest.mark.parametrize("extra,message", [
    (["--timeline", "{plan}"], "is an input file of this command; refusing to overwrite it"),
    (["--plot", "{tmp}/missing/p.png"], "does not exist"),
    (["--timeline", "{tmp}"], "is a directory"),
    (["--alternatives", "-1"], "--alternatives must be >= 0"),
])
def test_cli_explain_user_errors(tmp_path, capsys, extra, message):
    path = tmp_path / "plan.json"
    path.write_text(make_plan().to_json())
    before = path.read_bytes()
    code = main(["explain", str(path)] + [x.format(plan=path, tmp=tmp_path) for x in extra])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and message in captured.err and captured.err.count("\n") == 1
    assert path.read_bytes() == before


def test_cli_explain_missing_or_bad_plan(tmp_path, capsys):
    assert main(["explain", str(tmp_path / "none.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    data = make_plan().to_dict()
    data["strategy"]["bogus"] = 1
    bad.write_text(json.dumps(data))
    assert main(["explain", str(bad)]) == 2
    assert "unknown key(s) in strategy: bogus" in capsys.readouterr().err


def test_a_losing_mesh_with_some_settings_that_do_not_fit_is_not_called_unfit():
    """A mesh left with a finite lower bound still has candidates that may fit: its row gives the bound and names
    the least memory of the settings that do not fit, instead of saying the mesh does not fit."""
    from types import SimpleNamespace

    from planner.search.explanations import explain_alternatives
    from planner.search.outcome import MeshRecord, SearchOptions

    best = SimpleNamespace(candidate=SimpleNamespace(mesh=MeshCandidate(dp=8, tp=1, pp=1)), objective=10.0)
    meshes = {(4, 1, 2): MeshRecord(lower_bound=11.0, memory_need_bytes=90 * GIB),
              (2, 1, 4): MeshRecord(memory_need_bytes=120 * GIB)}
    rows = explain_alternatives(SimpleNamespace(meshes=meshes, options=SearchOptions()), best, {})
    assert [(a.summary, a.reason) for a in rows] == [
        ("dp=4 tp=1 pp=2", "at least +10.0% step time (lower bound 11); some of its settings need at least "
                           "90.0 GiB per device"),
        ("dp=2 tp=1 pp=4", "does not fit: needs at least 120.0 GiB per device")]
