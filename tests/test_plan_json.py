"""The Plan JSON contract of DESIGN.md on real plans: keys scripts rely on, strict loading, round trips."""

from __future__ import annotations

import copy
import json

import pytest

import ir
import planner.api
from costmodel.hardware.cluster import Cluster
from models.registry import build_model
from planner.api import estimate, estimate_plan
from planner.errors import PlanLoadError
from planner.plan import SCHEMA_VERSION, Plan
from planner.search.space import SearchSpace

_CACHE: dict[str, Plan] = {}


def _chain():
    built = build_model("gpt", ["layers=4", "hidden=256", "heads=8", "vocab=1000", "seq=128"], batch=1,
                        device="meta")
    return built, ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=built.name))


def searched_plan() -> Plan:
    if "plan" not in _CACHE:
        built, chain = _chain()
        _CACHE["plan"] = planner.api.plan(chain, None, "2x4xa100-80gb", global_batch=32, model_name=built.name,
                                      settings=built.settings, space=SearchSpace(pp=2))
    return _CACHE["plan"]


def test_design_keys_are_present() -> None:
    d = searched_plan().to_dict()
    assert d["schema_version"] == SCHEMA_VERSION
    assert set(d) == {"schema_version", "model", "cluster", "training", "strategy", "predicted", "search"}
    assert {"name", "fingerprint", "params", "settings"} <= set(d["model"])
    assert d["model"]["settings"] == {"heads": 8, "hidden": 256, "layers": 4, "seq": 128, "vocab": 1000}
    assert {"global_batch", "seq_len", "dtype", "optimizer"} <= set(d["training"])
    s = d["strategy"]
    for key in ("dp", "tp", "pp", "microbatch_size", "num_microbatches", "schedule", "virtual_stages",
                "zero_stage", "sequence_parallel", "stages", "sharding"):
        assert key in s
    assert len(s["stages"]) == s["pp"] * s["virtual_stages"] == 2
    assert s["stages"][0]["start"] == 0 and s["stages"][-1]["stop"] == 6
    p = d["predicted"]
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "peak_memory_bytes", "breakdown"):
        assert key in p
    assert isinstance(p["peak_memory_bytes"], list) and len(p["peak_memory_bytes"]) == 2
    assert sum(p["breakdown"].values()) == pytest.approx(p["step_time_s"], rel=1e-9)
    assert {"time_s", "candidates", "status", "optimality_gap", "lower_bound_s", "alternatives"} <= set(d["search"])
    assert d["cluster"] == Cluster.parse("2x4xa100-80gb").to_dict()


def test_round_trip_is_lossless_and_deterministic() -> None:
    plan = searched_plan()
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    assert json.loads(text) == plan.to_dict()


def test_planner_estimate_of_the_plan_is_its_prediction() -> None:
    plan = searched_plan()
    _, chain = _chain()
    est = estimate(chain, Cluster.from_dict(plan.cluster), plan.strategy, global_batch=32)
    assert est.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    assert est.peak_memory_bytes == plan.predicted.peak_memory_bytes


def test_estimate_plan_is_fixed_and_fills_stages() -> None:
    built, chain = _chain()
    searched = searched_plan()
    fixed = estimate_plan(chain, "2x4xa100-80gb", type(searched.strategy)(dp=4, tp=2, pp=1, microbatch_size=2,
                                                                          num_microbatches=4),
                          global_batch=32, model_name=built.name)
    assert fixed.search.status == "fixed" and fixed.search.candidates == 1
    assert [(s.start, s.stop) for s in fixed.strategy.stages] == [(0, 6)]
    assert Plan.from_json(fixed.to_json()) == fixed


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(extra=1), "unknown key(s) in plan: extra"),
    (lambda d: d["strategy"].update(tpp=2), "unknown key(s) in strategy: tpp"),
    (lambda d: d.pop("search"), "missing key(s) in plan: search"),
    (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), "newer than this Stratagem reads"),
    (lambda d: d["strategy"].update(zero_stage=7), "zero_stage must be 0, 1, 2 or 3"),
])
def test_strict_loading(mutate, message: str) -> None:
    d = copy.deepcopy(searched_plan().to_dict())
    mutate(d)
    with pytest.raises(PlanLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Plan.from_json(json.dumps(d))


def test_truncated_file_is_a_plan_load_error() -> None:
    text = searched_plan().to_json()
    with pytest.raises(PlanLoadError, match="truncated or corrupt"):
        Plan.from_json(text[: len(text) // 2])
