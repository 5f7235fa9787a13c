"""Multi-tier networks: with a cross-datacenter link at 1/100 of the in-datacenter bandwidth, the
communication-heavy axes stay inside the fast tiers -- tensor parallelism inside a node, data parallelism inside a
datacenter -- and only pipeline sends cross the slow link; the mesh-order search is what finds this."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster, Strategy
from planner import api
from planner.search.branch_and_bound import search
from planner.search.device_groups import axis_tiers
from planner.search.meshes import DP_INSIDE_PP, PP_INSIDE_DP
from planner.search.space import SearchSpace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
# 39B parameters: 624 GB of mixed-precision Adam state does not fit in one datacenter of 8 x 80 GB, so both
# datacenters must be used; the question is only which traffic crosses between them.
SHAPE = GptShape(layers=12, hidden=16384, heads=128, seq=2048, vocab=32000, batch=1)


def two_datacenters(link: str) -> Cluster:
    return Cluster.from_dict({"name": "2dc", "groups": [{"device": "h100-sxm", "num_nodes": 2,
                                                         "devices_per_node": 8}],
                              "tiers": [{"name": "node"},
                                        {"name": "datacenter", "size": 8, "bandwidth": "400Gbps"},
                                        {"name": "interconnect", "size": 16, "bandwidth": link,
                                         "latency": "1ms"}]})


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE, attention="flash")


@pytest.fixture(scope="module")
def slow_best(chain):
    return search(chain, two_datacenters("0.5GB/s"), global_batch=32).best


def test_axis_tiers_follow_the_mesh_order() -> None:
    cluster = two_datacenters("0.5GB/s")
    megatron = Strategy(dp=2, tp=4, pp=2, mesh_order=DP_INSIDE_PP)          # ranks: tp, then dp, then pp
    assert axis_tiers(cluster, megatron) == {"tp": "node", "cp": None, "dp": "node", "pp": "interconnect"}
    inverted = Strategy(dp=2, tp=4, pp=2, mesh_order=PP_INSIDE_DP)          # pipelines inside, dp across
    assert axis_tiers(cluster, inverted) == {"tp": "node", "cp": None, "dp": "interconnect", "pp": "node"}
    # Every stage boundary counts: with 4 stages of 4 ranks only the middle boundary crosses datacenters.
    deep = Strategy(dp=1, tp=4, pp=4)
    assert axis_tiers(cluster, deep)["pp"] == "interconnect"


def test_slow_cross_datacenter_link_carries_only_pipeline_traffic(chain, slow_best) -> None:
    slow = two_datacenters("0.5GB/s")   # 1/100 of the 50 GB/s (400 Gb/s) NIC inside a datacenter
    assert slow.tiers[2].bandwidth == pytest.approx(slow.tiers[1].bandwidth / 100)
    best = slow_best
    s = best.strategy
    assert s.num_devices == 16 and best.estimate.fits
    tiers = axis_tiers(slow, s)
    assert tiers["pp"] == "interconnect"                                 # the only traffic crossing the slow link
    assert tiers["tp"] in (None, "node") and tiers["cp"] in (None, "node")
    assert tiers["dp"] in (None, "node", "datacenter")
    # A data-parallel strategy (the best one, or the best with dp pinned to 2 when the best has none) with the
    # rank order inverted sends the gradients across the slow link instead: much slower.
    paired = best if s.dp > 1 else search(chain, slow, global_batch=32, space=SearchSpace(dp=2)).best
    t = paired.strategy
    assert t.dp > 1 and t.pp > 1 and axis_tiers(slow, t)["pp"] == "interconnect"
    order = PP_INSIDE_DP if t.mesh_order == DP_INSIDE_PP else DP_INSIDE_PP
    inverted = dataclasses.replace(t, mesh_order=order)
    assert axis_tiers(slow, inverted)["dp"] == "interconnect"
    assert api.estimate(chain, slow, inverted).step_time_s > 2 * paired.estimate.step_time_s


def test_a_fast_link_lets_gradients_cross(chain, slow_best) -> None:
    slow = slow_best
    fast_cluster = two_datacenters("50GB/s")                            # as fast as inside a datacenter
    fast = search(chain, fast_cluster, global_batch=32).best
    assert fast.estimate.step_time_s < slow.estimate.step_time_s
    assert axis_tiers(fast_cluster, fast.strategy)["dp"] == "interconnect"  # data parallelism now spans both


def test_example_two_datacenters_file_is_the_documented_shape() -> None:
    cluster = Cluster.parse(str(EXAMPLES / "two-datacenters.yaml"))
    names = [t.name for t in cluster.tiers]
    assert names == ["node", "datacenter", "interconnect"] and cluster.num_devices == 128
    dc, link = cluster.tiers[1], cluster.tiers[2]
    assert link.bandwidth == pytest.approx(dc.bandwidth / 100) and link.latency == pytest.approx(1e-3)
