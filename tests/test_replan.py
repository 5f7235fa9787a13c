"""Re-planning after the cluster changed: a straggler, a failure; reuse of layer prices, the stickiness
knob, agreement with a search from scratch, and `stratagem replan`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster, StageSpec, Strategy
from costmodel.rank_layout import device_map
from planner import api
from planner.cli.main import main
from planner.errors import PlanLoadError
from planner.plan import Plan
from planner.scenarios.replan import (
    OptionKind,
    PlanningSession,
    ReplanScope,
    plan_distance,
    pricing_signature,
    replan,
)
from planner.search.branch_and_bound import search

SHAPE = GptShape(layers=12, hidden=1024, heads=16, seq=1024, vocab=128, batch=1)
BATCH = 32


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE, attention="flash")


@pytest.fixture(scope="module")
def nominal() -> Cluster:
    return Cluster.parse("1x4xa100-80gb")


@pytest.fixture(scope="module")
def planned(chain, nominal):
    """The old plan, made in a session that keeps its layer prices."""
    session = PlanningSession(chain)
    result = session.search(nominal, global_batch=BATCH)
    best = result.best
    info = api._model_info(chain, "gpt-test", ())
    plan = api._plan_of(chain, nominal, info, BATCH, "bfloat16", best.strategy, best.sharding, best.estimate,
                        api._search_info(result, best.estimate.step_time_s))
    return session, plan, result


def test_plan_distance_counts_changes() -> None:
    a = Strategy(dp=2, pp=2, microbatch_size=1, num_microbatches=4,
                 stages=(StageSpec(0, 5), StageSpec(5, 10)))
    assert plan_distance(a, a, 10) == 0
    assert plan_distance(a, dataclasses.replace(a, zero_stage=1), 10) == 1
    moved = dataclasses.replace(a, stages=(StageSpec(0, 3), StageSpec(3, 10)))
    assert plan_distance(a, moved, 10) == pytest.approx(2 / 10)       # segments 3 and 4 change stage
    recomputed = dataclasses.replace(a, stages=(StageSpec(0, 5, "full"), StageSpec(5, 10)))
    assert plan_distance(a, recomputed, 10) == pytest.approx(5 / 10)
    wider = Strategy(dp=4, pp=1, microbatch_size=1, num_microbatches=2, stages=(StageSpec(0, 10),))
    assert plan_distance(a, wider, 10) == pytest.approx(3 + 5 / 10)  # dp, pp, m; half the segments move


def test_pricing_signature_ignores_speed_failures_and_prices(nominal) -> None:
    sig = pricing_signature(nominal)
    assert pricing_signature(nominal.with_speed(1, 0.5)) == sig
    assert pricing_signature(nominal.with_speed(2, 0.0)) == sig
    priced = dataclasses.replace(nominal, groups=(dataclasses.replace(nominal.groups[0], price_per_device_hour=4.0),))
    assert pricing_signature(priced) == sig
    assert pricing_signature(nominal.with_tier("node", bandwidth=1e11)) != sig


def test_replan_after_a_straggler(chain, nominal, planned) -> None:
    session, old, _ = planned
    slow = nominal.with_speed(1, 0.5)
    solves = session.tables[pricing_signature(nominal)].solves
    fast = replan(old, chain, slow, session=session, stickiness=0.0)
    assert fast.warm_start and session.tables[pricing_signature(slow)].solves >= solves
    # The old plan priced on the new cluster, exactly as `planner.estimate` prices it.
    assert fast.kept is not None
    assert fast.kept.step_time_s == pytest.approx(api.estimate(chain, slow, old.strategy).step_time_s, rel=1e-12)
    assert fast.kept.step_time_s > old.predicted.step_time_s      # the straggler slows the old plan down
    # With no stickiness the fastest option is chosen, and the plan's prediction is its estimate.
    assert fast.chosen is fast.fastest
    assert all(fast.chosen.step_time_s <= o.step_time_s for o in fast.options)
    assert fast.plan.predicted.step_time_s == pytest.approx(
        api.estimate(chain, slow, fast.plan.strategy, global_batch=BATCH).step_time_s, rel=1e-12)
    assert fast.chosen.step_time_s < fast.kept.step_time_s
    # A large stickiness keeps the old plan (distance 0) since it is within the allowance.
    sticky = replan(old, chain, slow, session=session, stickiness=10.0)
    assert sticky.chosen.kind is OptionKind.KEEP and sticky.chosen.distance == 0
    assert sticky.plan.strategy == dataclasses.replace(old.strategy)
    assert {a.summary for a in sticky.plan.search.alternatives} >= {fast.fastest.label}


def test_neighbourhood_replan_is_cheaper_than_a_search_from_scratch(chain, nominal, planned) -> None:
    session, old, _ = planned
    slow = nominal.with_speed(1, 0.5)
    scratch = search(chain, slow, global_batch=BATCH)
    near = replan(old, chain, slow, session=session, stickiness=0.0)
    full = replan(old, chain, slow, session=session, stickiness=0.0, scope=ReplanScope.FULL)
    best = scratch.best.estimate.step_time_s
    assert full.fastest.step_time_s == pytest.approx(best, rel=1e-9)    # the full scope finds the optimum
    assert full.plan.search.status == "optimal"
    assert near.fastest.step_time_s >= best * (1 - 1e-9)               # nothing beats the optimum
    assert near.search.candidates < scratch.candidates                  # a smaller space: fewer partitions solved
    s = near.chosen.strategy
    assert (s.tp, s.cp, s.ep) == (old.strategy.tp, old.strategy.cp, old.strategy.ep)


def test_replan_after_a_failure_leaves_the_device_out(chain, nominal, planned) -> None:
    session, old, _ = planned
    failed = nominal.with_speed(2, 0.0)
    result = replan(old, chain, failed, session=session)
    assert result.kept is None                           # the old plan needs 4 devices, 3 are left
    used = [r for p in device_map(failed, result.plan.strategy) for r in p.ranks]
    assert 2 not in used and result.plan.strategy.num_devices <= 3
    assert result.plan.predicted.fits


def test_exclude_slowed_devices_on_request(chain, nominal, planned) -> None:
    session, old, _ = planned
    slow = nominal.with_speed(3, 0.25)
    result = replan(old, chain, slow, session=session, stickiness=0.0, exclude_slowed=True)
    excluded = [o for o in result.options if o.kind is OptionKind.EXCLUDE]
    assert len(excluded) == 1
    if result.chosen.kind is OptionKind.EXCLUDE:
        assert Cluster.from_dict(result.plan.cluster).speed_of(3) == 0.0
    assert all(o.kind is not OptionKind.EXCLUDE for o in replan(old, chain, slow, session=session).options)


def test_replan_refuses_a_plan_of_another_model(nominal, planned) -> None:
    _, old, _ = planned
    other = gpt_chain(dataclasses.replace(SHAPE, layers=6), attention="flash")
    with pytest.raises(PlanLoadError, match="another model"):
        replan(old, other, nominal)


# ---- the command line ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("replan")
    out = folder / "old.json"
    assert main(["plan", "gpt-tiny", "--cluster", "1x4xcpu", "--batch", "16", "-o", str(out)]) == 0
    (folder / "slow.yaml").write_text("name: cpu-slow\ngroups:\n  - device: cpu\n    num_nodes: 1\n"
                                      "    devices_per_node: 4\n    slowdown: {1: 0.5}\n")
    return out


def test_cli_replan_prints_changes_and_diff(plan_file: Path, capsys) -> None:
    slow = plan_file.parent / "slow.yaml"
    new = plan_file.parent / "new.json"
    capsys.readouterr()
    assert main(["replan", str(plan_file), "--cluster", str(slow), "-o", str(new)]) == 0
    out = capsys.readouterr().out
    assert "rank 1 (cpu #1): speed 1 -> speed 0.5" in out
    assert "old plan on the new cluster:" in out and "chosen:" in out and f"--- {plan_file}" in out
    replanned = Plan.from_json(new.read_text())
    assert replanned.cluster["name"] == "cpu-slow" and replanned.model == Plan.from_json(plan_file.read_text()).model
    assert main(["replan", str(plan_file), "--cluster", str(slow), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"plan", "changes", "kept_step_time_s", "fastest_step_time_s", "chosen", "diff"}
    assert data["fastest_step_time_s"] <= data["kept_step_time_s"]
    assert Plan.from_dict(data["plan"]).predicted.step_time_s >= data["fastest_step_time_s"]


@pytest.mark.parametrize(("argv", "message"), [
    (["--stickiness", "-1"], "expected a percentage >= 0"),
    (["--scope", "all"], "invalid choice: 'all'"),
])
def test_cli_replan_bad_flags(plan_file: Path, capsys, argv, message) -> None:
    assert main(["replan", str(plan_file), "--cluster", "1x4xcpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_replan_missing_plan(tmp_path: Path, capsys) -> None:
    assert main(["replan", str(tmp_path / "none.json"), "--cluster", "1x4xcpu"]) == 2
    assert "does not exist" in capsys.readouterr().err
