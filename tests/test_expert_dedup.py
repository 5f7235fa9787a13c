"""Deduplicated expert-parallel dispatch (`RuntimeOptions.ep_dedup`, `costmodel.expert_parallel`): a token crosses
the inter-node network once per node it reaches, bounded by group-limited routing, checked against closed forms
computed here from the routing's configuration."""

from __future__ import annotations

import math

import pytest

import ir
from costmodel.expert_parallel import dedup_tier_scale, node_reach
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time, spans
from costmodel.strategy import RuntimeOptions, Strategy
from ir.moe_structure import ExpertLayout, RoutedExperts, routed_experts
from models.registry import build_model
from planner.runtime.parallelize import runtime_unsupported
from planner.search.layer_costs import AxisSplit, LayerCostTable
from planner.search.space import SearchSpace


def _routing(experts: int, k: int, groups: int = 1, top_groups: int = 1) -> RoutedExperts:
    return RoutedExperts(experts, k, ExpertLayout.STACKED, (), (), 0, num_groups=groups, top_groups=top_groups)


def test_node_reach_under_uniform_and_group_limited_routing():
    # DeepSeek-V3 (256 experts, top 8, 8 groups, top 4 groups) on 8 nodes: 4 of 8 groups, one group per node.
    assert node_reach(_routing(256, 8, 8, 4), 8) == pytest.approx(1 - math.comb(7, 4) / math.comb(8, 4))
    assert node_reach(_routing(256, 8, 8, 4), 8) == pytest.approx(0.5)
    # Without the group limit the 8 choices spread over all experts: a node holds 32 of 256.
    assert node_reach(_routing(256, 8), 8) == pytest.approx(1 - math.comb(224, 8) / math.comb(256, 8))
    # Groups that do not align with the nodes (8 groups over 16 nodes) bound nothing: uniform over experts.
    assert node_reach(_routing(256, 8, 8, 4), 16) == pytest.approx(1 - math.comb(240, 8) / math.comb(256, 8))
    # Two groups per node (16 groups, 8 nodes): a node is missed when both of its groups are.
    assert node_reach(_routing(256, 8, 16, 4), 8) == pytest.approx(1 - math.comb(14, 4) / math.comb(16, 4))


def test_tier_scale_and_the_deduplicated_all_to_all_time():
    cluster = Cluster.parse("8x8xh800")
    found, group = _routing(256, 8, 8, 4), CommGroup(64)
    nodes, per_node, q = 8, 8, 0.5
    assert dedup_tier_scale(found, group, cluster) == pytest.approx((nodes, nodes * q / 8))
    assert dedup_tier_scale(found, CommGroup(8), cluster) == ()  # one node: nothing crosses it
    # Closed form: latency + the slower tier of NVLink (P - 1) / P S and the NIC (N - 1) q / k S.
    s = 1e8
    nvlink, nic = spans(group, cluster)
    expected = (nvlink.steps * nvlink.latency + nic.steps * nic.latency
                + max((per_node - 1) / per_node * s / nvlink.bandwidth, (nodes - 1) * q / 8 * s / nic.bandwidth))
    scale = dedup_tier_scale(found, group, cluster)
    assert collective_time(Collective.ALL_TO_ALL, s, group, cluster, tier_scale=scale) == pytest.approx(expected)
    plain = collective_time(Collective.ALL_TO_ALL, s, group, cluster)
    assert plain == pytest.approx(nvlink.steps * nvlink.latency + nic.steps * nic.latency
                                  + max((per_node - 1) / 64 * s / nvlink.bandwidth,
                                        (nodes - 1) * per_node / 64 * s / nic.bandwidth))


def test_a_traced_model_prices_the_deduplicated_dispatch_over_nodes():
    """8 experts top-2 over 2 nodes of 4 (ep 8): the all-to-alls' price changes by the tier scale, nothing else."""
    built = build_model("moe", ("layers=1", "hidden=256", "ffn_hidden=512", "heads=4", "kv_heads=4", "vocab=1024",
                                "experts=8", "top_k=2"), seq=128)
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="moe"))
    block = next(s.index for s in chain.segments if routed_experts(chain.nodes_of(s)) is not None)
    cluster = Cluster.parse("2x4xh100")
    split = AxisSplit(ep=8, ep_stride=1, num_devices=8)

    def cost(dedup: bool):
        table = LayerCostTable(chain, cluster, ep_dedup=dedup)
        return table.segment_costs(cluster.device_of(0), tp=1, tp_stride=1, sequence_parallel=False,
                                   microbatch_size=1, split=split)[block]

    plain, dedup = cost(False), cost(True)
    found = routed_experts(chain.nodes_of(chain.segments[block]))
    assert (found.num_groups, found.top_groups) == (1, 1)
    rho = 2 * (1 - math.comb(4, 2) / math.comb(8, 2)) / 2  # N q / k
    assert dedup_tier_scale(found, CommGroup(8), cluster) == pytest.approx((2.0, rho))
    # The payload behind the plain price, recovered from it, priced again deduplicated.
    payload = _payload(plain.fwd_comm_s / 2, cluster)
    a2a = collective_time(Collective.ALL_TO_ALL, payload, CommGroup(8), cluster, tier_scale=(2.0, rho))
    assert dedup.fwd_comm_s == pytest.approx(2 * a2a, rel=1e-9)
    assert dedup.bwd_comm_s == pytest.approx(2 * a2a, rel=1e-9)
    assert dedup.fwd_compute_s == plain.fwd_compute_s and dedup.param_count == plain.param_count


def _payload(a2a_s: float, cluster: Cluster) -> float:
    """Bytes of a plain all-to-all over 8 ranks that takes `a2a_s` (bisection; time grows with the bytes)."""
    lo, hi = 0.0, 1e12
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if collective_time(Collective.ALL_TO_ALL, mid, CommGroup(8), cluster) < a2a_s else (lo, mid)
    return (lo + hi) / 2


def test_the_option_is_written_only_when_set_fixed_by_name_and_refused_by_this_runtime():
    plain, dedup = Strategy(dp=8, ep=8), Strategy(dp=8, ep=8, runtime=RuntimeOptions(ep_dedup=True))
    assert "ep_dedup" not in plain.to_dict()["runtime"] and dedup.to_dict()["runtime"]["ep_dedup"] is True
    assert Strategy.from_dict(dedup.to_dict()) == dedup
    assert SearchSpace.from_fixes(["ep_dedup=true"]).runtime.ep_dedup
    assert "ep_dedup" in runtime_unsupported(dedup) and not runtime_unsupported(plain)
