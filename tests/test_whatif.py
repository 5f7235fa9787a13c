"""What-if sweeps and cost: `--vary` parsing and cluster edits, monotone answers, the cheapest
configuration above a throughput floor, and `stratagem whatif`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster
from costmodel.hardware.catalog import get_device
from planner.cli.main import main
from planner.errors import UserError
from planner.scenarios.variations import VaryKind, parse_vary, scenarios, spec_mapping
from planner.scenarios.whatif import WhatIfOptions, pick_best, render_table, whatif
from planner.search.space import Objective

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
TWO_DC = str(EXAMPLES / "two-datacenters.yaml")
SHAPE = GptShape(layers=8, hidden=1024, heads=16, seq=1024, vocab=128, batch=1)


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE, attention="flash")


# ---- parsing and editing ---------------------------------------------------------------------------------------


def test_parse_vary_forms() -> None:
    v = parse_vary("tier.interconnect.bandwidth=50GB/s, 100GB/s")
    assert (v.kind, v.target, v.field, v.values) == (VaryKind.TIER, "interconnect", "bandwidth", ("50GB/s", "100GB/s"))
    assert parse_vary("device=a100-80gb,h100-sxm@9.8").values == ("a100-80gb", "h100-sxm@9.8")
    assert parse_vary("group.v100.num_nodes=2,4").kind is VaryKind.GROUP
    assert parse_vary("speed.3=1,0.5,0").target == "3"
    assert parse_vary("batch=8,16").kind is VaryKind.BATCH


@pytest.mark.parametrize(("text", "message"), [
    ("bandwidth=1", "unknown key 'bandwidth'; keys: tier.NAME.bandwidth"),
    ("tier.node.speed=1", "unknown key"),
    ("nodes", "expected KEY=V1,V2"),
    ("batch=8,x", "'x' is not a positive integer"),
    ("speed.1=2", "must be a number in [0, 1]"),
    ("nodes=2,2", "repeated"),
])
def test_parse_vary_errors_list_the_keys(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_vary(text)


def test_tier_bandwidth_edit_reaches_the_cluster() -> None:
    rows = scenarios(TWO_DC, 64, None, [parse_vary("tier.interconnect.bandwidth=50GB/s,400Gbps")])
    assert [r.values for r in rows] == [(("tier.interconnect.bandwidth", "50GB/s"),),
                                        (("tier.interconnect.bandwidth", "400Gbps"),)]
    inter = [r.cluster.tiers[r.cluster.tier_index("interconnect")] for r in rows]
    assert [t.bandwidth for t in inter] == [50e9, 50e9]  # 400 Gb/s is 50 GB/s; aggregate_bandwidth was replaced
    base = Cluster.parse(TWO_DC)
    assert rows[0].cluster.tiers[:2] == base.tiers[:2]


def test_device_edit_brings_its_own_links_and_price() -> None:
    (a100, h100) = scenarios("2x8xa100-80gb", 16, None, [parse_vary("device=a100-80gb@5.12,h100-sxm@9.8")])
    assert h100.cluster.groups[0].device == get_device("h100-sxm")
    assert h100.cluster.tiers[0].bandwidth == get_device("h100-sxm").intra_node_bandwidth   # NVLink 4, not 3
    assert a100.cluster.tiers[0].bandwidth == get_device("a100-80gb").intra_node_bandwidth
    assert (a100.cluster.price_per_hour, h100.cluster.price_per_hour) == (16 * 5.12, 16 * 9.8)


def test_nodes_batch_seq_and_speed_make_the_product() -> None:
    rows = scenarios(TWO_DC, 64, None, [parse_vary("nodes=8,16"), parse_vary("batch=64,128"),
                                        parse_vary("speed.3=0.5")])
    assert [(r.cluster.num_devices, r.global_batch) for r in rows] == [(64, 64), (64, 128), (128, 64), (128, 128)]
    assert all(r.cluster.speed_of(3) == 0.5 for r in rows)
    # The last tier spanned the whole old cluster, so it spans the resized one.
    assert rows[0].cluster.tiers[-1].size == 64
    seq = scenarios("1x4xcpu", 8, None, [parse_vary("seq=32,64")])
    assert [s.seq for s in seq] == [32, 64]


def test_candidate_clusters_and_bad_edits() -> None:
    rows = scenarios(None, 8, None, [parse_vary(f"cluster=1x4xcpu,{EXAMPLES / 'straggler.yaml'}")])
    assert [r.cluster.name for r in rows] == ["1x4xcpu", "straggler"]
    with pytest.raises(UserError, match="nodes applies to a one-group cluster; use group.NAME.num_nodes"):
        scenarios(str(EXAMPLES / "mixed-a100-v100.yaml"), 8, None, [parse_vary("nodes=2")])
    with pytest.raises(UserError, match="no tier 'rack'; tiers: node, datacenter, interconnect"):
        scenarios(TWO_DC, 8, None, [parse_vary("tier.rack.bandwidth=1GB/s")])
    with pytest.raises(UserError, match=r"--vary device=h900: .*unknown device 'h900'"):
        scenarios("1x8xa100-80gb", 8, None, [parse_vary("device=h900")])
    with pytest.raises(UserError, match="give --cluster"):
        scenarios(None, 8, None, [parse_vary("nodes=1")])
    assert spec_mapping("2x8xh100-sxm")["groups"] == [{"device": "h100-sxm", "num_nodes": 2, "devices_per_node": 8}]


# ---- sweeps ----------------------------------------------------------------------------------------------------


def _dc_spec(folder: Path) -> str:
    path = folder / "dc.yaml"
    path.write_text("""name: dc
groups:
  - device: h100-sxm
    num_nodes: 2
    devices_per_node: 4
    price_per_device_hour: 9.8
tiers:
  - name: node
  - name: interconnect
    bandwidth: 400Gbps
""")
    return str(path)


def test_faster_link_never_slows_the_best_plan(chain, tmp_path: Path) -> None:
    rows = scenarios(_dc_spec(tmp_path), 64, None,
                     [parse_vary("tier.interconnect.bandwidth=0.5GB/s,5GB/s,50GB/s")])
    result = whatif(lambda seq: chain, rows)
    times = [r.step_time_s for r in result.rows]
    assert all(r.ok for r in result.rows)
    assert times[0] >= times[1] >= times[2]
    assert result.best == min(range(3), key=lambda i: (times[i], i))
    for r in result.rows:  # throughput, tokens and cost follow from the step time and the prices
        assert r.samples_per_s == pytest.approx(64 / r.step_time_s)
        assert r.tokens_per_s == pytest.approx(64 * SHAPE.seq / r.step_time_s)
        assert r.price_per_hour == pytest.approx(9.8 * r.num_devices)
        assert r.cost_per_million == pytest.approx(r.price_per_hour / 3600 * r.step_time_s / (64 * SHAPE.seq) * 1e6)
    assert "* fastest" in render_table(result)


def test_cheapest_configuration_above_a_throughput_floor(chain, tmp_path: Path) -> None:
    one_node = tmp_path / "one.yaml"
    one_node.write_text("groups:\n  - {device: h100-sxm, num_nodes: 1, devices_per_node: 4, "
                        "price_per_device_hour: 9.8}\n")
    rows = scenarios(None, 64, None, [parse_vary(f"cluster={_dc_spec(tmp_path)},{one_node}")])
    fastest = whatif(lambda seq: chain, rows)
    rate = [r.tokens_per_s for r in fastest.rows]
    # A floor between the two: only the faster cluster reaches it.
    cheap = whatif(lambda seq: chain, rows,
                   options=WhatIfOptions(objective=Objective.COST, min_throughput=0.5 * max(rate)))
    assert cheap.best is not None and cheap.rows[cheap.best].meets_floor
    meeting = [r for r in cheap.rows if r.meets_floor]
    assert cheap.rows[cheap.best].cost_per_million == min(r.cost_per_million for r in meeting)
    assert all(r.throughput >= 0.5 * max(rate) for r in meeting)
    # An unreachable floor: nothing is picked.
    none = whatif(lambda seq: chain, rows, options=WhatIfOptions(objective=Objective.COST, min_throughput=1e15))
    assert none.best is None and all(r.meets_floor is False for r in none.rows)
    assert "no scenario reaches the throughput floor" in render_table(none)


def test_cost_objective_needs_prices(chain) -> None:
    rows = scenarios("1x8xh100-sxm", 64, None, [parse_vary("nodes=1")])
    result = whatif(lambda seq: chain, rows, options=WhatIfOptions(objective=Objective.COST))
    assert not result.rows[0].ok and "needs a price" in result.rows[0].error
    assert pick_best(result.rows, Objective.COST) is None
    with pytest.raises(UserError, match="--min-throughput applies with --objective cost"):
        whatif(lambda seq: chain, rows, options=WhatIfOptions(min_throughput=1.0))


def test_mixed_cluster_rows_consider_group_data_parallelism(chain) -> None:
    mixed = """name: mixed
groups:
  - {name: a100, device: a100-80gb, num_nodes: 1, devices_per_node: 2}
  - {name: v100, device: v100-32gb, num_nodes: 1, devices_per_node: 2}
"""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mixed.yaml"
        path.write_text(mixed)
        rows = scenarios(None, 48, None, [parse_vary(f"cluster={path}")])
        with_groups = whatif(lambda seq: chain, rows).rows[0]
        without = whatif(lambda seq: chain, rows, options=WhatIfOptions(group_data_parallel=False)).rows[0]
    assert with_groups.step_time_s <= without.step_time_s
    assert math.isfinite(with_groups.step_time_s)


# ---- the command line ------------------------------------------------------------------------------------------


def test_cli_whatif_table_json_and_plot(tmp_path: Path, capsys) -> None:
    argv = ["whatif", "gpt-tiny", "--set", "layers=2", "--cluster", "1x2xcpu", "--batch", "4", "--vary",
            "nodes=1,2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "nodes" in out and "tokens/s" in out and "* fastest" in out
    pytest.importorskip("matplotlib")
    png = tmp_path / "whatif.png"
    assert main([*argv, "--json", "--plot", str(png)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["keys"] == ["nodes"] and len(data["rows"]) == 2 and data["throughput_unit"] == "tokens/s"
    assert [r["values"]["nodes"] for r in data["rows"]] == ["1", "2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("argv", "message"), [
    (["--vary", "bogus=1"], "unknown key 'bogus'"),
    (["--vary", "nodes=1", "--min-throughput", "5"], "--min-throughput needs --objective cost"),
    (["--vary", "device=h900"], "unknown device 'h900'"),
])
def test_cli_whatif_errors(capsys, argv, message) -> None:
    assert main(["whatif", "gpt-tiny", "--cluster", "1x4xcpu", "--batch", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
