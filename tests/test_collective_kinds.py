"""Per-collective-kind latency and bandwidth on a network tier (`NetworkTier.per_collective`): closed-form prices
with an override, serialization (dict and YAML), calibration from per-kind fits, and unchanged prices without one.

The measured case behind it (gloo, 2 CPU ranks): 96 us per all-reduce step, 192 us per all-gather step, 170 us per
reduce-scatter step, and reduce-scatter ~3x slower per byte than all-reduce at 4 MB -- one alpha/beta per tier
under-priced reduce-scatter (ZeRO) up to 5x.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import yaml

from costmodel.hardware.catalog import get_link
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collective_fit import (
    CollectiveProfile,
    CollectiveSample,
    calibrated_cluster,
    ring_terms,
)
from costmodel.hardware.collectives import Collective, CommGroup, collective_cost, collective_time, spans
from costmodel.hardware.network import COLLECTIVE_KINDS, CollectiveLink, NetworkTier

RS_ALPHA, RS_BANDWIDTH = 170e-6, 0.4e9
RS_LINK = CollectiveLink("reduce_scatter", latency=RS_ALPHA, bandwidth=RS_BANDWIDTH)
S = 4e6  # bytes: the 4 MB point of the measurement


def with_node_overrides(spec: str, *links: CollectiveLink) -> Cluster:
    return Cluster.parse(spec).with_tier("node", per_collective=links)


def test_kind_names_match_the_collective_enum():
    assert set(COLLECTIVE_KINDS) == {c.value for c in Collective}
    assert len(COLLECTIVE_KINDS) == len(Collective)


# ---- pricing ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_override_prices_reduce_scatter_in_closed_form(n):
    cluster = with_node_overrides(f"1x{n}xcpu", RS_LINK)
    node = cluster.tiers[0]
    group = CommGroup(n)
    # ring reduce-scatter on one tier: (n - 1) steps and (n - 1)/n * S bytes per device
    rs = collective_cost(Collective.REDUCE_SCATTER, S, group, cluster)
    assert rs.latency_s == pytest.approx((n - 1) * RS_ALPHA, rel=1e-12)
    assert rs.time_s == pytest.approx((n - 1) * RS_ALPHA + (n - 1) / n * S / RS_BANDWIDTH, rel=1e-12)
    # all-reduce and all-gather keep the tier's defaults: ring 2(n-1) steps, 2(n-1)/n S; n-1 steps, (n-1)/n S
    ar = collective_cost(Collective.ALL_REDUCE, S, group, cluster, algorithms={"ring"})
    assert ar.time_s == pytest.approx(2 * (n - 1) * node.latency + 2 * (n - 1) / n * S / node.effective_bandwidth,
                                      rel=1e-12)
    ag = collective_time(Collective.ALL_GATHER, S, group, cluster)
    assert ag == pytest.approx((n - 1) * node.latency + (n - 1) / n * S / node.effective_bandwidth, rel=1e-12)
    assert ag == collective_time(Collective.ALL_GATHER, S, group, Cluster.parse(f"1x{n}xcpu"))


def test_override_on_an_outer_tier_sets_that_tiers_terms():
    # 16 ranks on 2 nodes of 8: node tier D=8, P=1, 14 steps; outer tier D=2, P=8, 1 step (module docstring).
    base = Cluster.parse("2x8xa100-80gb")
    outer_link = CollectiveLink(Collective.ALL_GATHER, latency=50e-6, bandwidth=1e9)
    cluster = base.with_tier("cluster", per_collective=(outer_link,))
    node = cluster.tiers[0]
    cost = collective_cost(Collective.ALL_GATHER, S, CommGroup(16), cluster)
    node_time = 7 / 8 * S / node.effective_bandwidth
    outer_time = 1 / 2 * S / 8 / outer_link.bandwidth
    assert cost.latency_s == pytest.approx(14 * node.latency + outer_link.latency, rel=1e-12)
    assert cost.bandwidth_s == pytest.approx(max(node_time, outer_time), rel=1e-12)
    assert cost.bottleneck_tier == "cluster"
    # other kinds over the same group price exactly as on the cluster without the override
    for kind in (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER, Collective.BROADCAST):
        assert collective_time(kind, S, CommGroup(16), cluster) == collective_time(kind, S, CommGroup(16), base)


def test_send_recv_uses_the_override_of_the_slowest_tier_spanned():
    link = CollectiveLink("send_recv", latency=30e-6, bandwidth=2e9)
    cluster = Cluster.parse("2x8xa100-80gb").with_tier("cluster", per_collective=(link,))
    assert collective_time("send_recv", S, CommGroup(2, stride=8), cluster) == pytest.approx(
        link.latency + S / link.bandwidth, rel=1e-12)


def test_mixed_node_tiers_take_the_slowest_figures_per_kind():
    # Group a100's node link overrides reduce-scatter; v100's does not, so a group touching both takes, for
    # reduce-scatter, the larger latency and the smaller bandwidth of (a100 override, v100 defaults).
    base = Cluster.parse("examples/clusters/mixed-a100-v100.yaml")
    a100, v100 = base.groups
    slow_rs = CollectiveLink("reduce_scatter", latency=1e-9, bandwidth=1e9)
    cluster = dataclasses.replace(base, groups=(
        dataclasses.replace(a100, node_tier=dataclasses.replace(a100.node_tier, per_collective=(slow_rs,))), v100))
    (node_span, _outer) = spans(CommGroup(64), cluster)
    rs = node_span.for_kind(Collective.REDUCE_SCATTER)
    assert rs.bandwidth == min(slow_rs.bandwidth, v100.node_tier.effective_bandwidth) == 1e9
    assert rs.latency == max(slow_rs.latency, v100.node_tier.latency) == v100.node_tier.latency
    ar = node_span.for_kind(Collective.ALL_REDUCE)
    assert (ar.bandwidth, ar.latency) == (node_span.bandwidth, node_span.latency)
    # A group inside the a100 nodes only sees a100's override unchanged.
    (inside,) = spans(CommGroup(8), cluster)
    assert inside.overrides == (slow_rs,)
    hash(spans(CommGroup(64), cluster))  # spans are cache keys (planner/search/stage_problem.py)


def test_cluster_without_overrides_prices_as_before():
    # Times computed with the code before per-collective overrides existed (same inputs, same floats).
    before = [
        ("4x8xh100-sxm", Collective.ALL_REDUCE, 1e8, CommGroup(8), 0.00045298679077237553),
        ("4x8xh100-sxm", Collective.ALL_REDUCE, 1e8, CommGroup(32), 0.0010606559864682003),
        ("4x8xh100-sxm", Collective.REDUCE_SCATTER, 1e8, CommGroup(4, stride=8), 0.0022928399594046005),
        ("4x8xh100-sxm", Collective.ALL_GATHER, 1e6, CommGroup(16), 0.00012338945697248208),
        ("4x8xh100-sxm", Collective.SEND_RECV, 1e7, CommGroup(2, stride=8), 0.0003583259945872801),
        ("2x8xa100-80gb", Collective.ALL_TO_ALL, 1e7, CommGroup(16), 0.0004010679945872801),
        ("2x8xa100-80gb", Collective.BROADCAST, 1e7, CommGroup(16), 0.00019809099864682002),
        ("1x4xcpu", Collective.REDUCE_SCATTER, 4e6, CommGroup(4), 0.005485336161187699),
        ("examples/clusters/mixed-a100-v100.yaml", Collective.ALL_REDUCE, 1e8, CommGroup(2, start=6),
         0.0004379408663471089),
        ("examples/clusters/mixed-a100-v100.yaml", Collective.REDUCE_SCATTER, 1e8, CommGroup(64),
         0.0019688304763193507),
    ]
    # Those times used the nic calibration between nodes, since replaced by the infiniband link for these devices.
    nic = get_link("nic")

    def as_before(cluster: Cluster) -> Cluster:
        for t in cluster.tiers:
            if t.link == "infiniband":
                cluster = cluster.with_tier(t.name, latency=nic.latency, efficiency=nic.efficiency)
        return cluster

    for spec, kind, nbytes, group, seconds in before:
        assert collective_time(kind, nbytes, group, as_before(Cluster.parse(spec))) == seconds, (spec, kind, group)


# ---- validation and serialization ---------------------------------------------------------------------------------

def test_links_are_validated_and_sorted():
    with pytest.raises(ValueError, match="unknown collective kind 'all_reduse'.*valid: all_reduce"):
        CollectiveLink("all_reduse", latency=1e-6, bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth must be a finite positive"):
        CollectiveLink("all_reduce", latency=1e-6, bandwidth=float("inf"))
    with pytest.raises(ValueError, match="bandwidth must be a finite positive"):
        CollectiveLink("all_reduce", latency=1e-6, bandwidth=0.0)
    with pytest.raises(ValueError, match="latency must be a finite number >= 0"):
        CollectiveLink("all_reduce", latency=-1e-6, bandwidth=1e9)
    assert CollectiveLink(Collective.ALL_GATHER, 1e-6, 1e9).kind == "all_gather"
    ag = CollectiveLink("all_gather", 1e-6, 1e9)
    with pytest.raises(ValueError, match="kind 'all_gather' more than once"):
        NetworkTier("node", 2, 1e9, 1e-6, per_collective=(ag, ag))
    one = NetworkTier("node", 2, 1e9, 1e-6, per_collective=(RS_LINK, ag))
    other = NetworkTier("node", 2, 1e9, 1e-6, per_collective=(ag, RS_LINK))
    assert one == other and [x.kind for x in one.per_collective] == ["all_gather", "reduce_scatter"]


def test_to_dict_adds_the_key_only_with_overrides_and_round_trips():
    plain = Cluster.parse("1x4xcpu")
    assert "per_collective" not in plain.to_dict()["tiers"][0]
    assert list(plain.to_dict()["tiers"][0]) == ["name", "size", "bandwidth", "latency", "efficiency",
                                                 "in_network_reduction_efficiency", "in_network_reduction_latency",
                                                 "link", "source"]
    cluster = with_node_overrides("1x4xcpu", RS_LINK, CollectiveLink("all_gather", 192e-6, 0.8e9))
    d = cluster.to_dict()
    assert d["tiers"][0]["per_collective"] == {"all_gather": {"latency": 192e-6, "bandwidth": 0.8e9},
                                               "reduce_scatter": {"latency": RS_ALPHA, "bandwidth": RS_BANDWIDTH}}
    assert Cluster.from_dict(d) == cluster
    # a group's own node tier carries its overrides through the round trip as well
    mixed = Cluster.parse("examples/clusters/mixed-a100-v100.yaml")
    a100 = mixed.groups[0]
    mixed = dataclasses.replace(mixed, groups=(
        dataclasses.replace(a100, node_tier=dataclasses.replace(a100.node_tier, per_collective=(RS_LINK,))),
        mixed.groups[1]))
    assert Cluster.from_dict(mixed.to_dict()) == mixed
    assert Cluster.from_dict(yaml.safe_load(yaml.safe_dump(mixed.to_dict()))) == mixed


YAML_SPEC = """
name: gloo-box
groups:
  - device: cpu
    num_nodes: 1
    devices_per_node: 4
tiers:
  - name: node
    bandwidth: 2GB/s
    latency: 100us
    per_collective:
      reduce_scatter: {latency: 170us, bandwidth: 0.4GB/s}
      all_gather: {latency: 0.192ms, bandwidth: 800MB/s}
"""


def test_yaml_spec_with_units_and_round_trip(tmp_path):
    path = tmp_path / "gloo-box.yaml"
    path.write_text(YAML_SPEC)
    cluster = Cluster.parse(str(path))
    links = {x.kind: x for x in cluster.tiers[0].per_collective}
    assert links["reduce_scatter"].latency == pytest.approx(170e-6, rel=1e-12)
    assert links["reduce_scatter"].bandwidth == pytest.approx(0.4e9, rel=1e-12)
    assert links["all_gather"].latency == pytest.approx(192e-6, rel=1e-12)
    assert links["all_gather"].bandwidth == pytest.approx(0.8e9, rel=1e-12)
    assert collective_time("reduce_scatter", S, CommGroup(4), cluster) == pytest.approx(
        3 * 170e-6 + 3 / 4 * S / 0.4e9, rel=1e-12)
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(cluster.to_dict()))
    assert Cluster.parse(str(again)) == cluster


@pytest.mark.parametrize(("edit", "message"), [
    ("      broadcast_all: {latency: 1us, bandwidth: 1GB/s}",
     "tiers[0].per_collective: unknown collective kind 'broadcast_all'; valid kinds: all_reduce"),
    ("      all_to_all: {latency: 1us}",
     "tiers[0].per_collective.all_to_all: missing required key 'bandwidth'; valid keys: latency, bandwidth"),
    ("      all_to_all: {latency: 1us, bandwidth: 1GB/s, efficiency: 0.5}",
     "tiers[0].per_collective.all_to_all: unknown key 'efficiency'"),
    ("      all_to_all: {latency: 1us, bandwidth: 0GB/s}",
     "tiers[0].per_collective.all_to_all.bandwidth: bandwidth must be positive"),
])
def test_yaml_mistakes_name_the_path(tmp_path, edit, message):
    path = tmp_path / "bad.yaml"
    path.write_text(YAML_SPEC + edit + "\n")
    with pytest.raises(ValueError) as err:
        Cluster.parse(str(path))
    assert message in str(err.value)


def test_per_collective_must_be_a_mapping():
    spec = yaml.safe_load(YAML_SPEC)
    spec["tiers"][0]["per_collective"] = ["reduce_scatter"]
    with pytest.raises(ValueError, match=r"tiers\[0\].per_collective: expected a mapping collective kind"):
        Cluster.from_dict(spec)


# ---- calibration from a profile -----------------------------------------------------------------------------------

TRUE_LINKS = {  # (alpha s/step, bandwidth bytes/s) per kind; alphas as measured with gloo on 2 ranks
    Collective.ALL_REDUCE: (96e-6, 1.2e9),
    Collective.ALL_GATHER: (192e-6, 0.8e9),
    Collective.REDUCE_SCATTER: (170e-6, 0.4e9),
    Collective.SEND_RECV: (60e-6, 1.5e9),
}
SIZES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)


def synthetic_profile(noise: float = 0.0, seed: int = 0) -> CollectiveProfile:
    rng = random.Random(seed)
    samples = []
    for kind, (alpha, bandwidth) in TRUE_LINKS.items():
        for n in (2, 3, 4):
            for s in SIZES:
                steps, volume = ring_terms(kind, n, s)
                t = (steps * alpha + volume / bandwidth) * (1 + rng.uniform(-noise, noise))
                samples.append(CollectiveSample(kind, n, float(s), t))
    # Broadcast timings that shrink slightly with size: the non-negative fit gives 1/B = 0, an infinite
    # bandwidth, so broadcast gets no override.
    samples += [CollectiveSample(Collective.BROADCAST, n, float(s), 1e-4 * (n - 1) * (1 - 0.01 * i))
                for n in (2, 4) for i, s in enumerate(SIZES)]
    return CollectiveProfile.from_samples(samples)


@pytest.mark.parametrize("noise", [0.0, 0.01])
def test_calibrated_cluster_recovers_per_kind_links(noise):
    profile = synthetic_profile(noise=noise, seed=11)
    assert profile.fit("cpu", "broadcast").bandwidth_bytes_per_s == float("inf")
    calibrated = calibrated_cluster(Cluster.parse("1x4xcpu"), profile)
    node = calibrated.tiers[0]
    link = profile.fit("cpu")
    assert (node.latency, node.bandwidth, node.efficiency) == (link.alpha_s, link.bandwidth_bytes_per_s, 1.0)
    links = {x.kind: x for x in node.per_collective}
    assert sorted(links) == sorted(k.value for k in TRUE_LINKS)  # no broadcast: its bandwidth is infinite
    for kind, (alpha, bandwidth) in TRUE_LINKS.items():
        assert links[kind.value].latency == pytest.approx(alpha, rel=0.01)
        assert links[kind.value].bandwidth == pytest.approx(bandwidth, rel=0.01)
    # The cost model now prices each kind with its own measured link: closed form within 1% at 4 ranks.
    for kind, (alpha, bandwidth) in TRUE_LINKS.items():
        n = 2 if kind is Collective.SEND_RECV else 4
        steps, volume = ring_terms(kind, n, S)
        got = collective_cost(kind, S, CommGroup(n), calibrated, algorithms={"ring", "direct"}).time_s
        assert got == pytest.approx(steps * alpha + volume / bandwidth, rel=0.01), kind
    # Broadcast was not given an override: it gets the joint link fit.
    bcast = collective_cost("broadcast", S, CommGroup(4), calibrated, algorithms={"ring"})
    assert bcast.time_s == pytest.approx(3 * link.alpha_s + S / link.bandwidth_bytes_per_s, rel=1e-12)


def test_joint_fit_alone_underprices_reduce_scatter():
    # What the overrides fix: with only the joint fit, reduce-scatter at 4 MB on 4 ranks is priced well below
    # its true time.
    profile = synthetic_profile()
    link = profile.fit("cpu")
    alpha, bandwidth = TRUE_LINKS[Collective.REDUCE_SCATTER]
    truth = 3 * alpha + 3 / 4 * S / bandwidth
    assert link.time(Collective.REDUCE_SCATTER, 4, S) < 0.6 * truth
    calibrated = calibrated_cluster(Cluster.parse("1x4xcpu"), profile)
    assert collective_time("reduce_scatter", S, CommGroup(4), calibrated) == pytest.approx(truth, rel=1e-9)


def test_calibration_keeps_overrides_of_unmeasured_kinds():
    a2a = CollectiveLink("all_to_all", latency=1e-3, bandwidth=1e8)
    stale_rs = CollectiveLink("reduce_scatter", latency=1.0, bandwidth=1.0)
    cluster = with_node_overrides("1x4xcpu", a2a, stale_rs)
    calibrated = calibrated_cluster(cluster, synthetic_profile())
    links = {x.kind: x for x in calibrated.tiers[0].per_collective}
    assert links["all_to_all"] == a2a
    assert links["reduce_scatter"].latency == pytest.approx(TRUE_LINKS[Collective.REDUCE_SCATTER][0], rel=1e-9)
