"""Mixed device types and stragglers: layer counts follow speed and memory, batch shares balance device
types, and every plan says which devices run what. Hand-checkable cases against closed forms and brute force."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster, Strategy
from costmodel.estimate import estimate
from costmodel.layer_pricing import price_segment
from costmodel.rank_layout import device_map
from planner.errors import UserError
from planner.scenarios.group_data_parallel import (
    balance_shares,
    group_cluster,
    plan_group_data_parallel,
    proportional_split,
    searching,
)
from planner.search.branch_and_bound import search
from planner.search.candidates import device_counts
from planner.search.device_groups import mixed_type_problem, with_device_groups
from planner.search.space import Objective, SearchSpace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
BLOCKS = 12
# Small vocabulary: the embedding and head are cheap, so the blocks carry the balance.
SHAPE = GptShape(layers=BLOCKS, hidden=1024, heads=16, seq=1024, vocab=128, batch=1)


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE, attention="flash")


def _two_devices(first: str, second: str, *, memory: str | None = None) -> Cluster:
    groups = [{"name": "first", "device": first, "num_nodes": 1, "devices_per_node": 1},
              {"name": "second", "device": second, "num_nodes": 1, "devices_per_node": 1}]
    if memory:
        groups[1]["memory"] = memory
    return Cluster.from_dict({"name": "pair", "groups": groups})


def _blocks_per_stage(strategy: Strategy, chain) -> list[int]:
    block = chain.segments[1].class_id
    return [sum(1 for s in chain.segments[st.start:st.stop] if s.class_id == block) for st in strategy.stages]


def _block_time(chain, device) -> float:
    c = price_segment(chain, chain.segments[1], device, microbatch_size=1)
    return c.fwd_compute_s + c.bwd_compute_s


# ---- proportional shares -------------------------------------------------------------------------------------


def test_proportional_split_closed_forms() -> None:
    assert proportional_split(12, [1.0, 0.5]) == (8, 4)          # a half-speed partner gets half
    assert proportional_split(10, [1.0, 1.0, 1.0]) == (4, 3, 3)  # remainder to the earliest tie
    assert proportional_split(7, [2.0, 1.0]) == (5, 2)           # 4.67 / 2.33: the larger remainder wins
    assert proportional_split(12, [1.0, 1.0], caps=[4, 100]) == (4, 8)  # memory caps the first, the rest spills
    assert proportional_split(9, [0.0, 1.0]) == (0, 9)
    with pytest.raises(ValueError, match="cannot hold"):
        proportional_split(12, [1.0, 1.0], caps=[4, 4])
    with pytest.raises(ValueError, match="weights"):
        proportional_split(3, [0.0, 0.0])


# ---- balancing batch shares against brute force --------------------------------------------------------------


def _brute_force(total, units, table):
    best = None
    for counts in itertools.product(*(range(len(t)) for t in table)):
        if sum(u * m for u, m in zip(units, counts, strict=True)) != total:
            continue
        value = max(t[m] for t, m in zip(table, counts, strict=True))
        if best is None or value < best:
            best = value
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balance_shares_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    k = rng.randint(1, 3)
    units = [rng.randint(1, 4) for _ in range(k)]
    total = rng.randint(1, 24)
    table = []
    for u in units:
        limit = total // u
        steps = [0.0]
        for _ in range(limit):  # non-decreasing, sometimes flat, sometimes infinite (does not fit) at the end
            steps.append(steps[-1] + rng.choice([0.0, rng.uniform(0.1, 3.0)]))
        if rng.random() < 0.3 and limit >= 2:
            steps[-1] = float("inf")
        table.append(steps)
    found = balance_shares(total, units, lambda g, m: table[g][m], [len(t) - 1 for t in table])
    expected = _brute_force(total, units, table)
    if expected is None or expected == float("inf"):
        assert found is None or found[1] == expected
        return
    counts, value = found
    assert sum(u * m for u, m in zip(units, counts, strict=True)) == total
    assert value == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert max(table[g][m] for g, m in enumerate(counts)) == value


def test_balance_shares_two_speeds_closed_form() -> None:
    # Group 0 takes 1 s per micro-batch, group 1 (half speed) 2 s; 12 micro-batches: 8 and 4 make 8 s each.
    counts, value = balance_shares(12, [1, 1], lambda g, m: m * (1.0 if g == 0 else 2.0), [12, 12])
    assert counts == (8, 4) and value == 8.0
    assert balance_shares(5, [2, 4], lambda g, m: float(m), [2, 1]) is None  # even units cannot make 5


# ---- stragglers: a half-speed device gets about half the layers ----------------------------------------------


@pytest.mark.parametrize("slow_rank", [0, 1])
def test_half_speed_device_gets_half_the_layers_of_its_partner(chain, slow_rank: int) -> None:
    cluster = Cluster.parse("1x2xa100-80gb").with_speed(slow_rank, 0.5)
    best = search(chain, cluster, global_batch=32, space=SearchSpace(pp=2, recompute="none", schedule="1f1b")).best
    blocks = _blocks_per_stage(best.strategy, chain)
    slow, fast = blocks[slow_rank], blocks[1 - slow_rank]
    assert slow + fast == BLOCKS
    assert abs(slow - BLOCKS / 3) <= 1 and abs(fast - 2 * BLOCKS / 3) <= 1  # 4 and 8: speed-proportional
    # Without the straggler the split is even.
    even = search(chain, Cluster.parse("1x2xa100-80gb"), global_batch=32,
                  space=SearchSpace(pp=2, recompute="none", schedule="1f1b")).best
    assert _blocks_per_stage(even.strategy, chain) == [BLOCKS // 2, BLOCKS // 2]
    # The slow stage sets no worse a pace than the even split would on this cluster (the search beat it).
    forced = estimate(chain, cluster, dataclasses.replace(best.strategy, stages=even.strategy.stages))
    assert best.estimate.step_time_s < forced.step_time_s


def test_slowest_device_sets_the_pace_of_a_lockstep_group(chain) -> None:
    st = Strategy(dp=2, microbatch_size=1, num_microbatches=16)
    nominal = estimate(chain, Cluster.parse("1x2xa100-80gb"), st)
    slowed = estimate(chain, Cluster.parse("1x2xa100-80gb").with_speed(1, 0.5), st)
    compute = nominal.breakdown.compute_s
    assert slowed.breakdown.compute_s == pytest.approx(2 * compute, rel=1e-9)


# ---- mixed types: stages on different devices ----------------------------------------------------------------


def test_stages_on_a100_and_v100_get_layers_in_proportion_to_speed(chain) -> None:
    cluster = _two_devices("a100-80gb", "v100-32gb")
    best = search(chain, cluster, global_batch=32, space=SearchSpace(pp=2, recompute="none", schedule="1f1b")).best
    a100, v100 = _blocks_per_stage(best.strategy, chain)
    t_a, t_v = (_block_time(chain, g.device) for g in cluster.groups)
    ideal = BLOCKS * t_v / (t_a + t_v)  # equal stage times: n_a * t_a == n_v * t_v
    assert t_v > 1.5 * t_a
    assert abs(a100 - ideal) <= 1 and a100 + v100 == BLOCKS
    placed = with_device_groups(cluster, best.strategy)
    assert [s.device_group for s in placed.stages] == ["first", "second"]
    assert [s.device for s in best.estimate.stages] == ["a100-80gb", "v100-32gb"]
    # Naming the groups does not change the price.
    assert estimate(chain, cluster, placed).step_time_s == pytest.approx(
        estimate(chain, cluster, best.strategy).step_time_s, rel=1e-12)


def test_memory_caps_the_layers_of_a_small_device(chain) -> None:
    big = GptShape(layers=BLOCKS, hidden=4096, heads=32, seq=1024, vocab=128, batch=1)
    heavy = gpt_chain(big, attention="flash")
    cluster = _two_devices("a100-80gb", "a100-80gb", memory="20GB")
    space = SearchSpace(pp=2, recompute="none", zero_stage=0)
    best = search(heavy, cluster, global_batch=8, space=space).best
    first, second = _blocks_per_stage(best.strategy, heavy)
    assert best.estimate.fits and second < first      # equal speeds, but the 20 GB device holds fewer blocks
    # ... and exactly as many as fit: one more block there would not fit.
    s0, s1 = best.strategy.stages
    moved = dataclasses.replace(best.strategy, stages=(dataclasses.replace(s0, stop=s0.stop - 1),
                                                       dataclasses.replace(s1, start=s1.start - 1)))
    assert not estimate(heavy, cluster, moved).fits


def test_mixed_type_lockstep_groups_are_detected() -> None:
    cluster = _two_devices("a100-80gb", "v100-32gb")
    assert "mix a100-80gb and v100-32gb" in mixed_type_problem(cluster, Strategy(dp=2))
    assert mixed_type_problem(cluster, Strategy(pp=2)) == ""
    assert mixed_type_problem(Cluster.parse("1x2xa100-80gb"), Strategy(dp=2)) == ""


def test_device_map_skips_failed_devices_and_reports_pace() -> None:
    cluster = Cluster.parse(str(EXAMPLES / "straggler.yaml"))  # 16 H100: #3 at 0.5x, #12 unavailable
    placements = device_map(cluster, Strategy(dp=3, pp=5, microbatch_size=1, num_microbatches=1))
    used = [r for p in placements for r in p.ranks]
    assert 12 not in used and len(used) == 15 and sorted(used) == [r for r in range(16) if r != 12]
    paces = {p.pp_rank: p.speed for p in placements}
    assert paces[1] == 0.5 and all(v == 1.0 for k, v in paces.items() if k != 1)  # rank 3 is in pipeline rank 1
    assert all(p.groups == ("h100",) and p.devices == ("h100-sxm",) for p in placements)


@pytest.mark.parametrize("nodes", [2, 5, 7, 11, 23, 47, 127, 128, 200])
def test_a_failed_device_leaves_at_least_two_thirds_of_the_nodes_searched(nodes: int) -> None:
    """With one device of the cluster failed, the time search still plans for a whole-node count of at least 2/3
    of the nodes (2^i and 3 * 2^i nodes: `device_counts`), not only the power of two below (half of them)."""
    cluster = Cluster.parse(f"{nodes}x8xa100-80gb")
    failed = dataclasses.replace(cluster, groups=(dataclasses.replace(cluster.groups[0], unavailable=frozenset({5})),))
    counts = device_counts(failed, SearchSpace(), Objective.TIME)
    assert counts[0] == nodes * 8 - 1
    whole = max(c for c in counts if c % 8 == 0)
    assert whole >= 8 * (nodes - 1) * 2 / 3, (nodes, whole)
    assert set(device_counts(Cluster.parse("1x8xa100-80gb"), SearchSpace(), Objective.TIME)) == set(range(1, 9))


def test_group_cluster_keeps_each_groups_own_link() -> None:
    cluster = Cluster.parse(str(EXAMPLES / "mixed-a100-v100.yaml"))
    a100, v100 = group_cluster(cluster, 0), group_cluster(cluster, 1)
    assert a100.num_devices == v100.num_devices == 32
    assert a100.tiers[0].bandwidth == 300e9 and v100.tiers[0].bandwidth == 150e9  # NVLink 3 vs NVLink 2
    assert a100.tiers[-1].bandwidth == cluster.tiers[-1].bandwidth


# ---- mixed types: data-parallel replicas with batch shares -----------------------------------------------------


@pytest.fixture(scope="module")
def mixed_pairs() -> Cluster:
    return Cluster.from_dict({"name": "mixed", "groups": [
        {"name": "a100", "device": "a100-80gb", "num_nodes": 1, "devices_per_node": 2},
        {"name": "v100", "device": "v100-32gb", "num_nodes": 1, "devices_per_node": 2}]})


def test_group_data_parallel_balances_step_times(chain, mixed_pairs) -> None:
    batch = 48
    plan = plan_group_data_parallel(chain, mixed_pairs, batch, searching(SearchSpace(tp=1, cp=1)))
    a100, v100 = plan.shares
    assert a100.samples + v100.samples == batch and a100.samples > v100.samples
    assert plan.step_time_s == pytest.approx(max(a100.step_time_s, v100.step_time_s) + plan.sync_s, rel=1e-12)
    assert plan.sync_s > 0 and plan.fits
    # Brute force over every split the two strategies allow: none has a smaller slowest group.
    subs = [group_cluster(mixed_pairs, g) for g in range(2)]
    units = [s.strategy.dp * s.strategy.microbatch_size for s in plan.shares]
    best = None
    for m0 in range(batch // units[0] + 1):
        rest = batch - m0 * units[0]
        if rest % units[1]:
            continue
        m = (m0, rest // units[1])
        times = [estimate(chain, subs[g], dataclasses.replace(plan.shares[g].strategy, num_microbatches=m[g]))
                 .step_time_s if m[g] else 0.0 for g in range(2)]
        best = max(times) if best is None else min(best, max(times))
    assert max(a100.step_time_s, v100.step_time_s) == pytest.approx(best, rel=1e-9)
    # Equal shares would wait on the V100s.
    if batch // 2 % units[1] == 0:
        equal = estimate(chain, subs[1], dataclasses.replace(v100.strategy, num_microbatches=batch // 2 // units[1]))
        assert equal.step_time_s > max(a100.step_time_s, v100.step_time_s)


def test_group_data_parallel_needs_several_groups(chain) -> None:
    with pytest.raises(UserError, match="several device groups"):
        plan_group_data_parallel(chain, Cluster.parse("1x2xa100-80gb"), 8, searching())


def test_search_never_mixes_types_in_a_lockstep_group(chain, mixed_pairs) -> None:
    from planner import api
    from planner.search.branch_and_bound import SearchOptions

    result = search(chain, mixed_pairs, global_batch=16, options=SearchOptions(top_k=3))
    assert all(mixed_type_problem(mixed_pairs, r.strategy) == "" for r in result.ranked)
    plan = api.plan(chain, None, mixed_pairs, global_batch=16)
    placements = device_map(mixed_pairs, plan.strategy)
    assert [s.device_group for s in plan.strategy.stages] == [placements[j % plan.strategy.pp].group
                                                             for j in range(len(plan.strategy.stages))]
    assert None not in {s.device_group for s in plan.strategy.stages}
    with pytest.raises(UserError, match="would mix a100-80gb and v100-32gb"):
        api.estimate_plan(chain, mixed_pairs, Strategy(dp=4, microbatch_size=1, num_microbatches=4), global_batch=16)


def test_each_device_type_prices_tensor_parallelism_on_its_own_node_link(chain) -> None:
    from planner.search.layer_costs import LayerCostTable

    mixed = Cluster.parse(str(EXAMPLES / "mixed-a100-v100.yaml"))
    a100, v100 = (g.device for g in mixed.groups)
    key = dict(tp=2, tp_stride=1, sequence_parallel=False, microbatch_size=1)
    on_mixed = LayerCostTable(chain, mixed)
    alone = LayerCostTable(chain, group_cluster(mixed, 1)).segment_costs(v100, **key)[1]
    v100_block, a100_block = on_mixed.segment_costs(v100, **key)[1], on_mixed.segment_costs(a100, **key)[1]
    assert v100_block.fwd_comm_s == alone.fwd_comm_s > 0          # NVLink 2 of the V100 nodes
    assert a100_block.fwd_comm_s < v100_block.fwd_comm_s          # NVLink 3 is twice as fast
