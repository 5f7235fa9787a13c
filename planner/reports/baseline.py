"""The best plan beside the configuration a team runs today (`stratagem plan --baseline TRAINER:FILE`): the
predicted gain and what changes, as text and JSON."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from planner.plan import Plan
from planner.reports.diff import diff_plans, render_text
from planner.strategy_label import strategy_label


def gain(baseline: Plan, plan: Plan) -> dict[str, Any]:
    """Speed-up of `plan` over `baseline` (step time ratio) and the step-time and MFU of both."""
    b, p = baseline.predicted, plan.predicted
    return {"baseline_step_time_s": b.step_time_s, "plan_step_time_s": p.step_time_s,
            "speedup": b.step_time_s / p.step_time_s if p.step_time_s else None,
            "step_time_change": p.step_time_s / b.step_time_s - 1 if b.step_time_s else None,
            "baseline_mfu": b.mfu, "plan_mfu": p.mfu, "baseline_fits": b.fits}


def render_baseline(baseline: Plan, plan: Plan, source: str) -> str:
    """Text printed after the plan: the baseline in one line, the predicted gain, then the diff."""
    g = gain(baseline, plan)
    fits = "" if baseline.predicted.fits else " (DOES NOT FIT: " + "; ".join(baseline.predicted.problems) + ")"
    band = plan.predicted.error_band
    within = (f"; within the ± {100 * band:.0f}% error band, a tie" if band and abs(g["step_time_change"]) <= band
              else "")
    lines = [f"baseline {source}: {strategy_label(baseline.strategy)}{fits}",
             f"  step {baseline.predicted.step_time_s:.4g} s, MFU {100 * baseline.predicted.mfu:.1f}%",
             f"predicted gain: {g['speedup']:.2f}x ({100 * g['step_time_change']:+.1f}% step time, MFU "
             f"{100 * g['baseline_mfu']:.1f}% -> {100 * g['plan_mfu']:.1f}%){within}",
             "what changes from the baseline to the plan:"]
    full = diff_plans(baseline, plan, old_label="baseline", new_label="plan")
    # The search record (status, candidates, runner-ups) differs by construction: a baseline is not searched.
    kept = tuple(c for c in full.changes if c.section != "search" and not c.field.startswith("search."))
    diff = render_text(replace(full, changes=kept))
    lines += ["  " + line for line in diff.splitlines()] or ["  nothing: the baseline is the plan"]
    return "\n".join(lines)
