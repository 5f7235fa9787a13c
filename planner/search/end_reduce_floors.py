"""Lower bounds on the end-of-step gradient reduction of a candidate's fullest pipeline rank, the term behind
`planner.search.bounds.end_reduce_lower_bound`: at level 1 from an even parameter split, at level 2 from the
candidate's own layer prices. Priced by `costmodel.step_time.data_parallel_comm` itself and cached per what they
depend on, for `planner.search.candidate_bounds.CandidateBounds`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from costmodel.expert_parallel import dp_synced_params, synced_params
from costmodel.hardware.collectives import CommGroup
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.rank_layout import dp_group
from costmodel.step_time import data_parallel_comm
from costmodel.strategy import Offload
from ir.graph import dtype_bytes
from planner.search.candidates import Candidate
from planner.search.meshes import MeshCandidate
from planner.search.stage_problem import RankPlacement, StageProblemBuilder


@dataclass
class EndReduceFloors:
    """The floors of one search (its builder's layer prices and placements), with their caches."""

    builder: StageProblemBuilder
    dtype: str
    even_params: Callable[[MeshCandidate], tuple[int, int]]
    """(parameters, of which expert weights) of an even 1/(tp*pp) share, p of which hold at most the model's."""
    _floor: dict[tuple, float] = field(default_factory=dict)
    _even: dict[tuple, float] = field(default_factory=dict)
    _synced: dict[tuple, tuple[Sequence[LayerCost], np.ndarray]] = field(default_factory=dict)
    _groups: dict[MeshCandidate, list[tuple[DeviceSpec, CommGroup]]] = field(default_factory=dict)

    def floor(self, cand: Candidate, placements: Sequence[RankPlacement]) -> float:
        """At most the largest pipeline rank's end-of-step gradient reduction (`bounds.end_reduce_lower_bound`; 0
        where the step has none), from the candidate's layer prices: each segment's data-parallel parameters at
        the least over the device types' sharding solves; rank r holds at least its segments' share of that, and
        some rank 1/p of the chain's (`_least_end_reduce`). Cached per mesh, ZeRO stage, runtime and layer
        prices."""
        m = cand.mesh
        if not self._reduces_at_end(cand):
            return 0.0
        # The sharding solved for (tp, sp, micro-batch size) decides which weights tp splits.
        key = (m, cand.zero_stage, cand.runtime, cand.sequence_parallel, cand.microbatch_size)
        hit = self._floor.get(key)
        if hit is None:
            groups = self._dp_groups(cand, placements)
            per_segment = np.min([self._synced_params(self.builder.segment_costs(cand, device), m.dp * m.cp, m.ep_dp)
                                  for device in {d.name: d for d, _ in groups}.values()], axis=0)
            hit = self._floor[key] = self._least_end_reduce(cand, groups, float(per_segment.sum()) / m.pp)
        return hit

    def even_floor(self, cand: Candidate, placements: Sequence[RankPlacement]) -> float:
        """`floor` before any layer price (level 1): the fullest rank holds at least an even 1/(tp*pp)
        share of the parameters (`even_params`), experts synced over fewer ranks as `dp_synced_params` counts
        them. Cached per mesh, ZeRO stage and runtime."""
        m = cand.mesh
        if not self._reduces_at_end(cand):
            return 0.0
        key = (m, cand.zero_stage, cand.runtime)
        hit = self._even.get(key)
        if hit is None:
            share, experts = self.even_params(m)
            params = synced_params(share - experts, experts, dp_size=m.dp * m.cp, ep_dp=m.ep_dp)
            hit = self._even[key] = self._least_end_reduce(cand, self._dp_groups(cand, placements), params)
        return hit

    @staticmethod
    def _reduces_at_end(cand: Candidate) -> bool:
        """Whether the step ends with a gradient reduction (`step_time.data_parallel_comm`): ZeRO-0/1, and ZeRO-2/3
        under pipelining unless FSDP2 offloads the parameters (then every micro-batch reduces, `comm_bound`'s)."""
        m, zero = cand.mesh, cand.zero_stage
        return m.dp * m.cp > 1 and (zero <= 1 or (m.pp > 1 and cand.runtime.offload is not Offload.PARAMS))

    def _least_end_reduce(self, cand: Candidate, groups: Sequence[tuple[DeviceSpec, CommGroup]],
                          params: float) -> float:
        """The end-of-step reduction of `params` parameters in one piece, on the cheapest of `groups`: no longer
        than any rank's reduction of at least as many, in one or more pieces (a collective's seconds per byte only
        fall with its size)."""
        m, runtime = cand.mesh, cand.runtime
        weight_bytes = dtype_bytes(self.dtype)
        return min(data_parallel_comm(
            zero_stage=cand.zero_stage, grad_bytes=params * runtime.grad_bytes(weight_bytes),
            param_bytes=params * weight_bytes, num_segments=1, fwd_window_s=0.0, bwd_window_s=0.0, group=group,
            cluster=self.builder.cluster, concurrent=m.tp * m.pp, overlap=False, pipelined=m.pp > 1).end_reduce_s
            for _, group in groups)

    def _synced_params(self, costs: Sequence[LayerCost], dp_size: int, ep_dp: int) -> np.ndarray:
        """Per segment, `expert_parallel.dp_synced_params` (cached per segment prices, which the builder keeps)."""
        hit = self._synced.get((id(costs), dp_size, ep_dp))
        if hit is None or hit[0] is not costs:
            hit = self._synced[id(costs), dp_size, ep_dp] = (costs, np.array(
                [dp_synced_params([c], dp_size=dp_size, ep_dp=ep_dp) for c in costs]))
        return hit[1]

    def _dp_groups(self, cand: Candidate, placements: Sequence[RankPlacement]) -> list[tuple[DeviceSpec, CommGroup]]:
        """(device, data-parallel group) of the mesh's pipeline ranks, one per distinct pair (cached per mesh)."""
        hit = self._groups.get(cand.mesh)
        if hit is None:
            strategy = self.builder.strategy_of(cand)
            pairs = {(pl.device.name, self.builder.group_signature(group)): (pl.device, group)
                     for k, pl in enumerate(placements) for group in [dp_group(strategy, k)]}
            hit = self._groups[cand.mesh] = list(pairs.values())
        return hit
