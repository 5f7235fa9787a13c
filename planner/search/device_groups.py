"""Device-type groups: which devices run what, and which meshes would put two device types in one lockstep group.

A pipeline rank is a lockstep group (its tensor- and data-parallel peers wait for each other), so it must sit on
one device type; stages on a fast type then get more layers. The search's stage partition does that exactly (each
pipeline rank is priced on its own device and speed and its memory capacity caps what it holds);
`mixed_type_problem` tells the search which meshes would put two types in one lockstep group, and
`with_device_groups` writes the chosen group into every `StageSpec.device_group` so the plan says which devices run
what (`costmodel.rank_layout.device_map` lists the physical ranks). Replicas on different device types are planned
by `planner.scenarios.group_data_parallel` instead.

Logical rank i runs on the i-th available device (`Cluster.available_ranks`), as `costmodel.rank_layout` maps it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import CommGroup
from costmodel.pipeline import stage_rank
from costmodel.rank_layout import cp_group, device_map, dp_group, p2p_group, tp_group
from costmodel.strategy import Strategy


def _strategy_of(dp: int, tp: int, pp: int, cp: int, ep: int, mesh_order: Sequence[Any]) -> Strategy:
    return Strategy(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, mesh_order=tuple(mesh_order))


def axis_tiers(cluster: Cluster, strategy: Strategy) -> dict[str, str | None]:
    """The outermost network tier that each parallel axis's traffic crosses, over all pipeline ranks and stage
    boundaries: "tp" (tensor-parallel collectives), "cp", "dp" (the gradient reduction over dp x cp) and "pp"
    (the sends between consecutive stages). None for an axis of one rank. Ranks are the cost model's (logical)
    ones, so this is what the step time was priced with."""
    groups: dict[str, list[CommGroup]] = {"tp": [], "cp": [], "dp": [], "pp": []}
    for k in range(strategy.pp):
        groups["tp"].append(tp_group(strategy, k))
        groups["cp"].append(cp_group(strategy, k))
        groups["dp"].append(dp_group(strategy, k))
    groups["pp"] = [p2p_group(strategy, j) for j in range(strategy.pp * strategy.virtual_stages - 1)]
    out: dict[str, str | None] = {}
    for axis, gs in groups.items():
        spanned = [cluster.tier_index_spanned(g.size, g.stride, g.start) for g in gs if g.size > 1]
        spanned = [t for t in spanned if t is not None]
        out[axis] = cluster.tiers[max(spanned)].name if spanned else None
    return out


def mixed_type_problem(cluster: Cluster, strategy: Strategy) -> str:
    """Why `strategy`'s mesh puts two device types in one lockstep group ('' when it does not).

    The cost model prices a pipeline rank on one device type; a tensor- or data-parallel group across two types
    would run at the slower type's pace with the faster type's price. Such replicas are planned by
    `plan_group_data_parallel` instead, with batch shares that balance the types."""
    if cluster.is_homogeneous or strategy.num_devices > cluster.num_available:
        return ""
    for placement in device_map(cluster, strategy):
        if len(placement.devices) > 1:
            return (f"pipeline rank {placement.pp_rank} would mix {' and '.join(placement.devices)} in one "
                    f"tensor/data-parallel group (replicas on different types get their own batch shares: "
                    f"group data parallelism)")
    return ""


def mesh_type_problem(cluster: Cluster, *, dp: int, tp: int, pp: int, cp: int = 1, ep: int = 1,
                      mesh_order: Sequence[Any] = ()) -> str:
    """`mixed_type_problem` for a mesh given by its degrees and rank order (what the search enumerates)."""
    if cluster.is_homogeneous:
        return ""
    order = tuple(mesh_order) or Strategy().mesh_order
    return mixed_type_problem(cluster, _strategy_of(dp, tp, pp, cp, ep, order))


def with_device_groups(cluster: Cluster, strategy: Strategy) -> Strategy:
    """`strategy` with `StageSpec.device_group` set to the device group each stage runs on.

    Only for clusters of several groups (one group is the default the field's None stands for); a stage whose
    ranks span groups keeps None. `costmodel.estimate` prices a stage on its group's device, which is the device
    of its first rank, so the estimate does not change."""
    if len(cluster.groups) == 1 or not strategy.stages:
        return strategy
    placements = device_map(cluster, strategy)
    stages = tuple(dataclasses.replace(st, device_group=placements[stage_rank(strategy.schedule, strategy.pp, j)].group)
                   for j, st in enumerate(strategy.stages))
    return dataclasses.replace(strategy, stages=stages)
