"""The zero-bubble schedules (interleaved-zb, zbv, dualpipev): the closed forms of `costmodel.pipeline` against the
event simulation of torch's own action lists (`planner.reports.schedule_simulation`), their in-flight counts, the
weight-gradient share of a layer's backward, and an estimate that splits the backward."""

from __future__ import annotations

import itertools
import random

import pytest

from costmodel.pipeline import (
    chunk_stages,
    in_flight_per_chunk,
    pipeline_step_time,
    schedule_problem,
    stage_rank,
)
from costmodel.strategy import Schedule, Strategy, parse_schedule
from planner.reports.schedule_simulation import (
    BackwardPart,
    per_virtual_stage,
    pipeline_span,
    simulate_pipeline,
    torch_actions,
)

ZB = (Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV)


def _chunks(schedule: Schedule) -> tuple[int, ...]:
    return (1, 2, 3) if schedule is Schedule.INTERLEAVED_ZB else (2,)


def _closed_form(f, b, w, schedule, m, v, c=0.0) -> float:
    """The cost model's pipeline time for per-rank times split evenly over the rank's chunks."""
    p = len(f)
    sends = [0.0 if stage_rank(schedule, p, j) == stage_rank(schedule, p, j + 1) else c for j in range(p * v - 1)]
    return pipeline_step_time(per_virtual_stage(f, schedule, v), per_virtual_stage(b, schedule, v), schedule, m, v,
                              sends, per_virtual_stage(w, schedule, v))


def test_torch_runs_every_operation_of_every_chunk_once() -> None:
    for schedule, p in itertools.product(ZB, (2, 4)):
        for v in _chunks(schedule):
            actions = torch_actions(schedule, p, 2 * p, v)
            for r, ops in enumerate(actions):
                mine = chunk_stages(schedule, p, v, r)
                forwards = sorted((op.virtual_stage, op.microbatch) for op in ops if op.forward)
                assert forwards == [(s, j) for s in mine for j in range(2 * p)]
                grads = [op for op in ops if op.sends_gradient]
                weights = [op for op in ops if op.part is BackwardPart.WEIGHT]
                assert len(grads) == len(forwards)  # one input gradient (or whole backward) each
                assert {(op.virtual_stage, op.microbatch) for op in weights} <= {(s, j) for s, j in forwards}


@pytest.mark.parametrize("schedule", ZB)
def test_equal_stages_closed_form_is_the_simulation(schedule: Schedule) -> None:
    """Exact whenever W <= F <= I (every transformer layer): the bubble is (p - 1)(F + I - W) (+ the schedule's
    own term when I outgrows F + W or F)."""
    for p, m_per, (i, w) in itertools.product((2, 3, 4, 6), (2, 4), ((1.0, 1.0), (1.25, 0.75), (1.5, 0.5),
                                                                   (2.0, 1.0), (3.0, 0.5), (1.2, 0.9))):
        for v in _chunks(schedule):
            m = m_per * p
            f, b, wg = [1.0 * v] * p, [(i + w) * v] * p, [w * v] * p
            span = pipeline_span(simulate_pipeline(f, b, schedule, m, v, 0.0, wg))
            assert _closed_form(f, b, wg, schedule, m, v) == pytest.approx(span, rel=1e-12), (p, m, v, i, w)


@pytest.mark.parametrize("schedule", ZB)
def test_closed_form_within_6_percent_of_the_simulation(schedule: Schedule) -> None:
    """Stage costs up to 30% apart, any F : I : W in a wide range, sends between ranks."""
    rng = random.Random(5)
    worst = 0.0
    for _ in range(40):
        p, v = rng.choice((2, 3, 4)), rng.choice(_chunks(schedule))
        m = p * rng.choice((2, 3, 4))
        scale = [rng.uniform(0.7, 1.3) for _ in range(p)]
        fi, ii, wi = rng.uniform(0.8, 1.2), rng.uniform(0.6, 1.8), rng.uniform(0.3, 1.2)
        f = [s * fi for s in scale]
        w = [s * wi for s in scale]
        b = [s * ii + x for s, x in zip(scale, w, strict=True)]
        c = rng.choice((0.0, 0.02))
        span = pipeline_span(simulate_pipeline(f, b, schedule, m, v, c, w))
        worst = max(worst, abs(_closed_form(f, b, w, schedule, m, v, c) - span) / span)
    assert worst < 0.06


def test_zero_bubble_beats_1f1b_by_the_deferred_weight_gradients() -> None:
    p, m = 4, 16
    f, b, w = [1.0] * p, [2.0] * p, [0.9] * p
    one_f_one_b = pipeline_step_time(f, b, "1f1b", m)
    zb = pipeline_step_time(f, b, Schedule.INTERLEAVED_ZB, m, 1, 0.0, w)
    # 1F1B: (m + p - 1)(F + B); ZB-H1: m(F + B) + (p - 1)(F + I - W), two W per rank out of the bubble.
    assert one_f_one_b - zb == pytest.approx((p - 1) * 2 * 0.9)


def _peak_per_chunk(times, schedule: Schedule, p: int, v: int, rank: int) -> tuple[int, ...]:
    """Per chunk of `rank`, micro-batches between their forward's start and their weight gradient's end, at the
    moment the rank holds the most."""
    mine = chunk_stages(schedule, p, v, rank)
    spans: dict[tuple[int, int], list[float]] = {}
    for op, (start, end) in times.items():
        if op.virtual_stage in mine:
            key = (op.virtual_stage, op.microbatch)
            lo, hi = spans.get(key, (start, end))
            done = end if not op.forward and op.part is not BackwardPart.INPUT else hi
            spans[key] = [min(lo, start), max(hi, done)]
    moments = sorted({lo for lo, _ in spans.values()})
    best: tuple[int, ...] = ()
    for t in moments:
        counts = tuple(sum(1 for (s, _), (lo, hi) in spans.items() if s == stage and lo <= t < hi) for stage in mine)
        if sum(counts) > sum(best, 0):
            best = counts
    return best


@pytest.mark.parametrize("schedule", ZB)
def test_in_flight_counts_are_the_simulated_peaks(schedule: Schedule) -> None:
    for p, m_per in itertools.product((2, 3, 4), (2, 4)):
        for v in _chunks(schedule):
            m = m_per * p
            # F = I = W = 1 per chunk: whole numbers, so that an end and a start at one moment compare equal
            times = simulate_pipeline([1.0 * v] * p, [2.0 * v] * p, schedule, m, v, 0.0, [1.0 * v] * p)
            for r in range(p):
                assert _peak_per_chunk(times, schedule, p, v, r) == in_flight_per_chunk(schedule, p, r, m, v), (
                    p, m, v, r)


def test_constraints_and_placement() -> None:
    assert schedule_problem(Schedule.ZBV, 4, 6) == "the zbv schedule needs at least 2 * pp = 8 micro-batches, got 6"
    assert "multiple of pp" in schedule_problem(Schedule.INTERLEAVED_ZB, 4, 6)
    assert schedule_problem(Schedule.DUALPIPEV, 4, 8) == ""
    assert chunk_stages(Schedule.ZBV, 4, 2, 1) == (1, 6) and stage_rank(Schedule.DUALPIPEV, 4, 7) == 0
    assert chunk_stages(Schedule.INTERLEAVED_ZB, 4, 2, 1) == (1, 5)
    with pytest.raises(ValueError, match="exactly two chunks"):
        Strategy(pp=2, schedule="zbv", virtual_stages=3)
    assert parse_schedule("zbv") == (Schedule.ZBV, 2) and parse_schedule("interleaved-zb") == (
        Schedule.INTERLEAVED_ZB, None)
    assert Schedule.INTERLEAVED_ZB.label(2) == "interleaved-zb:2" and Schedule.DUALPIPEV.label(2) == "dualpipev"
