"""The search's lower bound from data-parallel communication (`bounds.comm_lower_bound`): below every price."""

from __future__ import annotations

import time

from costmodel.hardware.cluster import Cluster
from costmodel.strategy import Recompute
from planner.search.bounds import comm_lower_bound
from planner.search.branch_and_bound import SearchState
from planner.search.candidates import candidates_for
from planner.search.layer_costs import LayerCostTable
from planner.search.outcome import SearchOptions
from planner.search.space import SearchSpace
from planner.search.stage_partition import solve_partition
from planner.search.stage_problem import StageProblem, StageProblemBuilder
from planner.tracing import trace_model

BATCH = 64


def _state() -> SearchState:
    # Four nodes of two: ZeRO-2/3 collectives over InfiniBand outweigh the compute of small micro-batches.
    chain = trace_model("gpt2", dtype="bfloat16").chain
    cluster = Cluster.parse("4x2xa100-80gb")
    builder = StageProblemBuilder(chain, cluster, LayerCostTable(chain, cluster))
    return SearchState(chain, cluster, BATCH, SearchSpace(), SearchOptions(), "bfloat16", builder, time.monotonic())


def test_the_comm_bound_is_below_the_solved_step_and_binds_somewhere():
    state = _state()
    cands = [c for c in candidates_for(8, state.chain, state.cluster, BATCH, state.space, {})
             if c.zero_stage >= 2 and c.mesh.dp * c.mesh.cp > 1]
    assert cands
    binding = 0
    for cand in cands[::8]:
        placements = state.builder.placements(cand)
        comm = state.bounds.comm_per_segment(cand, placements)
        bound = state.bounds.tight(cand)
        built = state.builder.build(cand, tuple(Recompute), partial=True)
        if not isinstance(built, StageProblem):
            continue
        part = solve_partition(built.problem)
        if part is None:
            continue
        assert bound <= part.objective * (1 + 1e-9), cand
        if comm is not None:
            layout = state.builder.layout(cand) if cand.schedule.chunked and cand.virtual_stages > 1 else None
            floor = comm_lower_bound(cand, comm, layout=layout, num_sends=cand.mesh.pp * cand.virtual_stages - 1)
            assert floor <= bound * (1 + 1e-9)
            binding += floor > 0.5 * part.objective
    assert binding > 0
