"""Cluster specs: shorthand, YAML validation messages, round trips, rank order, tiers and what-if edits."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from costmodel.hardware.catalog import get_device
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.device_group import DeviceGroup
from costmodel.hardware.network import NetworkTier
from costmodel.hardware.units import parse_bandwidth, parse_bytes, parse_duration

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def _spec(text: str) -> Cluster:
    return Cluster.from_dict(yaml.safe_load(textwrap.dedent(text)))


def _error(text: str) -> str:
    with pytest.raises(ValueError) as e:
        _spec(text)
    return str(e.value)


# ---- shorthand ------------------------------------------------------------------------------------------------

def test_shorthand_builds_node_and_cluster_tiers_from_the_catalog():
    c = Cluster.parse("128x8xa100-80gb")
    assert (c.name, c.num_devices, c.num_nodes, c.num_available) == ("128x8xa100-80gb", 1024, 128, 1024)
    node, cluster = c.tiers
    assert (node.name, node.size, node.bandwidth, node.link) == ("node", 8, 300e9, "nvlink3")
    assert (cluster.name, cluster.size, cluster.bandwidth, cluster.link) == ("cluster", 1024, 25e9, "infiniband")
    assert c.device_of(1023).name == "a100-80gb" and c.speed_of(1023) == 1.0
    assert c.is_homogeneous and c.price_per_hour is None


def test_shorthand_cpu_and_aliases():
    c = Cluster.parse("1x4xcpu")
    assert c.num_devices == 4 and c.tiers[0].bandwidth == pytest.approx(0.943e9)
    assert Cluster.parse("2X8XH100").name == "2x8xh100-sxm"


@pytest.mark.parametrize("spec", ["128x8", "a100-80gb", "8xa100-80gb", "2x8x", "2*8*h100", ""])
def test_malformed_shorthand_shows_the_form_and_the_devices(spec):
    with pytest.raises(ValueError) as e:
        Cluster.parse(spec)
    msg = str(e.value)
    assert "\n" not in msg
    assert "expected NODESxGPUSxDEVICE (e.g. 128x8xa100-80gb or 1x4xcpu)" in msg
    assert "a100-80gb, h100-sxm, h200" in msg and "cpu" in msg


def test_shorthand_unknown_device_and_zero_counts():
    with pytest.raises(ValueError, match=r"unknown device 'a100'; valid devices: v100-32gb, a100-40gb, a100-80gb"):
        Cluster.parse("2x8xa100")
    with pytest.raises(ValueError, match="NODES and GPUS must be at least 1"):
        Cluster.parse("0x8xh100")


def test_missing_yaml_file():
    with pytest.raises(ValueError, match=r"cluster spec file 'nope\.yaml' not found"):
        Cluster.parse("nope.yaml")


# ---- units ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "value"), [
    ("400Gbps", 50e9), ("400 Gb/s", 50e9), ("50GB/s", 50e9), ("1.5TB/s", 1.5e12), ("25GiB/s", 25 * 2**30),
    ("100Mbps", 12.5e6), (1e9, 1e9), ("3.2e3 GB/s", 3.2e12)])
def test_parse_bandwidth(text, value):
    assert parse_bandwidth(text) == pytest.approx(value)


@pytest.mark.parametrize(("text", "value"), [("5us", 5e-6), ("1.5ms", 1.5e-3), ("200ns", 2e-7), ("5µs", 5e-6),
                                             (0.002, 2e-3), ("0", 0.0)])
def test_parse_duration(text, value):
    assert parse_duration(text) == pytest.approx(value)


def test_parse_bytes_and_unit_errors():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("40GB") == 40 * 10**9
    with pytest.raises(ValueError, match=r"tiers\[1\]\.bandwidth: unknown unit 'Gbit' in '400Gbit'; valid units: "):
        parse_bandwidth("400Gbit", "tiers[1].bandwidth")
    with pytest.raises(ValueError, match=r"latency: expected a duration such as '5us'"):
        parse_duration("fast")
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        parse_bandwidth("0GB/s")


# ---- YAML validation messages ---------------------------------------------------------------------------------

GOOD = """
groups:
  - device: a100-80gb
    num_nodes: 2
    devices_per_node: 8
  - device: v100-32gb
    num_nodes: 2
    devices_per_node: 8
"""


def test_unknown_key_names_its_path_and_the_valid_keys():
    msg = _error(GOOD + "    gpus_per_node: 8\n")
    assert msg.startswith("groups[1]: unknown key 'gpus_per_node'; valid keys: name, device, num_nodes, "
                          "devices_per_node, price_per_device_hour, memory, slowdown, unavailable, node_tier, "
                          "host_cores")
    assert _error(GOOD + "network: {}\n").startswith("cluster spec: unknown key 'network'; valid keys: name, groups")
    msg = _error(GOOD + "tiers:\n  - name: node\n    speed: 1\n")
    assert msg.startswith("tiers[0]: unknown key 'speed'; valid keys: name, size, bandwidth, aggregate_bandwidth")


def test_bad_values_name_their_path():
    bad_second = GOOD[:GOOD.rindex("devices_per_node: 8")] + "devices_per_node: 0\n"
    assert _error(bad_second) == "groups[1].devices_per_node: expected a positive integer, got 0"
    assert "groups[0].device: unknown device 'a100'; valid devices: v100-32gb" in _error(
        GOOD.replace("a100-80gb", "a100"))
    assert _error(GOOD + "    slowdown: {3: 1.5}\n") == "groups[1].slowdown[3]: expected a number in (0, 1], got 1.5"
    assert _error(GOOD + "    slowdown: {16: 0.5}\n") == (
        "groups[1].slowdown[16]: expected a device index in 0..15 of this group, got 16")
    assert _error(GOOD + "    unavailable: [2]\n    slowdown: {2: 0.5}\n") == (
        "groups[1].slowdown[2]: device 2 is also listed as unavailable")
    assert _error(GOOD + "    price_per_device_hour: -1\n") == (
        "groups[1].price_per_device_hour: expected a number in [0, inf], got -1")
    assert _error(GOOD + "    memory: lots\n").startswith("groups[1].memory: expected a size such as '80GB'")
    assert _error(GOOD + "tiers:\n  - {name: node, latency: 5 parsecs}\n").startswith(
        "tiers[0].latency: unknown unit 'parsecs'")
    assert _error(GOOD + "tiers:\n  - {name: node, link: nvlink9}\n").startswith(
        "tiers[0].link: unknown link type 'nvlink9'; valid link types: nvlink2, nvlink3")
    assert _error(GOOD + "tiers:\n  - {name: node, efficiency: 1.2}\n") == (
        "tiers[0].efficiency: expected a number in (0, 1], got 1.2")


def test_structural_errors():
    assert _error("groups: []\n") == "groups: expected a non-empty list of device groups"
    assert _error("name: x\n").startswith("cluster spec: missing required key 'groups'")
    assert _error(GOOD.replace("  - device: v100-32gb\n", "  - name: a\n    device: v100-32gb\n")
                  .replace("  - device: a100-80gb\n", "  - name: a\n    device: a100-80gb\n")).startswith(
        "groups[1].name: duplicate group name 'a' (also groups[0])")
    assert _error(GOOD + "tiers:\n  - {name: node}\n  - {name: rack, size: 4}\n  - {name: all}\n") == (
        "cluster spec 'cluster': tier 'rack' (size 4) must not be smaller than the tier inside it, 'node' (size 8)")
    assert _error(GOOD + "tiers:\n  - {name: node}\n  - {name: rack, size: 12}\n  - {name: all}\n") == (
        "cluster spec 'cluster': tier 'rack' (size 12) would split a node at rank 12")
    assert _error(GOOD + "tiers:\n  - {name: node}\n  - {name: rack}\n  - {name: all}\n").startswith(
        "tiers[1]: missing required key 'size' (only the last tier may omit it)")
    assert _error(GOOD + "tiers:\n  - {name: node}\n  - {name: all, size: 16}\n") == (
        "cluster spec 'cluster': the outermost tier 'all' has size 16 but must span all 32 devices")
    assert _error(GOOD + "tiers:\n  - {name: node, size: 4}\n").startswith(
        "tiers[0].size: the node tier has size 4 but group 'a100-80gb' has 8 devices per node")


def test_invalid_yaml_file_reports_the_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("groups:\n  - device: [a100\n")
    with pytest.raises(ValueError, match=r"cluster spec broken\.yaml: not valid YAML at line \d"):
        Cluster.parse(str(p))


# ---- parsing results ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.name for p in EXAMPLE_FILES])
def test_every_example_parses_and_round_trips(path):
    c = Cluster.parse(str(path))
    assert c.name == path.stem
    d = c.to_dict()
    assert Cluster.from_dict(d) == c
    assert json.dumps(d, sort_keys=True) == json.dumps(Cluster.parse(str(path)).to_dict(), sort_keys=True)
    assert Cluster.from_dict(json.loads(json.dumps(d))) == c  # JSON stringifies slowdown keys


def test_examples_cover_the_documented_scenarios():
    names = {p.name for p in EXAMPLE_FILES}
    assert {"dgx-a100-128.yaml", "mixed-a100-v100.yaml", "straggler.yaml", "two-datacenters.yaml",
            "cpu-1x4.yaml", "cpu-1x4-on-2-cores.yaml"} <= names


def test_shorthand_round_trips_and_equals_the_equivalent_yaml():
    for spec in ("128x8xa100-80gb", "1x4xcpu", "4x8xh100-sxm", "2x4xtpu-v5e"):
        c = Cluster.parse(spec)
        assert Cluster.from_dict(c.to_dict()) == c
    yaml_cpu = Cluster.parse(str(EXAMPLES / "cpu-1x4.yaml"))
    assert yaml_cpu.groups == Cluster.parse("1x4xcpu").groups and yaml_cpu.tiers == Cluster.parse("1x4xcpu").tiers


def test_dgx_example_tiers_and_price():
    c = Cluster.parse(str(EXAMPLES / "dgx-a100-128.yaml"))
    assert [(t.name, t.size) for t in c.tiers] == [("node", 8), ("rack", 32), ("cluster", 1024)]
    assert c.tiers[1].bandwidth == 25e9 and c.tiers[2].latency == pytest.approx(10e-6)
    assert c.price_per_hour == pytest.approx(1024 * 5.12)


def test_mixed_example_rank_order_and_per_group_node_links():
    c = Cluster.parse(str(EXAMPLES / "mixed-a100-v100.yaml"))
    assert [c.device_of(r).name for r in (0, 31, 32, 63)] == ["a100-80gb", "a100-80gb", "v100-32gb", "v100-32gb"]
    assert [c.group_index_of(r) for r in (31, 32)] == [0, 1] and c.local_index(33) == 1
    assert [c.node_of(r) for r in (0, 7, 8, 33, 63)] == [0, 0, 1, 4, 7]
    assert c.node_tier_of(0).bandwidth == 300e9 and c.node_tier_of(0).link == "nvlink3"
    assert c.node_tier_of(1).bandwidth == 150e9 and c.node_tier_of(1).link == "nvlink2"
    assert c.tiers[0].bandwidth == 150e9  # tiers[0] describes the slower node
    assert c.tiers[1].bandwidth == 12.5e9 and not c.is_homogeneous
    assert c.price_per_hour == pytest.approx(32 * 5.12 + 32 * 3.90)
    assert list(c.group_ranks(1)) == list(range(32, 64))


def test_straggler_example_speeds_and_availability():
    c = Cluster.parse(str(EXAMPLES / "straggler.yaml"))
    assert [c.speed_of(r) for r in (2, 3, 12)] == [1.0, 0.5, 0.0]
    assert c.num_devices == 16 and c.num_available == 15 and 12 not in c.available_ranks()
    assert not c.is_available(12) and c.is_available(3)
    with pytest.raises(ValueError, match=r"rank 16 is outside 0\.\.15"):
        c.device_of(16)


def test_host_cores_share_a_node_among_its_busy_devices():
    c = _spec("""
        groups:
          - {device: cpu, num_nodes: 2, devices_per_node: 4, host_cores: 2, slowdown: {1: 0.5}}
        """)
    assert c.groups[0].host_cores == 2
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.compute_speeds(range(4)) == (0.5, 0.25, 0.5, 0.5)           # four busy on two cores
    assert c.compute_speeds(range(4), 0.25) == (1.0, 0.5, 1.0, 1.0)      # one busy at a time: a core each
    assert c.compute_speeds((0, 1, 4), 1.0) == (1.0, 0.5, 1.0)           # two on node 0, one on node 1
    assert c.compute_speeds(range(4), 4 / 7) == pytest.approx((0.875, 0.4375, 0.875, 0.875))
    plain = Cluster.parse("1x4xcpu")
    assert "host_cores" not in plain.to_dict()["groups"][0]
    assert plain.compute_speeds(range(4), 0.25) == (1.0,) * 4
    assert _error("groups:\n  - {device: cpu, num_nodes: 1, devices_per_node: 4, host_cores: 0}\n") == (
        "groups[0].host_cores: expected a positive integer, got 0")
    with pytest.raises(ValueError, match="busy_fraction must be in"):
        c.compute_speeds(range(4), 0.0)
    with pytest.raises(ValueError, match="host_cores must be a positive integer"):
        DeviceGroup("g", get_device("cpu"), 1, 4, host_cores=0)


def test_two_datacenters_aggregate_bandwidth_is_shared_by_the_datacenter():
    c = Cluster.parse(str(EXAMPLES / "two-datacenters.yaml"))
    dc, link = c.tiers[1], c.tiers[2]
    assert link.bandwidth == pytest.approx(256e9 / 8 / 64) and link.bandwidth == pytest.approx(dc.bandwidth / 100)
    assert link.latency == 1e-3


def test_memory_override_custom_device_and_node_tier():
    c = _spec("""
        groups:
          - name: small
            device: a100-80gb
            num_nodes: 1
            devices_per_node: 4
            memory: 40GB
            price_per_device_hour: 2
            node_tier: {link: pcie, bandwidth: 32GB/s}
          - name: custom
            device:
              name: my-chip
              peak_flops: {bfloat16: 400.0e12}
              matmul_efficiency: 0.8
              memory_bytes: 96GB
              memory_bandwidth: 3TB/s
              memory_efficiency: 0.9
              intra_node_bandwidth: 400GB/s
              inter_node_bandwidth: 400Gbps
            num_nodes: 1
            devices_per_node: 4
            price_per_device_hour: 3
        """)
    small, custom = c.groups
    assert small.device.memory_bytes == 40 * 10**9 and "memory" in small.device.sources["memory_bytes"]
    assert get_device("a100-80gb").memory_bytes == 80 * 2**30  # the catalog is untouched (the driver's 81,920 MiB)
    assert c.node_tier_of(0).bandwidth == 32e9 and c.node_tier_of(0).link == "pcie"
    assert custom.device.flops("bfloat16") == 400e12 and custom.device.memory_bytes == 96 * 10**9
    assert c.node_tier_of(1).bandwidth == 400e9 and c.node_tier_of(1).link == "pcie"  # unknown device: PCIe default
    assert c.tiers[1].bandwidth == 25e9  # the slower NIC of the two
    assert c.price_per_hour == 4 * 2 + 4 * 3
    assert Cluster.from_dict(c.to_dict()) == c


def test_groups_with_different_node_sizes():
    c = _spec("""
        groups:
          - {device: a100-80gb, num_nodes: 2, devices_per_node: 8}
          - {device: t4, num_nodes: 2, devices_per_node: 4}
        tiers:
          - {name: node}
          - {name: cluster, bandwidth: 100Gbps}
        """)
    assert c.num_devices == 24 and [c.node_of(r) for r in (15, 16, 19, 20, 23)] == [1, 2, 2, 3, 3]
    assert c.node_tier_of(1).size == 4 and c.node_tier_of(1).bandwidth == 15.75e9
    assert c.tier_index_spanned(4, start=16) == 0 and c.tier_index_spanned(8, start=12) == 1


# ---- tiers spanned ------------------------------------------------------------------------------------------------

def test_tier_spanned_by_size_and_stride():
    c = Cluster.parse("128x8xa100-80gb")
    assert c.tier_index_spanned(1) is None
    assert c.tier_spanned(8).name == "node" and c.tier_spanned(16).name == "cluster"
    assert c.tier_spanned(8, stride=8).name == "cluster"      # a data-parallel group, one rank per node
    assert c.tier_spanned(4, stride=2).name == "node"          # ranks 0, 2, 4, 6
    assert c.tier_spanned(2, start=7).name == "cluster"        # ranks 7 and 8 straddle two nodes
    assert c.domain_counts(16, stride=4) == (8, 1)
    d = Cluster.parse(str(EXAMPLES / "dgx-a100-128.yaml"))
    assert [d.tier_spanned(n).name for n in (8, 32, 33)] == ["node", "rack", "cluster"]
    assert d.tier_spanned(4, stride=8).name == "rack" and d.tier_spanned(4, stride=32).name == "cluster"
    assert d.domain_counts(64, stride=16) == (64, 32, 1)
    t = Cluster.parse(str(EXAMPLES / "two-datacenters.yaml"))
    assert t.tier_spanned(8, stride=8).name == "datacenter" and t.tier_spanned(2, stride=64).name == "interconnect"
    with pytest.raises(ValueError, match=r"reaches rank 1024, but cluster '128x8xa100-80gb' has 1024 devices"):
        c.tier_index_spanned(2, stride=1, start=1023)


# ---- edits ----------------------------------------------------------------------------------------------------

def test_what_if_edits_return_new_validated_clusters():
    c = Cluster.parse(str(EXAMPLES / "two-datacenters.yaml"))
    faster = c.with_tier("interconnect", bandwidth=2 * c.tiers[2].bandwidth)
    assert faster.tiers[2].bandwidth == 1e9 and c.tiers[2].bandwidth == 0.5e9
    with pytest.raises(ValueError, match="has no tier 'wan'; tiers: node, datacenter, interconnect"):
        c.with_tier("wan", bandwidth=1.0)
    with pytest.raises(ValueError, match="efficiency must be in"):
        c.with_tier("node", efficiency=2.0)
    slow = c.with_speed(70, 0.5).with_speed(5, 0)
    assert slow.speed_of(70) == 0.5 and slow.speed_of(5) == 0 and slow.num_available == 127
    assert slow.with_speed(5, 1).with_speed(70, 1) == c
    mixed = Cluster.parse(str(EXAMPLES / "mixed-a100-v100.yaml")).with_tier("node", latency=1e-6)
    assert mixed.node_tier_of(0).latency == mixed.node_tier_of(1).latency == 1e-6


def test_constructor_validation():
    dev = get_device("h100-sxm")
    with pytest.raises(ValueError, match="slowdown factor of device 0 must be in"):
        DeviceGroup("g", dev, 1, 8, slowdown={0: 0.0})
    with pytest.raises(ValueError, match="unavailable device index 8 is outside 0..7"):
        DeviceGroup("g", dev, 1, 8, unavailable=frozenset({8}))
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        NetworkTier("node", 8, 0.0, 1e-6)
    with pytest.raises(ValueError, match="duplicate tier name 'node'"):
        Cluster("c", (DeviceGroup("g", dev, 1, 8),), (NetworkTier("node", 8, 1e9, 0), NetworkTier("node", 8, 1e9, 0)))
    with pytest.raises(ValueError, match="give the group its own node_tier"):
        Cluster("c", (DeviceGroup("g", dev, 1, 4),), (NetworkTier("node", 8, 1e9, 0),))
