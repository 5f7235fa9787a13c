"""Collective costs: hand-computed closed forms on small synthetic clusters, hierarchical and strided groups,
sharing, algorithm choice, and the calibration against measured NCCL bus bandwidths."""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodel.hardware.catalog import get_device
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import (
    Algorithm,
    Collective,
    CommGroup,
    bus_bandwidth,
    collective_cost,
    collective_time,
    spans,
)
from costmodel.hardware.device_group import DeviceGroup
from costmodel.hardware.network import NetworkTier

US = 1e-6


def _cluster(nodes: int, per_node: int, *, b0: float = 100e9, a0: float = 1 * US, b1: float = 10e9,
             a1: float = 10 * US, in_network: float = 0.0, in_network_latency: float = 0.0) -> Cluster:
    """Round numbers: node links 100 GB/s and 1 us per step, NICs 10 GB/s and 10 us, efficiency 1."""
    group = DeviceGroup("g", get_device("h100-sxm"), nodes, per_node)
    return Cluster("t", (group,), (
        NetworkTier("node", per_node, b0, a0, in_network_reduction_efficiency=in_network,
                    in_network_reduction_latency=in_network_latency),
        NetworkTier("cluster", nodes * per_node, b1, a1)))


# ---- one tier: the textbook volumes ---------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "expected"), [
    # ring all-reduce: 2(n-1) steps, 2(n-1)/n * S
    (Collective.ALL_REDUCE, 6 * US + 2 * 3 / 4 * 1e8 / 100e9),
    # all-gather / reduce-scatter: n-1 steps, (n-1)/n * S
    (Collective.ALL_GATHER, 3 * US + 3 / 4 * 1e8 / 100e9),
    (Collective.REDUCE_SCATTER, 3 * US + 3 / 4 * 1e8 / 100e9),
    # all-to-all: n-1 pairwise steps, (n-1)/n * S leaves each device
    (Collective.ALL_TO_ALL, 3 * US + 3 / 4 * 1e8 / 100e9),
    # pipelined chain broadcast: n-1 steps, every device forwards S
    (Collective.BROADCAST, 3 * US + 1e8 / 100e9),
])
def test_single_node_closed_forms(kind, expected):
    c = _cluster(1, 4)
    cost = collective_cost(kind, 1e8, CommGroup(4), c)
    assert cost.time_s == pytest.approx(expected, rel=1e-12)
    assert cost.slowest_tier == "node" and cost.bottleneck_tier == "node"
    assert cost.algorithm in (Algorithm.RING, Algorithm.DIRECT)


def test_numbers_for_n_2_and_send_recv():
    c = _cluster(1, 4)
    assert collective_time("all_reduce", 1e9, CommGroup(2), c) == pytest.approx(2 * US + 1e9 / 100e9)
    assert collective_time("all_gather", 1e9, CommGroup(2), c) == pytest.approx(1 * US + 0.5e9 / 100e9)
    assert collective_time("send_recv", 1e9, CommGroup(2, stride=3), c) == pytest.approx(1 * US + 1e9 / 100e9)


def test_all_reduce_is_reduce_scatter_plus_all_gather_on_a_ring():
    c = _cluster(1, 8)
    for nbytes in (1e6, 1e8, 3e9):
        ar = collective_time(Collective.ALL_REDUCE, nbytes, CommGroup(8), c)
        rs = collective_time(Collective.REDUCE_SCATTER, nbytes, CommGroup(8), c)
        ag = collective_time(Collective.ALL_GATHER, nbytes, CommGroup(8), c)
        assert ar == pytest.approx(rs + ag, rel=1e-12)


def test_trivial_groups_and_empty_messages_cost_nothing():
    c = _cluster(2, 4)
    assert collective_time(Collective.ALL_REDUCE, 1e9, CommGroup(1), c) == 0.0
    assert collective_time(Collective.ALL_REDUCE, 0, CommGroup(8), c) == 0.0


# ---- several tiers ------------------------------------------------------------------------------------------------

def test_hierarchical_all_reduce_across_nodes():
    c = _cluster(4, 4)  # 16 ranks; node tier D=4 P=1, cluster tier D=4 P=4
    S = 1.6e8
    cost = collective_cost(Collective.ALL_REDUCE, S, CommGroup(16), c)
    # ring: node volume 2*3/4*S over 100 GB/s = 2.4 ms; NIC volume 2*3/4*S/4 over 10 GB/s = 6 ms (bottleneck);
    # steps: 2*(16-4) inside nodes at 1 us + 2*(4-1) across at 10 us = 84 us.
    assert cost.algorithm is Algorithm.RING
    assert cost.bandwidth_s == pytest.approx(6e-3) and cost.latency_s == pytest.approx(84 * US)
    assert cost.bottleneck_tier == "cluster" and cost.slowest_tier == "cluster"
    # a flat ring at the slow tier's bandwidth would move 2*15/16*S per device over the NIC: 5x slower
    assert 2 * 15 / 16 * S / 10e9 / cost.time_s > 4.9


def test_tree_wins_for_small_messages_across_nodes():
    c = _cluster(4, 4)
    cost = collective_cost(Collective.ALL_REDUCE, 1.6e4, CommGroup(16), c)
    # tree: chain of 3 steps in the node and log2(4) = 2 steps across, up and down: 2*(3*1 + 2*10) = 46 us;
    # bandwidth: 2*S/4 over the NIC = 0.8 us.  The ring would pay 84 us of latency.
    assert cost.algorithm is Algorithm.TREE
    assert cost.time_s == pytest.approx(46 * US + 0.8 * US)


def test_strided_data_parallel_group_uses_only_the_nic():
    c = _cluster(4, 4)
    dp = CommGroup(4, stride=4)  # one rank per node
    (tier,) = spans(dp, c)
    assert (tier.name, tier.peers, tier.ranks_per_domain, tier.steps) == ("cluster", 4, 1, 3)
    assert collective_time(Collective.ALL_REDUCE, 1e8, dp, c) == pytest.approx(6 * 10 * US + 1.5 * 1e8 / 10e9)
    tp = CommGroup(4)  # the tensor-parallel group inside node 0
    assert [s.name for s in spans(tp, c)] == ["node"]
    assert collective_time(Collective.ALL_GATHER, 1e8, CommGroup(4, start=12), c) == pytest.approx(
        3 * US + 0.75 * 1e8 / 100e9)


def test_all_to_all_and_send_recv_across_nodes():
    c = _cluster(4, 4)
    S = 1.6e8
    # node: (4-1)*1/16 of S = 3e7 B over 100 GB/s; NIC: (4-1)*4/16 of S = 1.2e8 B over 10 GB/s = 12 ms;
    # latency (16-4)*1 us + (4-1)*10 us = 42 us.
    assert collective_time(Collective.ALL_TO_ALL, S, CommGroup(16), c) == pytest.approx(12e-3 + 42 * US)
    assert collective_time(Collective.SEND_RECV, 1e8, CommGroup(2, stride=4), c) == pytest.approx(10 * US + 1e-2)
    assert collective_time(Collective.SEND_RECV, 1e8, CommGroup(2, start=2), c) == pytest.approx(1 * US + 1e-3)


def test_slowest_tier_sets_the_bandwidth_in_a_three_tier_cluster():
    dev = get_device("h100-sxm")
    c = Cluster("dc", (DeviceGroup("g", dev, 4, 2),), (
        NetworkTier("node", 2, 100e9, 1 * US), NetworkTier("dc", 4, 10e9, 10 * US), NetworkTier("wan", 8, 0.1e9, 1e-3)))
    pair_in_dc = collective_cost(Collective.SEND_RECV, 1e8, CommGroup(2, stride=2), c)
    pair_across = collective_cost(Collective.SEND_RECV, 1e8, CommGroup(2, stride=4), c)
    assert pair_in_dc.time_s == pytest.approx(10 * US + 1e-2) and pair_in_dc.slowest_tier == "dc"
    assert pair_across.time_s == pytest.approx(1e-3 + 1.0) and pair_across.slowest_tier == "wan"
    everything = collective_cost(Collective.ALL_REDUCE, 8e8, CommGroup(8), c)
    # the wan tier carries 2*(2-1)/2 * S / 4 per device = 2e8 B at 0.1 GB/s = 2 s: it bounds everything
    assert everything.bottleneck_tier == "wan" and everything.bandwidth_s == pytest.approx(2.0)


# ---- sharing, in-network reduction, mixed nodes -------------------------------------------------------------------

def test_concurrent_groups_share_only_when_they_oversubscribe_devices():
    c = _cluster(4, 4)
    one = collective_cost(Collective.ALL_REDUCE, 1e8, CommGroup(4), c)
    # four disjoint node-local groups (one per node): no device serves two, nothing shared
    assert collective_time(Collective.ALL_REDUCE, 1e8, CommGroup(4), c, concurrent=4) == pytest.approx(one.time_s)
    # eight such groups on 16 devices: every device is in two at once, bandwidth halves, latency does not
    eight = collective_cost(Collective.ALL_REDUCE, 1e8, CommGroup(4), c, concurrent=8)
    assert eight.bandwidth_s == pytest.approx(2 * one.bandwidth_s) and eight.latency_s == one.latency_s


def test_in_network_reduction_wins_when_its_bandwidth_beats_the_ring():
    # ring all-reduce of 8 moves 1.75 S; in-switch reduction moves S at its own efficiency
    slow = _cluster(1, 8, in_network=0.5, in_network_latency=50 * US)
    fast = _cluster(1, 8, in_network=0.6, in_network_latency=50 * US)
    S = 1e9
    assert collective_cost(Collective.ALL_REDUCE, S, CommGroup(8), slow).algorithm is Algorithm.RING
    cost = collective_cost(Collective.ALL_REDUCE, S, CommGroup(8), fast)
    assert cost.algorithm is Algorithm.IN_NETWORK and cost.time_s == pytest.approx(50 * US + S / 60e9)
    # ...but never for small messages, where its fixed latency dominates
    assert collective_cost(Collective.ALL_REDUCE, 1e5, CommGroup(8), fast).algorithm is Algorithm.RING
    # and never for all-gather
    assert collective_cost(Collective.ALL_GATHER, S, CommGroup(8), fast).algorithm is Algorithm.RING
    ring_only = collective_cost(Collective.ALL_REDUCE, S, CommGroup(8), fast, algorithms={Algorithm.RING})
    assert ring_only.time_s == pytest.approx(14 * US + 1.75 * S / 100e9)


def test_mixed_cluster_uses_each_nodes_own_link():
    c = Cluster.parse(str(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "mixed-a100-v100.yaml"))
    a100, v100 = get_device("a100-80gb"), get_device("v100-32gb")
    S = 1e9
    t_a = collective_time(Collective.ALL_GATHER, S, CommGroup(8), c)
    t_v = collective_time(Collective.ALL_GATHER, S, CommGroup(8, start=32), c)
    ring = c.node_tier_of(0).efficiency  # both NVLink 2 and 3 use the same calibrated efficiency
    assert t_a == pytest.approx(7 * c.node_tier_of(0).latency + 7 / 8 * S / (a100.intra_node_bandwidth * ring))
    assert t_v == pytest.approx(7 * c.node_tier_of(1).latency + 7 / 8 * S / (v100.intra_node_bandwidth * ring))
    assert t_v / t_a == pytest.approx(2.0, rel=1e-2)  # half the NVLink bandwidth; latency is a small part


# ---- errors ---------------------------------------------------------------------------------------------------

def test_errors_name_the_bad_value():
    c = _cluster(1, 4)
    with pytest.raises(ValueError, match="unknown collective 'allreduce'; valid: all_reduce, all_gather"):
        collective_time("allreduce", 1.0, CommGroup(2), c)
    with pytest.raises(ValueError, match="nbytes must be a finite number >= 0, got -1"):
        collective_time(Collective.ALL_REDUCE, -1, CommGroup(2), c)
    with pytest.raises(ValueError, match="concurrent must be a positive integer, got 0"):
        collective_time(Collective.ALL_REDUCE, 1, CommGroup(2), c, concurrent=0)
    with pytest.raises(ValueError, match="reaches rank 4, but cluster 't' has 4 devices"):
        collective_time(Collective.ALL_REDUCE, 1, CommGroup(3, stride=2), c)
    with pytest.raises(ValueError, match="CommGroup size must be a positive integer, got 0"):
        CommGroup(0)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(list(Collective)), small=st.floats(0, 1e9), factor=st.floats(1, 100),
       size=st.sampled_from([2, 4, 8, 16]), stride=st.sampled_from([1, 2, 4]))
def test_time_grows_with_bytes_and_splits_into_latency_and_bandwidth(kind, small, factor, size, stride):
    c = _cluster(64, 4)
    g = CommGroup(size, stride=stride)
    a = collective_cost(kind, small, g, c)
    b = collective_cost(kind, small * factor, g, c)
    assert b.time_s >= a.time_s * (1 - 1e-12)
    assert a.time_s == pytest.approx(a.latency_s + a.bandwidth_s)
    if small >= 1:  # sub-byte floats underflow the bandwidth term to 0
        assert a.latency_s >= 1 * US and a.bandwidth_s > 0
        # a wider stride never makes the same collective cheaper: it can only cross slower tiers
        assert collective_time(kind, small, CommGroup(size, stride=4 * stride), c) >= a.time_s * (1 - 1e-12)


# ---- calibration against measured nccl-tests bus bandwidth --------------------------------------------------------

def _measured() -> list[dict[str, str]]:
    text = resources.files("costmodel.hardware").joinpath("data", "measured_collectives.csv").read_text(encoding="utf-8")
    return list(csv.DictReader(text.splitlines()))


def _predicted_busbw(row: dict[str, str], algorithms=None) -> float:
    n, nodes = int(row["ranks"]), int(row["nodes"])
    c = Cluster.parse(f"{nodes}x{n // nodes}x{row['device']}")
    nbytes = int(row["message_bytes"])
    t = collective_cost(Collective.ALL_REDUCE, nbytes, CommGroup(n), c, algorithms=algorithms).time_s
    return bus_bandwidth(Collective.ALL_REDUCE, nbytes, n, t)


def test_bus_bandwidth_factors():
    assert bus_bandwidth("all_reduce", 8e9, 8, 1.0) == pytest.approx(14e9)
    assert bus_bandwidth("all_gather", 8e9, 8, 1.0) == pytest.approx(7e9)
    assert bus_bandwidth("send_recv", 8e9, 2, 1.0) == pytest.approx(8e9)


def test_eight_gpu_all_reduce_matches_measured_busbw_at_1g_and_8g():
    rows = [r for r in _measured() if r["system"].startswith(("Azure ND A100", "Azure ND H100", "Azure ND H200"))]
    print("\nsystem                               size  measured  predicted  error")
    for r in rows:
        pred = _predicted_busbw(r) / 1e9
        meas = float(r["busbw_gbps"])
        print(f"{r['system'][:36]:36s} {r['message_label']:>5s} {meas:9.1f} {pred:10.1f} {pred / meas - 1:+7.1%}")
        if r["message_label"] in ("1G", "8G"):
            assert pred == pytest.approx(meas, rel=0.15), (r["system"], r["message_label"])
    assert len([r for r in rows if r["message_label"] in ("1G", "8G")]) == 6


def test_ring_and_nvls_rows_by_group_size():
    for r in _measured():
        if not r["system"].startswith(("8x H200 HGX", "AWS p6-b200")):
            continue
        algorithms = {Algorithm.RING} if r["algorithm"] == "ring" else None  # measured with NVLS disabled
        pred = _predicted_busbw(r, algorithms)
        assert pred == pytest.approx(float(r["busbw_gbps"]) * 1e9, rel=0.10 if algorithms else 0.06), r


def test_multi_node_b200_large_messages():
    for r in _measured():
        if r["system"].startswith("AWS P6-B200") and r["nodes"] == "4" and int(r["message_bytes"]) >= 2**30:
            assert _predicted_busbw(r) == pytest.approx(float(r["busbw_gbps"]) * 1e9, rel=0.10), r
