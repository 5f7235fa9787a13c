"""The one rank layout (`costmodel.rank_layout`) against an independent enumeration of mesh coordinates, and the
runtime's device mesh (a real `DeviceMesh` on a fake process group) against the groups the cost model prices."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from costmodel_graphs import GptShape, gpt_chain

from costmodel.hardware.cluster import Cluster
from costmodel.rank_layout import (
    axis_strides,
    coordinates_of,
    cp_group,
    device_map,
    dp_group,
    ep_group,
    even_shares,
    even_stages,
    mesh_axes,
    p2p_group,
    rank_of,
    rank_speeds,
    shared_weight_group,
    stage_ranks,
    tp_group,
    type_group,
)
from costmodel.strategy import MeshAxis, Strategy
from planner.runtime.device_mesh import derive_meshes, mesh_layout
from planner.runtime.parallelize import plan_stages
from planner.search.meshes import MESH_ORDERS, enumerate_meshes

TP, CP, DP, PP = MeshAxis.TP, MeshAxis.CP, MeshAxis.DP, MeshAxis.PP
PP_OUTSIDE_DP = ("tp", "cp", "ep", "dp", "pp")
PP_INSIDE_DP = ("tp", "cp", "ep", "pp", "dp")
DP_INNERMOST = ("dp", "tp", "cp", "ep", "pp")

SHAPES = [
    Strategy(dp=2, tp=2, pp=2),
    Strategy(dp=4, tp=2, pp=2, mesh_order=PP_INSIDE_DP),
    Strategy(dp=2, tp=2, pp=2, cp=2, ep=2),
    Strategy(dp=4, tp=2, pp=1, ep=4),
    Strategy(dp=2, tp=2, pp=2, cp=2, ep=4),
    Strategy(dp=4, tp=1, pp=3, ep=2, mesh_order=PP_INSIDE_DP),
    Strategy(dp=3, tp=2, pp=1, cp=2),
    Strategy(dp=2, tp=4, pp=2, mesh_order=DP_INNERMOST),
    Strategy(dp=1, tp=1, pp=4, num_microbatches=4, schedule="interleaved", virtual_stages=2),
]
IDS = [f"dp{s.dp}-tp{s.tp}-pp{s.pp}-cp{s.cp}-ep{s.ep}-{''.join(a.value[0] for a in s.mesh_order)}" for s in SHAPES]


def coordinates(strategy: Strategy) -> Iterator[tuple[int, dict[MeshAxis, int]]]:
    """(rank, coordinates) in row-major order over the axes outermost first, written out from the mesh order
    alone: the last axis of `mesh_order` varies slowest."""
    axes = [a for a in reversed(strategy.mesh_order) if a is not MeshAxis.EP]
    sizes = {TP: strategy.tp, CP: strategy.cp, DP: strategy.dp, PP: strategy.pp}
    for rank, point in enumerate(itertools.product(*(range(sizes[a]) for a in axes))):
        yield rank, dict(zip(axes, point, strict=True))


def ranks_where(strategy: Strategy, **fixed: int) -> list[int]:
    return [r for r, c in coordinates(strategy) if all(c[MeshAxis(k)] == v for k, v in fixed.items())]


def ranks_along(strategy: Strategy, axis: MeshAxis, at: dict[MeshAxis, int]) -> list[int]:
    """The ranks that differ from coordinates `at` only along `axis`, in that axis's order."""
    by_index = {c[axis]: r for r, c in coordinates(strategy)
                if all(c[a] == v for a, v in at.items() if a is not axis)}
    return [by_index[i] for i in sorted(by_index)]


# ---- the layout against the enumeration --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", SHAPES, ids=IDS)
def test_every_rank_sits_at_its_enumerated_coordinates(strategy):
    seen = [rank_of(strategy, c) for _, c in coordinates(strategy)]
    assert seen == list(range(strategy.num_devices))
    assert [a for a, _ in mesh_axes(strategy)] == [a for a in strategy.mesh_order if a is not MeshAxis.EP]


@pytest.mark.parametrize("strategy", SHAPES, ids=IDS)
def test_stage_ranks_are_the_ranks_of_a_pipeline_coordinate(strategy):
    for k in range(strategy.pp):
        assert stage_ranks(strategy, k) == ranks_where(strategy, pp=k)
    assert sorted(r for k in range(strategy.pp) for r in stage_ranks(strategy, k)) == list(range(strategy.num_devices))


def _first_ep_group(strategy: Strategy, k: int) -> list[int]:
    """The first ep of pipeline rank k's tp x dp ranks (cp 0), tp fastest, written out from the coordinates."""
    grid = sorted(((c[DP], c[TP]), r) for r, c in coordinates(strategy) if c[PP] == k and c[CP] == 0)
    return [r for _, r in grid[:strategy.ep]]


def _check_ep_group(strategy: Strategy, k: int) -> None:
    """The priced ep group against `_first_ep_group`: the same ranks where the group is one stride, else the same
    number in every run of dp-stride consecutive ranks."""
    true = _first_ep_group(strategy, k)
    priced = list(ep_group(strategy, k).ranks)
    st = axis_strides(strategy)
    if strategy.tp % strategy.ep == 0 or strategy.tp == 1 or st[DP] == strategy.tp * st[TP]:
        assert priced == true
    else:  # tp consecutive ranks every dp stride, priced as one stride: the same count in every dp-stride run
        assert Counter(r // st[DP] for r in priced) == Counter(r // st[DP] for r in true)


@pytest.mark.parametrize("strategy", SHAPES, ids=IDS)
def test_groups_of_each_pipeline_rank_are_its_peers_along_the_axis(strategy):
    for k in range(strategy.pp):
        first = {TP: 0, CP: 0, DP: 0, PP: k}
        assert list(tp_group(strategy, k).ranks) == ranks_along(strategy, TP, first)
        assert list(cp_group(strategy, k).ranks) == ranks_along(strategy, CP, first)
        _check_ep_group(strategy, k)
        # the gradient reduction spans every dp x cp coordinate of the first tp coordinate
        assert sorted(dp_group(strategy, k).ranks) == ranks_where(strategy, pp=k, tp=0)
        if k:
            assert list(shared_weight_group(strategy, k).ranks) == [0, rank_of(strategy, {PP: k})]


@pytest.mark.parametrize("strategy", SHAPES, ids=IDS)
def test_stage_boundaries_pair_consecutive_pipeline_ranks(strategy):
    firsts = [rank_of(strategy, {PP: k}) for k in range(strategy.pp)]
    for j in range(strategy.pp * strategy.virtual_stages - 1):
        a, b = firsts[j % strategy.pp], firsts[(j + 1) % strategy.pp]
        assert sorted(p2p_group(strategy, j).ranks) == sorted([a, b])


@pytest.mark.parametrize("strategy", SHAPES, ids=IDS)
def test_every_coordinate_sees_a_group_of_the_same_shape(strategy):
    # The cost model prices the group of the first device; the other coordinates' groups must be translates.
    strides = axis_strides(strategy)
    for rank, c in coordinates(strategy):
        for axis in (TP, CP, DP, PP):
            peers = ranks_along(strategy, axis, c)
            assert [b - a for a, b in itertools.pairwise(peers)] == [strides[axis]] * (len(peers) - 1), (rank, axis)


def test_search_meshes_use_the_same_strides():
    for m in enumerate_meshes(16, devices_per_node=8, global_batch=32, max_pp=4, cp_options=(1, 2),
                              ep_options=(1, 2), orders=MESH_ORDERS):
        strategy = Strategy(dp=m.dp, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, mesh_order=m.mesh_order)
        assert {a: m.stride(a) for a in MeshAxis} == axis_strides(strategy), m


def test_strides_of_the_megatron_order_and_a_custom_one():
    st = Strategy(dp=2, tp=2, pp=2)
    assert axis_strides(st) == {TP: 1, CP: 2, DP: 2, MeshAxis.EP: 2, PP: 4}
    assert stage_ranks(st, 1) == [4, 5, 6, 7]
    assert axis_strides(Strategy(dp=2, tp=2, pp=2, mesh_order=DP_INNERMOST))[TP] == 2


def test_coordinates_outside_the_mesh_are_refused():
    with pytest.raises(ValueError, match=r"tp coordinate 2 is outside 0..1"):
        rank_of(Strategy(dp=2, tp=2), {TP: 2})
    with pytest.raises(ValueError, match="give the dp coordinate"):
        rank_of(Strategy(dp=2, ep=2), {MeshAxis.EP: 1})
    with pytest.raises(ValueError, match="owns its shared weights"):
        shared_weight_group(Strategy(pp=2), 0)


# ---- devices and stages ----------------------------------------------------------------------------------------


def test_device_map_runs_logical_ranks_on_the_available_devices_in_order():
    cluster = Cluster.from_dict({"name": "gaps", "groups": [
        {"name": "a", "device": "a100-80gb", "num_nodes": 1, "devices_per_node": 8, "unavailable": [1, 4],
         "slowdown": {6: 0.5}}]})
    strategy = Strategy(dp=3, pp=2, microbatch_size=1, num_microbatches=2)
    available = cluster.available_ranks()
    assert available == (0, 2, 3, 5, 6, 7)
    placements = device_map(cluster, strategy)
    for k, placement in enumerate(placements):
        assert placement.ranks == tuple(available[r] for r in stage_ranks(strategy, k))
    assert [p.speed for p in placements] == [1.0, 0.5]
    assert rank_speeds(cluster, strategy) == (1.0, 1.0, 1.0, 1.0, 0.5, 1.0)


def test_a_device_types_groups_start_on_its_own_devices():
    cluster = Cluster.from_dict({"name": "mixed", "groups": [
        {"name": "a", "device": "a100-80gb", "num_nodes": 1, "devices_per_node": 8},
        {"name": "v", "device": "v100-32gb", "num_nodes": 1, "devices_per_node": 8}]})
    assert type_group(cluster, "v100-32gb", 4, 2).ranks == range(8, 16, 2)
    assert type_group(cluster, "a100-80gb", 4, 2).ranks == range(0, 8, 2)
    assert type_group(cluster, "v100-32gb", 8, 2).ranks == range(0, 16, 2)  # does not fit after rank 8


def test_the_runtime_runs_the_split_the_cost_model_prices():
    chain = gpt_chain(GptShape(layers=6))
    for pp, v in ((2, 1), (3, 1), (2, 2), (4, 1)):
        strategy = Strategy(pp=pp, num_microbatches=4, schedule="interleaved" if v > 1 else "1f1b",
                            virtual_stages=v, recompute="full")
        assert plan_stages(strategy, chain) == even_stages(chain, pp * v, strategy.recompute)


# ---- the runtime's device mesh ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", SHAPES, ids=IDS)
def test_runtime_mesh_coordinates_are_the_cost_models(strategy):
    layout = mesh_layout(strategy)
    for rank, c in coordinates(strategy):
        assert layout.coordinates(rank) == {a.value: i for a, i in c.items()}


@pytest.fixture
def fake_world():
    """Start a fake process group of a given world size as a given rank (no communication happens)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(rank: int, world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("strategy", SHAPES[:4], ids=IDS[:4])
def test_runtime_groups_are_the_priced_groups(strategy, fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    k = strategy.pp - 1  # the first device of the last pipeline rank
    me = rank_of(strategy, {PP: k})
    fake_world(me, strategy.num_devices)
    layout = mesh_layout(strategy)
    meshes = derive_meshes(init_device_mesh("cpu", layout.sizes, mesh_dim_names=layout.names), strategy)
    assert meshes.tp.mesh.tolist() == list(tp_group(strategy, k).ranks)
    assert meshes.cp.mesh.tolist() == list(cp_group(strategy, k).ranks)
    assert sorted(meshes.replicas.mesh.flatten().tolist()) == sorted(dp_group(strategy, k).ranks)
    assert meshes.pp.mesh.tolist() == [rank_of(strategy, {PP: j}) for j in range(strategy.pp)]
    if strategy.ep > 1:
        assert meshes.ep.mesh.tolist() == _first_ep_group(strategy, k)


@pytest.mark.parametrize("strategy", SHAPES, ids=IDS)
def test_coordinates_of_a_rank_invert_rank_of(strategy):
    for rank, c in coordinates(strategy):
        assert coordinates_of(strategy, rank) == c
    with pytest.raises(ValueError, match="outside"):
        coordinates_of(strategy, strategy.num_devices)


def test_even_shares_put_the_remainder_on_the_last_parts():
    assert even_shares(10, 4) == (2, 2, 3, 3)
    assert even_shares(8, 4) == (2, 2, 2, 2)
    assert even_shares(3, 5) == (0, 0, 1, 1, 1)
    for total, parts in itertools.product(range(12), range(1, 6)):
        shares = even_shares(total, parts)
        assert sum(shares) == total and max(shares) - min(shares) <= 1 and list(shares) == sorted(shares)
