"""The simulated step: schedule orders, the event simulation against closed forms and a reference simulator, and
the Chrome trace (one track per stage, span equal to the predicted step time)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import pytest
from plan_factory import make_plan

from costmodel.pipeline import pipeline_times
from costmodel.strategy import Recompute, Schedule
from planner.errors import UserError
from planner.reports.schedule_simulation import (
    PipelineOp,
    fit_p2p_time,
    pipeline_span,
    schedule_order,
    simulate_pipeline,
)
from planner.reports.timeline import (
    EventKind,
    StepTimeline,
    build_timeline,
    predicted_pipeline_s,
    timeline_to_chrome,
    write_timeline,
)

REL = 1e-9


def closed_form(f: Sequence[float], b: Sequence[float], schedule: Schedule, m: int, v: int, c: float) -> float:
    """The cost model's pipeline time, each rank's time split evenly over its chunks."""
    return pipeline_times([x / v for _ in range(v) for x in f], [x / v for _ in range(v) for x in b], schedule,
                          m, v, c).total_s


def reference_simulation(f: Sequence[float], b: Sequence[float], schedule: Schedule, m: int, v: int,
                         c: float) -> dict[PipelineOp, tuple[float, float]]:
    """An independent simulator: poll the ranks round-robin and run each one's next operation once its input
    has finished (the simulator under test uses a topological order instead)."""
    p = len(f)
    orders = [list(schedule_order(schedule, p, m, v, d)) for d in range(p)]
    last = p * v - 1
    done: dict[PipelineOp, tuple[float, float]] = {}
    free = [0.0] * p
    while any(orders):
        progressed = False
        for d in range(p):
            while orders[d]:
                op = orders[d][0]
                s, j = op.virtual_stage, op.microbatch
                if op.forward:
                    deps = [PipelineOp(True, s - 1, j)] if s > 0 else []
                else:
                    deps = [PipelineOp(True, s, j)] + ([PipelineOp(False, s + 1, j)] if s < last else [])
                if any(x not in done for x in deps):
                    break
                recv = c if (s > 0 if op.forward else s < last) else 0.0
                start = max([free[d]] + [done[x][1] for x in deps])
                end = start + recv + (f[d] if op.forward else b[d]) / v
                done[op] = (start, end)
                free[d] = end
                orders[d].pop(0)
                progressed = True
        assert progressed, "reference simulation deadlocked"
    return done


# ------------------------------------------------------------------------------------------ schedule orders


def test_1f1b_order_is_warmup_then_alternate_then_drain():
    order = [str(op) for op in schedule_order(Schedule.ONE_F_ONE_B, 4, 6, 1, 0)]
    assert order == ["F0@0", "F1@0", "F2@0", "F3@0", "B0@0", "F4@0", "B1@0", "F5@0", "B2@0", "B3@0", "B4@0", "B5@0"]
    last = [str(op) for op in schedule_order(Schedule.ONE_F_ONE_B, 4, 3, 1, 3)]
    assert last == ["F0@3", "B0@3", "F1@3", "B1@3", "F2@3", "B2@3"]


def test_gpipe_order_is_all_forwards_then_all_backwards():
    order = [str(op) for op in schedule_order(Schedule.GPIPE, 2, 3, 1, 1)]
    assert order == ["F0@1", "F1@1", "F2@1", "B0@1", "B1@1", "B2@1"]


def test_interleaved_order_groups_p_microbatches_per_chunk():
    # p=2, v=2, m=4, rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards: mb 0,1 on chunk 0 (vs 0), then on chunk 1
    # (vs 2); then 1F1B with backwards starting on the last chunk.
    order = [str(op) for op in schedule_order(Schedule.INTERLEAVED, 2, 4, 2, 0)]
    assert order[:4] == ["F0@0", "F1@0", "F0@2", "F1@2"]
    assert order[4:8] == ["F2@0", "B0@2", "F3@0", "B1@2"]
    assert sorted(order) == sorted(f"{k}{j}@{s}" for k in "FB" for j in range(4) for s in (0, 2))


@pytest.mark.parametrize("schedule,p,m,v", [(Schedule.GPIPE, 3, 5, 1), (Schedule.ONE_F_ONE_B, 4, 2, 1),
                                            (Schedule.ONE_F_ONE_B, 4, 9, 1), (Schedule.INTERLEAVED, 4, 8, 2),
                                            (Schedule.INTERLEAVED, 3, 3, 3)])
def test_every_rank_runs_each_of_its_operations_once(schedule, p, m, v):
    for d in range(p):
        order = schedule_order(schedule, p, m, v, d)
        expected = {PipelineOp(fw, c * p + d, j) for fw in (True, False) for c in range(v) for j in range(m)}
        assert len(order) == len(expected) and set(order) == expected


def test_interleaved_needs_microbatches_divisible_by_pp():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) divisible by pp \(4\)"):
        schedule_order(Schedule.INTERLEAVED, 4, 6, 2, 0)


# ------------------------------------------------------------------------------------------ the simulation


@pytest.mark.parametrize("schedule,p,m,v,expected", [
    (Schedule.GPIPE, 4, 8, 1, (8 + 4 - 1) * 3.0),
    (Schedule.ONE_F_ONE_B, 4, 8, 1, (8 + 4 - 1) * 3.0),
    (Schedule.ONE_F_ONE_B, 8, 3, 1, (3 + 8 - 1) * 3.0),
    (Schedule.ONE_F_ONE_B, 1, 5, 1, 5 * 3.0),
    (Schedule.INTERLEAVED, 4, 8, 2, 8 * 3.0 + 3 * 3.0 / 2),
    (Schedule.INTERLEAVED, 4, 4, 2, 4 * 3.0 + 3 * 3.0 / 2),
    (Schedule.INTERLEAVED, 8, 16, 4, 16 * 3.0 + 7 * 3.0 / 4),
])
def test_equal_stages_reproduce_the_closed_forms(schedule, p, m, v, expected):
    """(m + p - 1)(f + b) for GPipe/1F1B, m(f + b) + (p - 1)(f + b)/v interleaved (Narayanan et al., SC'21)."""
    span = pipeline_span(simulate_pipeline([1.0] * p, [2.0] * p, schedule, m, v))
    assert span == pytest.approx(expected, rel=1e-12)
    assert span == pytest.approx(closed_form([1.0] * p, [2.0] * p, schedule, m, v, 0.0), rel=1e-12)


def _random_instance(rng: random.Random) -> tuple[Schedule, list[float], list[float], int, int, float]:
    schedule = rng.choice([Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED])  # tests/test_zero_bubble.py
    p = rng.randint(2, 6)
    v = rng.randint(2, 3) if schedule is Schedule.INTERLEAVED else 1
    m = p * rng.randint(1, 3) if schedule is Schedule.INTERLEAVED else rng.randint(1, 10)
    f = [rng.uniform(0.2, 2.0) for _ in range(p)]
    b = [x * rng.uniform(0.5, 3.0) for x in f]
    c = rng.choice([0.0, rng.uniform(0.0, 0.2)])
    return schedule, f, b, m, v, c


def test_simulation_matches_an_independent_reference_simulator():
    rng = random.Random(7)
    for _ in range(150):
        schedule, f, b, m, v, c = _random_instance(rng)
        got = simulate_pipeline(f, b, schedule, m, v, c)
        want = reference_simulation(f, b, schedule, m, v, c)
        assert got.keys() == want.keys()
        for op, (start, end) in want.items():
            assert got[op] == pytest.approx((start, end), rel=1e-12, abs=1e-12), (schedule, op)


def test_gpipe_simulation_equals_the_closed_form_for_any_stages():
    """GPipe is two flow shops; costmodel/pipeline.py's form for it is exact, p2p included."""
    rng = random.Random(11)
    for _ in range(200):
        p, m = rng.randint(1, 6), rng.randint(1, 10)
        f = [rng.uniform(0.1, 2.0) for _ in range(p)]
        b = [rng.uniform(0.1, 4.0) for _ in range(p)]
        c = rng.uniform(0.0, 0.3)
        span = pipeline_span(simulate_pipeline(f, b, Schedule.GPIPE, m, 1, c))
        assert span == pytest.approx(closed_form(f, b, Schedule.GPIPE, m, 1, c), rel=1e-12)


def test_1f1b_closed_form_bounds_the_simulation_for_realistic_stages():
    """Backward 2-3x forward (2x, or 3x with full recomputation): the closed form is never below the schedule."""
    rng = random.Random(13)
    gaps = []
    for _ in range(300):
        p, m = rng.randint(2, 8), rng.randint(1, 16)
        f = [rng.uniform(0.2, 2.0) for _ in range(p)]
        b = [x * rng.uniform(2.0, 3.0) for x in f]
        c = rng.uniform(0.0, 0.05)
        span = pipeline_span(simulate_pipeline(f, b, Schedule.ONE_F_ONE_B, m, 1, c))
        bound = closed_form(f, b, Schedule.ONE_F_ONE_B, m, 1, c)
        assert span <= bound * (1 + 1e-12)
        gaps.append(bound - span)
    assert max(gaps) > 0.01  # uneven stages: the bound is not always tight, so slack events do occur


def test_deadlock_is_reported_not_hung():
    with pytest.raises(ValueError, match="divisible"):
        simulate_pipeline([1.0] * 3, [2.0] * 3, Schedule.INTERLEAVED, 4, 2)


def test_fitted_p2p_time_reproduces_the_charged_pipeline_communication():
    f, b = [0.3, 0.1, 0.1, 0.1], [0.6, 0.2, 0.2, 0.2]
    for schedule, v, m in [(Schedule.ONE_F_ONE_B, 1, 8), (Schedule.GPIPE, 1, 5), (Schedule.INTERLEAVED, 2, 8)]:
        charged = pipeline_times([x / v for _ in range(v) for x in f], [x / v for _ in range(v) for x in b],
                                 schedule, m, v, 0.0123).p2p_s
        assert fit_p2p_time(f, b, schedule, m, v, charged) == pytest.approx(0.0123, rel=1e-12)
    assert fit_p2p_time([1.0], [2.0], Schedule.ONE_F_ONE_B, 4, 1, 0.5) == 0.0  # no boundary to cross


# ------------------------------------------------------------------------------------------ plan -> timeline


def _top_level(t: StepTimeline, stage: int):
    return sorted((e for e in t.events if e.stage == stage and e.depth == 0), key=lambda e: e.start_s)


PLANS = {
    "1f1b equal": dict(),
    "gpipe equal": dict(schedule=Schedule.GPIPE),
    "interleaved v=2": dict(schedule=Schedule.INTERLEAVED, v=2),
    "1f1b uneven + p2p": dict(fwd=[0.3, 0.1, 0.1, 0.12], bwd=[0.6, 0.2, 0.25, 0.3], p2p_s=0.01),
    "gpipe uneven + p2p": dict(schedule=Schedule.GPIPE, fwd=[0.3, 0.1, 0.1, 0.1], bwd=[0.2, 0.2, 0.2, 0.5],
                               p2p_s=0.01),
    "interleaved v=3 + p2p": dict(schedule=Schedule.INTERLEAVED, v=3, m=12, p2p_s=0.003),
    "no pipeline": dict(pp=1, m=4, dp=8),
    "full recompute": dict(recompute=Recompute.FULL, recompute_frac=0.25, tp_frac=0.05),
    "interleaved-zb v=2 + p2p": dict(schedule=Schedule.INTERLEAVED_ZB, v=2, p2p_s=0.002, bwd=[0.22] * 4,
                                     wgrad=[0.09] * 4),
    "zbv + p2p": dict(schedule=Schedule.ZBV, v=2, p2p_s=0.002, bwd=[0.22] * 4, wgrad=[0.09] * 4),
    "dualpipev + recompute": dict(schedule=Schedule.DUALPIPEV, v=2, bwd=[0.3] * 4, wgrad=[0.08] * 4,
                                  recompute=Recompute.FULL, recompute_frac=0.2),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_each_track_tiles_the_predicted_step_exactly(name):
    plan = make_plan(**PLANS[name])
    t = build_timeline(plan)
    step = plan.predicted.step_time_s
    assert t.model_gap_s == 0.0
    assert t.span_s == pytest.approx(step, rel=REL)
    assert t.closed_form_pipeline_s == pytest.approx(predicted_pipeline_s(plan), rel=1e-15)
    for d in range(plan.strategy.pp):
        track = _top_level(t, d)
        assert track[0].start_s == 0.0
        for a, nxt in zip(track, track[1:], strict=False):
            assert nxt.start_s == pytest.approx(a.end_s, rel=REL, abs=1e-12)  # no overlap, no hole
        assert track[-1].end_s == pytest.approx(step, rel=REL)
        for child in (e for e in t.events if e.stage == d and e.depth == 1):
            parent = next(e for e in track if e.start_s <= child.start_s + 1e-12 and e.kind in
                          (EventKind.FORWARD, EventKind.BACKWARD) and child.end_s <= e.end_s + 1e-12)
            assert parent.microbatch == child.microbatch


def test_work_per_track_equals_the_plans_stage_times():
    plan = make_plan(fwd=[0.3, 0.1, 0.1, 0.12], bwd=[0.6, 0.2, 0.25, 0.3], p2p_s=0.01, m=6)
    t = build_timeline(plan)
    for d, s in enumerate(plan.predicted.stages):
        mine = [e for e in t.events if e.stage == d]
        fwd = [e for e in mine if e.kind is EventKind.FORWARD]
        bwd = [e for e in mine if e.kind is EventKind.BACKWARD]
        assert len(fwd) == len(bwd) == 6
        assert sum(e.duration_s for e in fwd) == pytest.approx(6 * s.fwd_s, rel=1e-12)
        assert sum(e.duration_s for e in bwd) == pytest.approx(6 * s.bwd_s, rel=1e-12)
        recv = [e for e in mine if e.kind is EventKind.PP_COMM]
        # Rank 0 receives only gradients, the last rank only activations, the middle ranks both.
        assert len(recv) == (6 if d in (0, 3) else 12)
        assert all(e.duration_s == pytest.approx(0.01, rel=1e-9) for e in recv)


def test_uneven_1f1b_shows_the_closed_forms_excess_as_slack():
    plan = make_plan(fwd=[0.3, 0.1, 0.1, 0.1], bwd=[0.6, 0.2, 0.2, 0.2], m=8)
    t = build_timeline(plan)
    simulated = pipeline_span(reference_simulation([0.3, 0.1, 0.1, 0.1], [0.6, 0.2, 0.2, 0.2],
                                                   Schedule.ONE_F_ONE_B, 8, 1, 0.0))
    # Closed form: sum(f+b) + (m-1) max(f+b) = 1.8 + 7 * 0.9 = 8.1; the schedule itself needs 7.2.
    assert t.closed_form_pipeline_s == pytest.approx(8.1, rel=1e-12)
    assert t.simulated_pipeline_s == pytest.approx(simulated, rel=1e-12) == pytest.approx(7.2, rel=1e-12)
    slack = [e for e in t.events if e.name == "schedule slack"]
    assert len(slack) == 4 and all(e.duration_s == pytest.approx(0.9, rel=1e-9) for e in slack)


def test_tail_holds_end_of_step_comm_then_optimizer_on_every_track():
    plan = make_plan(end_comm_s=0.07, optimizer_s=0.03)
    t = build_timeline(plan)
    step = plan.predicted.step_time_s
    for d in range(4):
        *_, comm, opt = _top_level(t, d)
        assert comm.kind is EventKind.DP_COMM and comm.duration_s == pytest.approx(0.07, rel=1e-9)
        assert opt.kind is EventKind.OPTIMIZER and opt.duration_s == pytest.approx(0.03, rel=1e-9)
        assert opt.end_s == pytest.approx(step, rel=1e-12)


def test_full_recompute_reruns_the_chunk_forward_inside_each_backward():
    plan = make_plan(recompute=Recompute.FULL, recompute_frac=0.25, tp_frac=0.05, v=2,
                     schedule=Schedule.INTERLEAVED)
    t = build_timeline(plan)
    rc = [e for e in t.events if e.kind is EventKind.RECOMPUTE]
    assert len(rc) == 4 * 8 * 2
    assert all(e.duration_s == pytest.approx(0.1 / 2, rel=1e-12) for e in rc)  # fwd 0.1 s per rank, 2 chunks
    tp = [e for e in t.events if e.kind is EventKind.TP_COMM]
    share = 0.05 / 1.0  # tp_comm / (compute + recompute + tp_comm) of the factory's busy time
    assert all(e.duration_s == pytest.approx(share * 0.1 / 2, rel=1e-9) or
               e.duration_s == pytest.approx(share * 0.2 / 2, rel=1e-9) for e in tp)


def test_interleaved_uneven_disagreement_is_reported_not_hidden():
    """Ranks whose backward/forward ratios differ (e.g. different recomputation): Megatron's interleaved schedule
    takes longer than the cost model's closed form; the timeline keeps the simulation and says by how much."""
    f, b = [1.0, 2.0, 1.5], [2.0, 4.0, 4.5]
    plan = make_plan(pp=3, v=4, m=6, schedule=Schedule.INTERLEAVED, fwd=f, bwd=b, layers=24)
    t = build_timeline(plan)
    simulated = pipeline_span(reference_simulation(f, b, Schedule.INTERLEAVED, 6, 4, 0.0))
    assert simulated == pytest.approx(39.375, rel=1e-12)
    assert t.closed_form_pipeline_s == pytest.approx(38.25, rel=1e-12)
    assert t.model_gap_s == pytest.approx(39.375 - 38.25, rel=1e-9)
    assert t.span_s == pytest.approx(plan.predicted.step_time_s + t.model_gap_s, rel=REL)


# ------------------------------------------------------------------------------------------ Chrome trace


def test_written_trace_is_chrome_json_with_one_track_per_stage(tmp_path):
    plan = make_plan(schedule=Schedule.INTERLEAVED, v=2, p2p_s=0.002, recompute=Recompute.SELECTIVE,
                     recompute_frac=0.05)
    path = tmp_path / "step.json"
    write_timeline(plan, path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["tid"] for e in complete} == {0, 1, 2, 3}
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names) == [0, 1, 2, 3] and names[2].startswith("stage 2 (a100-80gb")
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid"} <= e.keys()
        assert e["ts"] >= 0 and e["dur"] > 0 and e["cat"] in {k.value for k in EventKind}
    span_us = max(e["ts"] + e["dur"] for e in complete) - min(e["ts"] for e in complete)
    assert span_us == pytest.approx(plan.predicted.step_time_s * 1e6, rel=REL)
    # every kind appears in this plan but the zero-bubble schedules' weight-gradient operations
    assert {e["cat"] for e in complete} == {k.value for k in EventKind} - {EventKind.WEIGHT_GRAD.value}
    assert trace["otherData"]["step_time_s"] == plan.predicted.step_time_s
    for tid in range(4):  # slices on a track nest properly (as trace viewers require) or follow each other
        stack: list[float] = []
        for e in sorted((e for e in complete if e["tid"] == tid), key=lambda e: (e["ts"], -e["dur"])):
            while stack and e["ts"] >= stack[-1]:
                stack.pop()
            assert not stack or e["ts"] + e["dur"] <= stack[-1], e
            stack.append(e["ts"] + e["dur"])


def test_chrome_events_round_trip_the_timeline():
    plan = make_plan(pp=2, m=3)
    t = build_timeline(plan)
    trace = timeline_to_chrome(t, title="x")
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(t.events)
    assert sum(e["dur"] for e in complete if e["cat"] == "forward") == pytest.approx(
        sum(e.duration_s for e in t.events if e.kind is EventKind.FORWARD) * 1e6, rel=1e-12)


def test_write_timeline_into_a_missing_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        write_timeline(make_plan(), tmp_path / "nope" / "t.json")
