"""The simulated training step of a plan, per stage and micro-batch, as Chrome/Perfetto trace JSON.

What is simulated
-----------------
Every pipeline rank (a "stage" of the plan) runs its operations in the order its schedule prescribes, each as soon
as its rank is free and its input is there (`planner.reports.schedule_simulation`: GPipe, 1F1B, Megatron-LM's
interleaved 1F1B, and torch's own action lists for the zero-bubble schedules, whose backwards split into input-
and weight-gradient operations). Durations are the plan's per-rank forward/backward times split evenly over the
rank's v chunks (the plan keeps per-rank times; chunks of uneven virtual stages are shown equal), the weight-
gradient part of a zero-bubble backward its `wgrad_s`. For equal stages and no transfer time it reproduces the
closed forms: (m + p - 1)(f + b) for GPipe and 1F1B, m(f + b) + (p - 1)(f + b)/v interleaved, and
m(f + b) + (p - 1)(f + i - w)/v for the zero-bubble schedules.

Agreement with the cost model, by construction
----------------------------------------------
`predicted.step_time_s` is the cost model's closed form, and its breakdown splits it into the pipeline part

    P = m * max_r(fwd_r + bwd_r) + bubble_s + pp_comm_s        (busy time of the slowest rank, fill/drain, p2p)

and a tail after the last backward: the exposed end-of-step gradient reduction and post-step weight gathers,
then the optimizer step (`breakdown.optimizer_s`). The timeline is built to span exactly the prediction:

1. `p2p_s`, the send/recv time per boundary, is the value for which the cost model's own formula
   (`costmodel.pipeline.pipeline_times`) charges `breakdown.pp_comm_s` (the plan keeps the total, not the
   per-boundary times; it is found by bisection on that monotone formula).
2. The simulation of the schedule fills [0, S]. The closed form for unequal stages is an upper bound of the
   1F1B and interleaved simulations, sum_i(f_i + b_i) + (m - 1) max_i(f_i + b_i) for v = 1 (and exact for GPipe),
   so S <= P; the difference P - S is an explicit idle event, "schedule slack", on every track, so the reader sees
   how much the closed form charges beyond the simulation. (The zero-bubble closed form is within 6% of its
   simulation either way; should it be below, `model_gap_s` says by how much.)
3. The tail is its own events on every track: "end-of-step comm (exposed)" of step_time_s - P - optimizer_s,
   then "optimizer step". (The plan does not split that communication into the gradient reduction before the
   optimizer and ZeRO-1/2's weight all-gather after it, so it is shown as one slice before the optimizer.)

Should a simulation ever exceed P, the span is longer than the prediction and `StepTimeline.model_gap_s` says
by how much (`explain` reports it); the tests check that it stays 0.

Inside each forward and backward, the parts are apportioned from the plan's breakdown (the plan keeps per-rank
forward/backward times, not their parts): exposed tensor-parallel communication is the share
tp_comm_s / (compute_s + recompute_s + tp_comm_s) at the end of each operation; recomputation is a nested event at
the start of the backward of chunks that recompute (of the input-gradient operation, for the zero-bubble
schedules): the chunk's whole forward for "full" recomputation (it re-runs the forward, communication included),
the breakdown's recompute share for "selective". A weight-gradient operation is its own event ("W3"), of kind
`weight_grad`.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.breakdown import TimeBreakdown
from costmodel.strategy import Recompute
from planner.errors import UserError
from planner.plan import Plan
from planner.reports.schedule_simulation import (
    BackwardPart,
    PipelineOp,
    fit_p2p_time,
    pipeline_span,
    receives,
    schedule_order,
    simulate_pipeline,
)

_REL_TOL = 1e-12
"""Relative tolerance below which two times are the same (float rounding of sums of many terms)."""

_GAP_TOL = 1e-9
"""Relative excess of the simulation over the prediction that counts as a disagreement (`model_gap_s`)."""


class EventKind(enum.StrEnum):
    """What a stage is doing during an event; the `cat` of the Chrome trace event."""

    FORWARD = "forward"
    BACKWARD = "backward"
    WEIGHT_GRAD = "weight_grad"
    """The weight-gradient part of a backward, run on its own by the zero-bubble schedules."""
    RECOMPUTE = "recompute"
    TP_COMM = "tp_comm"
    PP_COMM = "pp_comm"
    DP_COMM = "dp_comm"
    OPTIMIZER = "optimizer"
    IDLE = "idle"


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    stage: int
    """Device stage (the Chrome trace tid)."""
    kind: EventKind
    name: str
    start_s: float
    duration_s: float
    microbatch: int | None = None
    virtual_stage: int | None = None
    depth: int = 0
    """0 for a top-level event of the stage's track, 1 for a part nested inside one (recompute, TP comm)."""

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class StepTimeline:
    """The simulated step of one plan. Times are seconds from the start of the step."""

    events: tuple[TimelineEvent, ...]
    stage_labels: tuple[str, ...]
    step_time_s: float
    """The plan's prediction (the closed form)."""
    simulated_pipeline_s: float
    """Span of the simulated pipeline part, before slack and the non-pipelined tail."""
    closed_form_pipeline_s: float
    """P = m * max_r(fwd_r + bwd_r) + bubble_s + pp_comm_s: the pipeline part the cost model predicts."""
    p2p_s: float
    """Send/recv seconds per virtual-stage boundary used by the simulation (fitted to `pp_comm_s`)."""
    model_gap_s: float
    """How much longer than the predicted pipeline part the simulation is (0 when they agree)."""

    @property
    def num_stages(self) -> int:
        return len(self.stage_labels)

    @property
    def span_s(self) -> float:
        return max(e.end_s for e in self.events) - min(e.start_s for e in self.events)


def predicted_pipeline_s(plan: Plan) -> float:
    """P: the part of the predicted step from the first forward to the last backward (module docstring)."""
    bd, stages = plan.predicted.breakdown, plan.predicted.stages
    busy = plan.strategy.num_microbatches * max(s.fwd_s + s.bwd_s for s in stages)
    return busy + bd.bubble_s + bd.pp_comm_s


def build_timeline(plan: Plan) -> StepTimeline:
    """Simulate the plan's step (module docstring); its span equals `plan.predicted.step_time_s`."""
    strategy, predicted = plan.strategy, plan.predicted
    p, v, m = strategy.pp, strategy.virtual_stages, strategy.num_microbatches
    stages = predicted.stages
    if len(stages) != p:
        raise UserError(f"plan has {len(stages)} stage estimates for pp={p}; it is malformed")
    bd = predicted.breakdown
    fwd = [s.fwd_s for s in stages]
    bwd = [s.bwd_s for s in stages]
    wgrad = [s.wgrad_s for s in stages] if strategy.schedule.zero_bubble else None
    try:
        p2p_s = fit_p2p_time(fwd, bwd, strategy.schedule, m, v, bd.pp_comm_s, wgrad)
        times = simulate_pipeline(fwd, bwd, strategy.schedule, m, v, p2p_s, wgrad)
    except ValueError as e:
        raise UserError(f"cannot simulate the plan's schedule: {e}") from None
    simulated_s = pipeline_span(times)
    pipeline_s = predicted_pipeline_s(plan)
    tail_start = max(simulated_s, pipeline_s)

    tp_share = _share(bd.tp_comm_s, bd)
    recompute = _recompute_per_virtual_stage(plan)
    end_comm_s = max(predicted.step_time_s - pipeline_s - bd.optimizer_s, 0.0)
    events: list[TimelineEvent] = []
    for d in range(p):
        ops = schedule_order(strategy.schedule, p, m, v, d)
        receive = [receives(op, strategy.schedule, p, v) for op in ops]
        events += _op_events(d, ops, times, [p2p_s if r else 0.0 for r in receive], fwd[d] / v, v, tp_share,
                             recompute, bd)
        events += _gap_events(d, ops, times)
        events += _tail_events(d, own_end=times[ops[-1]][1], simulated_end=simulated_s, pipeline_end=tail_start,
                               end_comm_s=end_comm_s, optimizer_s=bd.optimizer_s)
    events.sort(key=lambda e: (e.stage, e.start_s, e.depth))
    labels = tuple(f"stage {s.index} ({s.device}, segments {segment_range(s.start, s.stop)})" for s in stages)
    gap = tail_start - pipeline_s
    return StepTimeline(events=tuple(events), stage_labels=labels, step_time_s=predicted.step_time_s,
                        simulated_pipeline_s=simulated_s, closed_form_pipeline_s=pipeline_s, p2p_s=p2p_s,
                        model_gap_s=gap if gap > _GAP_TOL * max(pipeline_s, 1e-30) else 0.0)


def _share(part_s: float, bd: TimeBreakdown) -> float:
    """Fraction of an operation's time that `part_s` is, from the critical-path breakdown."""
    work = bd.compute_s + bd.recompute_s + bd.tp_comm_s
    return part_s / work if work > 0 else 0.0


def _recompute_per_virtual_stage(plan: Plan) -> tuple[Recompute, ...]:
    strategy = plan.strategy
    if strategy.stages:
        return tuple(s.recompute for s in strategy.stages)
    return (strategy.recompute,) * (strategy.pp * strategy.virtual_stages)


def _op_events(d: int, ops: Sequence[PipelineOp], times: Mapping[PipelineOp, tuple[float, float]],
               recv_s: Sequence[float], chunk_fwd_s: float, virtual_stages: int, tp_share: float,
               recompute: Sequence[Recompute], bd: TimeBreakdown) -> list[TimelineEvent]:
    """Per operation: the blocking receive (`recv_s`, per operation), then the forward/backward with its nested
    recompute and TP parts; a weight-gradient operation is its own event."""
    events: list[TimelineEvent] = []
    for op, recv in zip(ops, recv_s, strict=True):
        start, end = times[op]
        s, j = op.virtual_stage, op.microbatch
        if recv > 0:
            what = "activations" if op.forward else "gradients"
            events.append(TimelineEvent(d, EventKind.PP_COMM, f"recv {what}", start, recv, j, s))
            start += recv
        duration = end - start
        name = ("F" if op.forward else op.part.value) + f"{j}" + (f" v{s}" if virtual_stages > 1 else "")
        weight = op.part is BackwardPart.WEIGHT
        kind = EventKind.FORWARD if op.forward else EventKind.WEIGHT_GRAD if weight else EventKind.BACKWARD
        events.append(TimelineEvent(d, kind, name, start, duration, j, s))
        if weight:
            continue
        tp_s = duration * tp_share
        if not op.forward and bd.recompute_s > 0 and s < len(recompute):
            rc_s = min(_recompute_time(recompute[s], chunk_fwd_s, duration, bd), max(duration - tp_s, 0.0))
            if rc_s > 0:
                events.append(TimelineEvent(d, EventKind.RECOMPUTE, f"recompute ({recompute[s].value})", start,
                                            rc_s, j, s, depth=1))
        if tp_s > 0:
            events.append(TimelineEvent(d, EventKind.TP_COMM, "tensor-parallel comm", end - tp_s, tp_s, j, s,
                                        depth=1))
    return events


def _recompute_time(mode: Recompute, chunk_fwd_s: float, bwd_s: float, bd: TimeBreakdown) -> float:
    if mode is Recompute.FULL:
        return chunk_fwd_s  # full recomputation re-runs the chunk's forward, its communication included
    if mode is Recompute.SELECTIVE:
        return (chunk_fwd_s + bwd_s) * _share(bd.recompute_s, bd)
    return 0.0


def _gap_events(d: int, ops: Sequence[PipelineOp],
                times: Mapping[PipelineOp, tuple[float, float]]) -> list[TimelineEvent]:
    """Idle time between a rank's operations (the pipeline bubble as this rank sees it)."""
    events: list[TimelineEvent] = []
    prev_end = 0.0
    for op in ops:
        start, end = times[op]
        if start - prev_end > _REL_TOL * max(start, 1e-30):
            events.append(TimelineEvent(d, EventKind.IDLE, "idle (bubble)", prev_end, start - prev_end))
        prev_end = end
    return events


def _tail_events(d: int, *, own_end: float, simulated_end: float, pipeline_end: float, end_comm_s: float,
                 optimizer_s: float) -> list[TimelineEvent]:
    """The drain until the last rank is done, slack up to the predicted pipeline end, then the end-of-step
    communication and the optimizer step (all ranks together, as the closed form counts them)."""
    events: list[TimelineEvent] = []
    if simulated_end - own_end > _REL_TOL * simulated_end:
        events.append(TimelineEvent(d, EventKind.IDLE, "idle (bubble)", own_end, simulated_end - own_end))
    if pipeline_end - simulated_end > _REL_TOL * pipeline_end:
        events.append(TimelineEvent(d, EventKind.IDLE, "schedule slack", simulated_end,
                                    pipeline_end - simulated_end))
    t = pipeline_end
    if end_comm_s > 0:
        events.append(TimelineEvent(d, EventKind.DP_COMM, "end-of-step comm (exposed)", t, end_comm_s))
        t += end_comm_s
    if optimizer_s > 0:
        events.append(TimelineEvent(d, EventKind.OPTIMIZER, "optimizer step", t, optimizer_s))
    return events


def timeline_to_chrome(timeline: StepTimeline, *, title: str = "stratagem plan") -> dict[str, Any]:
    """Chrome trace-event JSON (the format chrome://tracing and ui.perfetto.dev open): one process, one thread
    (track) per stage, complete ("X") events with times in microseconds."""
    trace: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                                    "args": {"name": title}}]
    for d, label in enumerate(timeline.stage_labels):
        trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": label}})
        trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d, "args": {"sort_index": d}})
    for e in timeline.events:
        args: dict[str, Any] = {"duration_s": e.duration_s}
        if e.microbatch is not None:
            args["microbatch"] = e.microbatch
        if e.virtual_stage is not None:
            args["virtual_stage"] = e.virtual_stage
        # Nanosecond resolution: ends that are equal up to float rounding (a nested slice and its parent) print
        # equal, so viewers see proper nesting.
        ts = round(e.start_s * 1e6, 3)
        dur = round(round(e.end_s * 1e6, 3) - ts, 3)
        trace.append({"name": e.name, "cat": e.kind.value, "ph": "X", "pid": 0, "tid": e.stage,
                      "ts": ts, "dur": dur, "args": args})
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            "step_time_s": timeline.step_time_s,
            "simulated_pipeline_s": timeline.simulated_pipeline_s,
            "closed_form_pipeline_s": timeline.closed_form_pipeline_s,
            "p2p_s": timeline.p2p_s,
            "model_gap_s": timeline.model_gap_s,
        },
    }


def segment_range(start: int, stop: int) -> str:
    """Segments [start, stop) as people write them: "4-7", or "3" for one segment."""
    return str(start) if stop - start == 1 else f"{start}-{stop - 1}"


def plan_title(plan: Plan) -> str:
    s = plan.strategy
    schedule = s.schedule.label(s.virtual_stages)
    step = plan.predicted.step_time_s
    step_text = f"{step:.4g} s" if step >= 1 else f"{step * 1e3:.4g} ms"
    return (f"{plan.model.name}: dp={s.dp} tp={s.tp} pp={s.pp} mbs={s.microbatch_size} "
            f"m={s.num_microbatches} {schedule}, step {step_text}")


def write_timeline(plan: Plan, path: str | Path) -> None:
    """Write the plan's simulated step as Chrome/Perfetto trace JSON to `path`."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"cannot write timeline {path}: directory {path.parent} does not exist")
    trace = timeline_to_chrome(build_timeline(plan), title=plan_title(plan))
    path.write_text(json.dumps(trace, indent=None, separators=(",", ":")) + "\n")
