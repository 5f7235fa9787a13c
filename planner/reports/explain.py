"""Why a plan is what it is: where its step time goes, which stage sets the pace, how close each stage is to its
memory capacity, and which strategies lost and by how much.

Everything here is read from the plan itself (its prediction and its search record), so `stratagem explain`
needs no model, cluster or tracing: the explanation of a plan file is reproducible anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from costmodel.breakdown import StageEstimate
from costmodel.validation import within_band
from planner.plan import Plan
from planner.reports.render import offload_text
from planner.reports.timeline import StepTimeline, segment_range
from planner.strategy_label import strategy_label

GIB = 1 << 30

BUBBLE_NOTE_SHARE = 0.10
"""Bubble share of the step above which `explain` suggests more micro-batches or interleaving."""

MEMORY_NOTE_HEADROOM = 0.05
"""Free fraction of a device's memory below which `explain` warns that the plan is close to running out."""

_BREAKDOWN_TERMS: tuple[tuple[str, str], ...] = (
    ("compute_s", "compute"),
    ("recompute_s", "recomputation"),
    ("tp_comm_s", "tensor-parallel comm (exposed)"),
    ("pp_comm_s", "pipeline send/recv (exposed)"),
    ("dp_comm_s", "data-parallel comm (exposed)"),
    ("bubble_s", "pipeline bubble"),
    ("optimizer_s", "optimizer step"),
    ("framework_s", "framework host work"),
    ("offload_s", "host-device copies (offload)"),
)
_COMM_TERMS = ("tp_comm_s", "pp_comm_s", "dp_comm_s")
_LEADING_MARGIN = re.compile(r"^[+-]?\d+(\.\d+)?% step time[:;,]?\s*")


@dataclass(frozen=True, slots=True)
class TermShare:
    key: str
    """Field of `TimeBreakdown` ("compute_s", ...), or "comm_total" for all exposed communication."""
    label: str
    seconds: float
    share: float
    """Fraction of the step time."""

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "label": self.label, "seconds": self.seconds, "share": self.share}


@dataclass(frozen=True, slots=True)
class StageRow:
    index: int
    segments: str
    device: str
    fwd_s: float
    bwd_s: float
    peak_bytes: int
    capacity_bytes: int
    largest_part: str
    """The biggest term of the stage's memory (params, grads, optimizer, activations, temporary, overhead)."""

    @property
    def utilization(self) -> float:
        return self.peak_bytes / self.capacity_bytes if self.capacity_bytes else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "segments": self.segments, "device": self.device, "fwd_s": self.fwd_s,
                "bwd_s": self.bwd_s, "peak_bytes": self.peak_bytes, "capacity_bytes": self.capacity_bytes,
                "utilization": self.utilization, "largest_part": self.largest_part}


@dataclass(frozen=True, slots=True)
class LostAlternative:
    summary: str
    step_time_s: float | None
    """None when it does not fit or is invalid."""
    delta_pct: float | None
    """Step time relative to the chosen plan, in percent."""
    reason: str
    tie: bool = False
    """Within the plan's validated error band: the model cannot rank it against the plan."""

    def describe(self) -> str:
        if self.step_time_s is None:
            return f"{self.summary}: {self.reason or 'infeasible'}"
        tie = "tie, " if self.tie else ""
        text = f"{self.summary}: {tie}{self.delta_pct:+.1f}% step time ({_seconds(self.step_time_s)})"
        # The search's reason often leads with the same margin ("+5.1% step time: ..."); say it once.
        reason = _LEADING_MARGIN.sub("", self.reason)
        return text + (f": {reason}" if reason else "")

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "step_time_s": self.step_time_s, "delta_pct": self.delta_pct, "tie": self.tie,
                "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Explanation:
    title: str
    strategy: str
    step_time_s: float
    terms: tuple[TermShare, ...]
    """The breakdown terms in a fixed order, then the exposed-communication total."""
    bottleneck_stage: int
    bottleneck: str
    stages: tuple[StageRow, ...]
    tightest_stage: int
    alternatives: tuple[LostAlternative, ...]
    """All of the plan's recorded alternatives, fastest first, then those that do not fit."""
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "strategy": self.strategy, "step_time_s": self.step_time_s,
                "breakdown": [t.to_dict() for t in self.terms], "bottleneck_stage": self.bottleneck_stage,
                "bottleneck": self.bottleneck, "stages": [s.to_dict() for s in self.stages],
                "tightest_stage": self.tightest_stage,
                "alternatives": [a.to_dict() for a in self.alternatives], "problems": list(self.problems),
                "notes": list(self.notes)}


def explain_plan(plan: Plan, *, timeline: StepTimeline | None = None) -> Explanation:
    """Read the plan's prediction and search record into an `Explanation` (`timeline`, when given, adds a note
    if the event simulation and the closed form disagree)."""
    predicted = plan.predicted
    step = predicted.step_time_s
    bd = predicted.breakdown.to_dict()
    # offload_s only where the plan offloads (older plans and the rest have no such term).
    terms = [TermShare(k, label, bd[k], bd[k] / step if step > 0 else 0.0) for k, label in _BREAKDOWN_TERMS
             if k in bd]
    comm = sum(bd[k] for k in _COMM_TERMS)
    terms.append(TermShare("comm_total", "all exposed communication", comm, comm / step if step > 0 else 0.0))

    rows = tuple(_stage_row(s) for s in predicted.stages)
    bottleneck = _bottleneck(predicted.stages)
    tightest = max(range(len(rows)), key=lambda i: (rows[i].utilization, -i)) if rows else 0
    lost = sorted((_lost(a.summary, a.step_time_s, a.reason, step, predicted.error_band)
                   for a in plan.search.alternatives),
                  key=lambda a: (a.step_time_s is None, a.step_time_s or 0.0))
    model = plan.model
    cluster_name = plan.cluster.get("name", "the cluster")
    seq = f", seq {plan.training.seq_len}" if plan.training.seq_len else ""
    title = (f"Plan for {model.name} ({_count(model.params)} parameters) on {cluster_name}, "
             f"global batch {plan.training.global_batch}{seq}")
    return Explanation(
        title=title, strategy=strategy_label(plan.strategy), step_time_s=step, terms=tuple(terms),
        bottleneck_stage=bottleneck, bottleneck=_bottleneck_text(predicted.stages, bottleneck, plan),
        stages=rows, tightest_stage=tightest, alternatives=tuple(lost), problems=predicted.problems,
        notes=tuple(_notes(plan, rows, timeline)))


def _stage_row(s: StageEstimate) -> StageRow:
    parts = {k: v for k, v in s.memory.to_dict().items() if k != "host"}  # host memory is not the device's
    largest = max(sorted(parts), key=lambda k: parts[k])
    return StageRow(index=s.index, segments=segment_range(s.start, s.stop), device=s.device, fwd_s=s.fwd_s,
                    bwd_s=s.bwd_s, peak_bytes=s.memory.total, capacity_bytes=s.capacity_bytes,
                    largest_part=largest)


def _bottleneck(stages: Sequence[StageEstimate]) -> int:
    """The stage with the most work per micro-batch (the first one on a tie): it sets the pipeline's pace."""
    if not stages:
        return 0
    return max(range(len(stages)), key=lambda i: (stages[i].fwd_s + stages[i].bwd_s, -i))


def _bottleneck_text(stages: Sequence[StageEstimate], i: int, plan: Plan) -> str:
    if not stages:
        return "no stages"
    s = stages[i]
    work = s.fwd_s + s.bwd_s
    text = (f"stage {i} (segments {segment_range(s.start, s.stop)}, {s.device}): {_seconds(work)} per micro-batch "
            f"(forward {_seconds(s.fwd_s)} + backward {_seconds(s.bwd_s)})")
    if len(stages) == 1:
        return text + "; a single stage, so no pipeline bubble"
    mean = sum(t.fwd_s + t.bwd_s for t in stages) / len(stages)
    over = (work / mean - 1) * 100 if mean > 0 else 0.0
    m = plan.strategy.num_microbatches
    return (text + f", {over:.1f}% above the mean stage; the other {m - 1} micro-batch(es) of the steady state "
            "run at its pace")


def _lost(summary: str, step_time_s: float | None, reason: str, best_s: float, band: float) -> LostAlternative:
    delta = (step_time_s / best_s - 1) * 100 if step_time_s is not None and best_s > 0 else None
    tie = (step_time_s is not None and band > 0
           and within_band(max(step_time_s, best_s), min(step_time_s, best_s), band))
    return LostAlternative(summary, step_time_s, delta, reason, tie)


def _notes(plan: Plan, rows: Sequence[StageRow], timeline: StepTimeline | None) -> list[str]:
    notes: list[str] = []
    predicted, s = plan.predicted, plan.strategy
    offloaded = offload_text(s, predicted)
    if offloaded:
        notes.append(offloaded)
    step = predicted.step_time_s
    bubble = predicted.breakdown.bubble_s / step if step > 0 else 0.0
    if s.pp > 1 and bubble > BUBBLE_NOTE_SHARE:
        v = s.virtual_stages
        notes.append(f"the pipeline bubble is {bubble:.0%} of the step; with equal stages it is (p-1)/(v m) = "
                     f"{(s.pp - 1) / (v * s.num_microbatches):.0%} of the ideal time (Narayanan et al., SC'21), "
                     "so more micro-batches or more virtual stages per device would shrink it")
    for r in rows:
        if r.peak_bytes > r.capacity_bytes:
            notes.append(f"stage {r.index} needs {r.peak_bytes / GIB:.2f} GiB, more than its "
                         f"{r.capacity_bytes / GIB:.2f} GiB")
        elif r.capacity_bytes and 1 - r.utilization < MEMORY_NOTE_HEADROOM:
            notes.append(f"stage {r.index} uses {r.utilization:.1%} of its memory: little headroom for "
                         "allocator fragmentation")
    if timeline is not None and timeline.model_gap_s > 0:
        notes.append(f"an event simulation of the {s.schedule.value} schedule takes {timeline.model_gap_s:.4g} s "
                     "longer than the cost model's closed form (uneven stages); the timeline shows the simulation")
    return notes


# ---------------------------------------------------------------------------------------------- rendering


def _count(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def _seconds(x: float) -> str:
    return f"{x * 1e3:.4g} ms" if abs(x) < 1 else f"{x:.4g} s"


def render_explanation(e: Explanation, plan: Plan, *, max_alternatives: int = 5) -> str:
    p = plan.predicted
    rate = (f"{p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s is not None else f"{p.samples_per_s:,.1f} samples/s")
    lines = [e.title, f"Strategy: {e.strategy}",
             f"Predicted: step {_seconds(e.step_time_s)}, {rate}, {p.model_tflops_per_device:.1f} TFLOP/s per "
             f"device, MFU {p.mfu:.1%}, {'fits' if p.fits else 'DOES NOT FIT'}", "",
             "Where the step time goes:"]
    width = max(len(t.label) for t in e.terms)
    for t in e.terms:
        if t.key == "comm_total":
            lines.append(f"  {'-' * (width + 22)}")
        lines.append(f"  {t.label:<{width}}  {_seconds(t.seconds):>10}  {t.share:>6.1%}")
    lines += ["", f"Bottleneck: {e.bottleneck}", "", "Memory per stage (peak per device vs capacity):",
              f"  {'stage':>5}  {'segments':>9}  {'device':<12} {'peak':>11}  {'capacity':>11}  {'used':>6}  "
              "largest part"]
    for r in e.stages:
        mark = "  <- tightest" if r.index == e.tightest_stage and len(e.stages) > 1 else ""
        lines.append(f"  {r.index:>5}  {r.segments:>9}  {r.device:<12} {r.peak_bytes / GIB:>7.2f} GiB  "
                     f"{r.capacity_bytes / GIB:>7.2f} GiB  {r.utilization:>6.1%}  {r.largest_part}{mark}")
    if e.alternatives:
        lines += ["", "Alternatives that lost:"]
        lines += [f"  {a.describe()}" for a in e.alternatives[:max_alternatives]]
        if len(e.alternatives) > max_alternatives:
            lines.append(f"  ... and {len(e.alternatives) - max_alternatives} more (--json lists them all)")
    else:
        lines += ["", "Alternatives that lost: none recorded (a fixed strategy, or the only candidate)"]
    if e.problems:
        lines += ["", "Problems:"] + [f"  - {x}" for x in e.problems]
    if e.notes:
        lines += ["", "Notes:"] + [f"  - {x}" for x in e.notes]
    return "\n".join(lines) + "\n"
