"""Pricing a solved candidate: its layer costs for `costmodel.estimate`, its modules' tensor-parallel sharding, the
price of its devices per second, and the smallest device memory it would fit in."""

from __future__ import annotations

import math
from collections.abc import Sequence

from costmodel.hardware.cluster import Cluster
from costmodel.layer_cost import LayerCost
from costmodel.strategy import Recompute, StageSpec
from planner.errors import UserError
from planner.plan import ModuleSharding
from planner.search.candidates import (
    Candidate,
)
from planner.search.layer_costs import module_sharding
from planner.search.stage_problem import StageProblemBuilder


def price_per_second(cluster: Cluster, num_devices: int) -> float:
    """Sum of the prices of ranks 0..num_devices-1, per second."""
    total, rank = 0.0, 0
    for g in cluster.groups:
        take = min(g.num_devices, num_devices - rank)
        if take <= 0:
            break
        if g.price_per_device_hour is None:
            raise UserError(f"--objective cost needs a price for every device; group {g.name!r} has none "
                            f"(set price_per_device_hour in the cluster YAML)")
        total += take * g.price_per_device_hour
        rank += take
    return total / 3600.0


def layer_cost_map(builder: StageProblemBuilder, cand: Candidate, placements) -> dict[tuple[int, str], LayerCost]:
    """`costmodel.estimate`'s layer_costs for a candidate: (class id, device name) -> LayerCost."""
    out: dict[tuple[int, str], LayerCost] = {}
    for pl in placements:
        costs = builder.segment_costs(cand, pl.device)
        for seg, c in zip(builder.chain.segments, costs, strict=True):
            out[(seg.class_id, pl.device.name)] = c
    return out


def sharding_of(builder: StageProblemBuilder, cand: Candidate, placements) -> tuple[ModuleSharding, ...]:
    if cand.mesh.tp == 1:
        return ()
    prices = builder.table.rank_prices(placements[0].device, tp=cand.mesh.tp, tp_stride=1,
                                       sequence_parallel=cand.sequence_parallel,
                                       microbatch_size=cand.microbatch_size, cp=cand.mesh.cp)
    return module_sharding(builder.chain, prices)


def summary_recompute(stages: Sequence[StageSpec]) -> Recompute:
    """The strategy-level recomputation of per-stage choices: the heaviest used (full, op, selective, none)."""
    used = {s.recompute for s in stages}
    for r in (Recompute.FULL, Recompute.OP, Recompute.SELECTIVE):
        if r in used:
            return r
    return Recompute.NONE


def least_memory_of(built) -> float:
    """Smallest per-device capacity with which the candidate would fit (bottleneck over stage memories)."""
    import numpy as np

    problem = built.problem
    p, n = problem.num_stages, problem.num_segments
    best = np.full(n + 1, np.inf)
    best[n] = 0.0
    for k in range(p - 1, -1, -1):
        q = problem.stage_profile[k]
        mem = (problem.memory_base[q] + problem.in_flight[k] * problem.memory_per_microbatch[q]).min(axis=0)  # best option per (a, b)
        a = np.arange(n + 1)[:, None]
        b = np.arange(n + 1)[None, :]
        ok = (b > a) & (a >= k) & (b <= n - (p - 1 - k)) & ((b == n) if k == p - 1 else True)
        cand = np.where(ok, np.maximum(mem, best[None, :]), np.inf)
        new = cand.min(axis=1)
        if k == 0:
            return float(new[0])
        best = new
    return math.inf
