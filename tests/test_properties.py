"""Property tests (hypothesis) of the planner over random small GPT / Llama configs, clusters and batches.

For every drawn (model, cluster, global batch):

- every returned plan satisfies its own invariants: the degrees multiply to the devices it uses (no more than
  the cluster has) and the micro-batching to the global batch; its stages cover every layer-chain segment once,
  in order; every stage's predicted peak memory is within its device's capacity; the step time is the sum of its
  breakdown, equals what the search predicted, and is at least the compute lower bound (the step's FLOPs at the
  dense peak of the used devices, computed here from the traced graph);
- the plan's JSON round-trips (`Plan.from_json(p.to_json()) == p`, and the text is a fixed point);
- more memory per device never makes the best step time worse, and a capacity at which the best plan fits gives
  exactly its time; when nothing fits, the "least memory any strategy needs" the error states is right: a
  hundredth of a GiB more fits, a hundredth less does not;
- more devices (more in a node, or twice the nodes) never make the best step time worse.

Cost control: each model is traced once, each (model, cluster) gets one `LayerCostTable` (the sharding solves are
the expensive part), each search result is cached; the memory variants share their cluster's table, since layer
prices do not depend on capacity. Hypothesis is derandomized (same examples every run) with no database.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ir
from costmodel.hardware.cluster import Cluster
from costmodel.memory import GIB, framework_overhead_bytes
from ir.layer_chain import LayerChain
from models.registry import build_model
from planner.errors import InfeasibleError
from planner.plan import ModelInfo, Plan, SearchInfo, TrainingConfig
from planner.search.branch_and_bound import SearchOptions, SearchResult, search
from planner.search.layer_costs import LayerCostTable

pytestmark = pytest.mark.slow

REL = 1e-9
"""Relative slack for comparing step times computed along different float summation orders."""

CLUSTERS = ("1x1xcpu", "1x2xcpu", "1x4xcpu", "1x2xa100-80gb", "2x2xa100-80gb", "1x4xt4")
MORE_DEVICES = (("1x1xcpu", "1x2xcpu"), ("1x2xcpu", "1x4xcpu"), ("1x2xa100-80gb", "1x4xa100-80gb"),
                ("1x2xa100-80gb", "2x2xa100-80gb"), ("2x2xa100-80gb", "4x2xa100-80gb"), ("1x4xt4", "2x4xt4"))
"""(smaller, larger) pairs: more devices in one node, or twice the nodes. The time search plans for every device,
for 2^i and 3 * 2^i whole nodes and for every count within a node (`planner.search.candidates.device_counts`), so
a cluster's search covers that of half its nodes; from 5 nodes to 7 it does not, by design."""


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def model_configs(draw: st.DrawFn) -> tuple[str, tuple[str, ...]]:
    """A tiny GPT or Llama: (family, sorted --set strings)."""
    family = draw(st.sampled_from(("gpt", "llama")))
    hidden, heads = draw(st.sampled_from(((32, 2), (64, 4))))
    sets = {"layers": draw(st.integers(1, 3)), "hidden": hidden, "heads": heads,
            "seq": draw(st.sampled_from((16, 32))), "vocab": 64}
    if family == "gpt":  # the explicit attention ops (QK^T, softmax, AV) instead of the fused SDPA node
        sets["attn_impl"] = draw(st.sampled_from(("sdpa", "math")))
    else:
        sets["kv_heads"] = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
        sets["ffn_hidden"] = 3 * hidden
    return family, tuple(sorted(f"{k}={v}" for k, v in sets.items()))


batches = st.integers(1, 8)


# ---- cached tracing, pricing and searching ---------------------------------------------------------------------

@cache
def chain_of(family: str, sets: tuple[str, ...]) -> LayerChain:
    built = build_model(family, sets, batch=1, device="meta")
    return ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=family))


@cache
def cluster_of(spec: str, memory_bytes: int | None = None) -> Cluster:
    cluster = Cluster.parse(spec)
    if memory_bytes is None:
        return cluster
    groups = tuple(dataclasses.replace(g, device=dataclasses.replace(g.device, memory_bytes=memory_bytes))
                   for g in cluster.groups)
    return dataclasses.replace(cluster, groups=groups)


@cache
def table_of(model: tuple[str, tuple[str, ...]], spec: str) -> LayerCostTable:
    return LayerCostTable(chain_of(*model), cluster_of(spec))


@cache
def best_of(model: tuple[str, tuple[str, ...]], spec: str, batch: int,
            memory_bytes: int | None = None) -> SearchResult | str:
    """The search result (the two best plans on the real cluster, the best one with `memory_bytes` per device),
    or the InfeasibleError message when nothing fits."""
    top_k = 2 if memory_bytes is None else 1
    try:
        return search(chain_of(*model), cluster_of(spec, memory_bytes), global_batch=batch,
                      options=SearchOptions(top_k=top_k), table=table_of(model, spec))
    except InfeasibleError as e:
        return str(e)


def capacity_at(model: tuple[str, tuple[str, ...]], spec: str, batch: int, fraction: float) -> int:
    """Memory per device: the framework overhead plus `fraction` of what the unconstrained best plan needs
    beyond it (the overhead dominates a tiny model's peak, so scaling the whole peak would only test it)."""
    native = best_of(model, spec, batch)
    assert not isinstance(native, str), native
    overhead = framework_overhead_bytes(cluster_of(spec).groups[0].device.name)
    peak = max(native.ranked[0].estimate.peak_memory_bytes)
    return overhead + int(fraction * (peak - overhead))


def best_time(model: tuple[str, tuple[str, ...]], spec: str, batch: int, memory_bytes: int | None = None) -> float:
    result = best_of(model, spec, batch, memory_bytes)
    return math.inf if isinstance(result, str) else result.ranked[0].estimate.step_time_s


def compute_lower_bound(chain: LayerChain, devices: Sequence, num_devices: int, batch: int) -> float:
    """No step beats its FLOPs spread evenly over the used devices, each at its dense bfloat16 peak."""
    graph = chain.graph
    flops = (graph.forward_flops + graph.backward_flops) * batch / graph.batch_size
    return flops / (num_devices * max(d.flops("bfloat16") for d in devices))


def plan_of(model: tuple[str, tuple[str, ...]], spec: str, batch: int, result: SearchResult, rank: int) -> Plan:
    """The `Plan` the API builds from a search result (public types only)."""
    chain, r = chain_of(*model), result.ranked[rank]
    return Plan(
        model=ModelInfo(name=model[0], fingerprint=ir.fingerprint(chain.graph), params=chain.graph.param_count,
                        settings=tuple(sorted(tuple(s.split("=", 1)) for s in model[1]))),
        cluster=cluster_of(spec).to_dict(),
        training=TrainingConfig(global_batch=batch, seq_len=chain.graph.seq_len),
        strategy=r.strategy, sharding=r.sharding, predicted=r.estimate,
        search=SearchInfo(time_s=result.time_s, candidates=result.candidates, status=result.status,
                          optimality_gap=result.optimality_gap,
                          lower_bound_s=r.estimate.step_time_s * (1 - result.optimality_gap),
                          alternatives=result.alternatives))


# ---- properties ------------------------------------------------------------------------------------------------

@_settings(150)
@given(model=model_configs(), spec=st.sampled_from(CLUSTERS), batch=batches)
def test_plans_satisfy_their_invariants_and_round_trip(model, spec, batch) -> None:
    result = best_of(model, spec, batch)
    assert not isinstance(result, str), f"tiny models always fit: {result}"
    chain, cluster = chain_of(*model), cluster_of(spec)
    assert result.status == "optimal" and result.optimality_gap == 0.0
    objectives = [r.objective for r in result.ranked]
    assert objectives == sorted(objectives)
    for rank, r in enumerate(result.ranked):
        s, est = r.strategy, r.estimate
        # degrees multiply to the devices used, micro-batching to the global batch
        assert s.dp * s.tp * s.pp * s.cp == s.num_devices <= cluster.num_available
        assert s.dp * s.microbatch_size * s.num_microbatches == batch
        assert len(est.stages) == s.pp
        # the stages cover every segment exactly once, in order
        assert len(s.stages) == s.pp * s.virtual_stages
        bounds = [(st_.start, st_.stop) for st_ in s.stages]
        assert bounds[0][0] == 0 and bounds[-1][1] == len(chain.segments)
        assert all(a < b for a, b in bounds)
        assert all(prev[1] == nxt[0] for prev, nxt in zip(bounds, bounds[1:], strict=False))
        # memory per stage within the capacity of the device it runs on
        memory = {g.device.name: g.device.memory_bytes for g in cluster.groups}
        assert est.fits and not est.problems
        for stage in est.stages:
            assert stage.capacity_bytes == memory[stage.device]
            assert 0 < stage.memory.total <= stage.capacity_bytes
        # step time: its breakdown, the search's own prediction, and above the compute lower bound
        assert est.step_time_s == pytest.approx(est.breakdown.total_s, rel=REL)
        assert r.predicted_step_time_s == pytest.approx(est.step_time_s, rel=REL)
        lower = compute_lower_bound(chain, [g.device for g in cluster.groups], s.num_devices, batch)
        assert est.step_time_s >= lower * (1 - REL)
        assert est.breakdown.compute_s >= lower * (1 - REL)
        # JSON round-trip
        plan = plan_of(model, spec, batch, result, rank)
        text = plan.to_json()
        again = Plan.from_json(text)
        assert again == plan
        assert again.to_json() == text


@_settings(100)
@given(model=model_configs(), spec=st.sampled_from(CLUSTERS), batch=batches,
       fractions=st.tuples(st.floats(0.0, 1.5), st.floats(0.0, 1.5)))
def test_more_memory_never_makes_the_best_plan_slower(model, spec, batch, fractions) -> None:
    native = best_of(model, spec, batch)
    assert not isinstance(native, str)
    peak = max(native.ranked[0].estimate.peak_memory_bytes)
    small, large = sorted(capacity_at(model, spec, batch, f) for f in fractions)
    t_native = native.ranked[0].estimate.step_time_s
    t_small, t_large = best_time(model, spec, batch, small), best_time(model, spec, batch, large)
    assert t_large <= t_small * (1 + REL)
    for mem, t in ((small, t_small), (large, t_large)):
        if mem >= peak:  # the unconstrained best fits: it is the best again
            assert t == pytest.approx(t_native, rel=REL)
        else:  # less memory than the best plan needs: never better than it
            assert t >= t_native * (1 - REL)


@_settings(25)
@given(model=model_configs(), spec=st.sampled_from(CLUSTERS), batch=batches, fraction=st.floats(0.0, 0.9))
def test_nothing_fits_names_the_least_memory_that_would(model, spec, batch, fraction) -> None:
    # below what the best plan needs: sometimes another plan fits (recomputation, ZeRO, more stages), sometimes
    # nothing does and the error must say how much memory would be enough
    message = best_of(model, spec, batch, capacity_at(model, spec, batch, fraction))
    if not isinstance(message, str):
        return
    match = re.search(r"least memory any strategy needs is ([0-9.]+) GiB per device", message)
    assert match, message
    need = float(match[1]) * GIB  # printed with two decimals
    step = 0.01 * GIB
    assert not isinstance(best_of(model, spec, batch, int(need + step)), str), message
    assert isinstance(best_of(model, spec, batch, int(need - step)), str), message


@_settings(25)
@given(model=model_configs(), pair=st.sampled_from(MORE_DEVICES), batch=batches)
def test_more_devices_never_make_the_best_plan_slower(model, pair, batch) -> None:
    fewer, more = pair
    assert cluster_of(more).num_devices > cluster_of(fewer).num_devices
    assert best_time(model, more, batch) <= best_time(model, fewer, batch) * (1 + REL)
