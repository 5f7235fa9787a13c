"""Golden plans: plans/ holds plans of a few zoo models x clusters (plans/golden.yaml). Re-planning each must give
the committed plan exactly, except search.time_s; a change fails with `stratagem diff`'s report until the plans
are regenerated on purpose with `python scripts/regen_golden_plans.py`.

The committed plans are also real plans for the report tools: each must load, explain, and simulate to a
timeline whose span is the predicted step time.
"""

from __future__ import annotations

from pathlib import Path

import golden as regen  # tests/golden.py
import pytest

from planner.plan import Plan
from planner.reports.explain import explain_plan, render_explanation
from planner.reports.timeline import build_timeline

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = regen.load_manifest()
REGENERATE = "python scripts/regen_golden_plans.py"


def test_manifest_and_committed_files_agree():
    assert len(ENTRIES) >= 4, "plans/golden.yaml should hold a handful of model x cluster plans"
    committed = sorted(p.stem for p in (ROOT / "plans").glob("*.json"))
    assert committed == sorted(e.name for e in ENTRIES), f"plans/ and plans/golden.yaml disagree; run {REGENERATE}"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_golden_plan_is_unchanged(entry, tmp_path):
    fresh = regen.make_plan_json(entry, tmp_path)
    report = regen.stale_report(entry, fresh)
    assert report is None, (f"golden plan {entry.name} changed; if that is intended, run "
                            f"`{REGENERATE} {entry.name}` and commit plans/\n{report}")


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_golden_plan_explains_and_simulates(entry):
    plan = Plan.from_json(entry.path.read_text())
    assert plan.predicted.fits
    timeline = build_timeline(plan)
    assert timeline.num_stages == plan.strategy.pp
    assert timeline.model_gap_s == 0.0
    assert timeline.span_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    text = render_explanation(explain_plan(plan, timeline=timeline), plan)
    assert f"dp={plan.strategy.dp} tp={plan.strategy.tp} pp={plan.strategy.pp}" in text
