"""DualPipe's paired all-to-all overlap (`RuntimeOptions.ep_overlap`, `costmodel.pipeline`): the F&B pairs of
torch's DualPipeV schedule counted from torch's own action lists, the hidden seconds in closed form, and the
option's validity, plan JSON and refusals."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

import ir
from costmodel.pipeline import ChunkWork, dualpipev_pairs, paired_overlap, pipeline_times, steady_pairs
from costmodel.strategy import RuntimeOptions, Schedule, Strategy
from models.registry import build_model
from planner.api import estimate, plan
from planner.errors import UserError
from planner.runtime.parallelize import runtime_unsupported
from planner.search.space import SearchSpace


def _dualpipev(pp: int, m: int):
    """torch's ScheduleDualPipeV over stand-in stages: it computes every rank's action list when built."""
    from unittest import mock

    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining.stage import PipelineStage

    stand_in = mock.create_autospec(PipelineStage, instance=True)
    stand_in.group_rank, stand_in.group_size, stand_in.submod, stand_in.num_stages = 0, pp, None, 2 * pp
    return ts.ScheduleDualPipeV([stand_in] * 2, m)


def _torch_pairs(pp: int, m: int) -> list[Counter]:
    """Per rank, (forward stage, backward stage) of every OVERLAP_F_B action torch's ScheduleDualPipeV emits."""
    from torch.distributed.pipelining import schedules as ts

    built = _dualpipev(pp, m)
    out = []
    for rank in range(pp):
        pairs = Counter()
        for action in built.pipeline_order[rank]:
            if action is not None and action.computation_type == ts._ComputationType.OVERLAP_F_B:
                f, b = action.sub_actions
                pairs[(f.stage_index, b.stage_index)] += 1
        out.append(pairs)
    return out


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 11), (8, 20)])
def test_pair_counts_are_torchs(pp, m):
    for rank, pairs in enumerate(_torch_pairs(pp, m)):
        first, second = rank, 2 * pp - 1 - rank
        assert (pairs[(first, second)], pairs[(second, first)]) == dualpipev_pairs(pp, m, rank)
        assert set(pairs) <= {(first, second), (second, first)}


def test_hidden_seconds_and_step_time_in_closed_form():
    pp, m = 4, 12
    f, b, a = 1.0, 2.0, 0.4  # per chunk: forward / backward compute, all-to-all per pass (inside f and b)
    chunks = [ChunkWork(f, b, a, a)] * (2 * pp)
    hidden = paired_overlap(chunks, pp, m)
    # Each pair hides both passes' all-to-alls (each shorter than the other pass's compute).
    assert hidden == pytest.approx([(sum(dualpipev_pairs(pp, m, r))) * 2 * a for r in range(pp)])
    # An all-to-all longer than the other pass's compute shows the rest: min(A_F, C_B) + min(A_B, C_F).
    long = paired_overlap([ChunkWork(f, b, 1.5, 1.5)] * (2 * pp), pp, m)
    assert long[0] == pytest.approx(sum(dualpipev_pairs(pp, m, 0)) * (1.5 + 1.0))
    fwd, bwd = [f + a] * (2 * pp), [b + a] * (2 * pp)
    plain = pipeline_times(fwd, bwd, Schedule.DUALPIPEV, m, 2)
    paired = pipeline_times(fwd, bwd, Schedule.DUALPIPEV, m, 2, rank_hidden=hidden)
    # Equal stages: rank 0, with the fewest pairs, stays the bottleneck; its steady state shrinks by H_0.
    assert paired.total_s == pytest.approx(plain.total_s - hidden[0])
    assert paired.bottleneck_rank == 0 and paired.hidden_s == pytest.approx(hidden[0])
    assert paired.bubble_s == pytest.approx(plain.bubble_s)
    with pytest.raises(ValueError, match="rank_hidden is the paired overlap of 1f1b, dualpipev, interleaved"):
        pipeline_times(fwd[:pp], bwd[:pp], Schedule.GPIPE, m, 1, rank_hidden=hidden)


def _interleaved(pp: int, v: int, m: int):
    """torch's ScheduleInterleaved1F1B over stand-in stages (rank 0's v chunks): every rank's action list."""
    from unittest import mock

    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining.stage import PipelineStage

    stages = []
    for chunk in range(v):
        stand_in = mock.create_autospec(PipelineStage, instance=True)
        stand_in.group_rank, stand_in.group_size, stand_in.submod = 0, pp, None
        stand_in.num_stages, stand_in.stage_index = pp * v, chunk * pp
        stages.append(stand_in)
    return ts.ScheduleInterleaved1F1B(stages, m)


@pytest.mark.parametrize(("pp", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 3, 12), (8, 4, 16), (2, 2, 6)])
def test_interleaved_steady_pairs_are_torchs(pp, v, m):
    """A forward followed by a backward in torch's interleaved 1F1B action list is one steady-state step."""
    from torch.distributed.pipelining import schedules as ts

    built = _interleaved(pp, v, m)
    for rank in range(pp):
        kinds = [a.computation_type for a in built.pipeline_order[rank] if a is not None]
        pairs = sum(1 for x, y in itertools.pairwise(kinds)
                    if x is ts._ComputationType.FORWARD and y is ts._ComputationType.FULL_BACKWARD)
        assert pairs == steady_pairs(Schedule.INTERLEAVED, pp, m, v, rank)
    # 1F1B (Megatron-Core's forward_backward_pipelining_without_interleaving): p - r - 1 warm-up forwards
    assert [steady_pairs(Schedule.ONE_F_ONE_B, 4, 8, 1, r) for r in range(4)] == [5, 6, 7, 8]


def test_interleaved_pairs_hide_in_closed_form():
    pp, v, m = 4, 2, 8
    f, b, a = 1.0, 2.0, 0.4
    chunks = [ChunkWork(f, b, a, a)] * (pp * v)
    hidden = paired_overlap(chunks, pp, m, Schedule.INTERLEAVED, v)
    assert hidden == pytest.approx([steady_pairs(Schedule.INTERLEAVED, pp, m, v, r) * 2 * a for r in range(pp)])
    fwd, bwd = [f + a] * (pp * v), [b + a] * (pp * v)
    plain = pipeline_times(fwd, bwd, Schedule.INTERLEAVED, m, v)
    paired = pipeline_times(fwd, bwd, Schedule.INTERLEAVED, m, v, rank_hidden=hidden)
    # Equal chunks: rank 0 has the fewest steady steps and stays the bottleneck; the fill and drain stay.
    assert paired.total_s == pytest.approx(plain.total_s - hidden[0])
    assert paired.bottleneck_rank == 0 and paired.bubble_s == pytest.approx(plain.bubble_s)
    with pytest.raises(ValueError, match="gpipe schedule runs no forward and backward passes as pairs"):
        paired_overlap(chunks, pp, m, Schedule.GPIPE, v)


def _simulated_step(pp: int, m: int, f: float, i: float, w: float, hidden: float) -> float:
    """Event simulation of torch's DualPipeV action lists with equal chunks (F, I, W seconds; a whole backward
    I + W): every rank runs its actions in order, each once its rank is free and its inputs are there; an
    OVERLAP_F_B pair waits for both chunks' inputs and takes F + B - `hidden`."""
    from torch.distributed.pipelining import schedules as ts

    kind = ts._ComputationType
    orders = [[a for a in rank if a is not None] for rank in _dualpipev(pp, m).pipeline_order.values()]
    seconds = {kind.FORWARD: f, kind.BACKWARD_INPUT: i, kind.BACKWARD_WEIGHT: w, kind.FULL_BACKWARD: i + w}

    def needs(a) -> list[tuple[str, int, int]]:
        s, j = a.stage_index, a.microbatch_index
        if a.computation_type == kind.FORWARD:
            return [("F", s - 1, j)] if s > 0 else []
        if a.computation_type == kind.BACKWARD_WEIGHT:
            return [("G", s, j)]
        return [("F", s, j)] + ([("G", s + 1, j)] if s < 2 * pp - 1 else [])

    def makes(a) -> list[tuple[str, int, int]]:
        if a.computation_type == kind.BACKWARD_WEIGHT:
            return []
        return [("F" if a.computation_type == kind.FORWARD else "G", a.stage_index, a.microbatch_index)]

    done: dict[tuple[str, int, int], float] = {}
    free, pos, moved = [0.0] * pp, [0] * pp, True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                subs = order[pos[r]].sub_actions or (order[pos[r]],)
                inputs = [d for a in subs for d in needs(a)]
                if any(d not in done for d in inputs):
                    break
                end = max([free[r]] + [done[d] for d in inputs]) + sum(seconds[a.computation_type] for a in subs)
                end -= hidden if len(subs) == 2 else 0.0
                done.update({k: end for a in subs for k in makes(a)})
                free[r], pos[r], moved = end, pos[r] + 1, True
    assert pos == [len(o) for o in orders], "the simulated schedule deadlocked"
    return max(free)


@pytest.mark.parametrize(("pp", "m"), [(4, 12), (8, 32)])
@pytest.mark.parametrize(("i", "w", "a2a"), [(1.2, 0.8, 0.3), (1.2, 0.8, 0.6), (1.5, 1.0, 0.4), (2.0, 1.0, 0.5)])
def test_the_closed_form_is_at_most_five_percent_above_a_simulation(pp, m, i, w, a2a):
    f = 1.0
    chunks = [ChunkWork(f - a2a, i + w - a2a, a2a, a2a)] * (2 * pp)
    hidden = paired_overlap(chunks, pp, m)
    pair = min(a2a, i + w - a2a) + min(a2a, f - a2a)
    assert hidden[0] == pytest.approx(sum(dualpipev_pairs(pp, m, 0)) * pair)
    formula = pipeline_times([f] * 2 * pp, [i + w] * 2 * pp, Schedule.DUALPIPEV, m, 2, stage_wgrad=[w] * 2 * pp,
                             rank_hidden=hidden).total_s
    simulated = _simulated_step(pp, m, f, i, w, pair)
    assert simulated <= formula <= 1.05 * simulated


def test_a_moe_plan_under_dualpipev_hides_its_all_to_alls():
    built = build_model("moe", ("layers=4", "hidden=256", "ffn_hidden=512", "heads=4", "kv_heads=4", "vocab=1024",
                                "experts=4", "top_k=2"), seq=256)
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="moe"))
    base = Strategy(dp=4, pp=2, ep=4, microbatch_size=1, num_microbatches=4, schedule=Schedule.DUALPIPEV,
                    virtual_stages=2)
    paired = Strategy.from_dict({**base.to_dict(), "runtime": {"ep_overlap": True}})
    plain_est, paired_est = (estimate(chain, "2x4xh100", s, global_batch=16) for s in (base, paired))
    saved = plain_est.step_time_s - paired_est.step_time_s
    assert saved > 0 and not paired_est.problems
    # What the pairs hide leaves the communication term, and nothing else moves.
    assert plain_est.breakdown.tp_comm_s - paired_est.breakdown.tp_comm_s == pytest.approx(saved)
    assert paired_est.breakdown.compute_s == pytest.approx(plain_est.breakdown.compute_s)
    # Megatron-Core's 1F1B pairs its steady state too; GPipe runs every pass alone.
    one_f_one_b = [Strategy.from_dict({**s.to_dict(), "schedule": "1f1b", "virtual_stages": 1})
                   for s in (base, paired)]
    plain_1f1b, paired_1f1b = (estimate(chain, "2x4xh100", s, global_batch=16) for s in one_f_one_b)
    assert paired_1f1b.step_time_s < plain_1f1b.step_time_s and not paired_1f1b.problems
    gpipe = Strategy.from_dict({**paired.to_dict(), "schedule": "gpipe", "virtual_stages": 1})
    problems = estimate(chain, "2x4xh100", gpipe, global_batch=16).problems
    assert any("ep_overlap overlaps the all-to-alls of paired forward and backward passes" in p for p in problems)


def test_the_option_is_written_only_when_set_and_refused_by_the_search_and_this_runtime():
    paired = Strategy(dp=4, pp=2, ep=4, num_microbatches=4, schedule=Schedule.DUALPIPEV, virtual_stages=2,
                      runtime=RuntimeOptions(ep_overlap=True))
    assert paired.to_dict()["runtime"]["ep_overlap"] is True
    assert "ep_overlap" not in Strategy().to_dict()["runtime"]
    assert "ep_overlap" in runtime_unsupported(paired)
    with pytest.raises(UserError, match="ep_overlap .* is priced for a given strategy only"):
        plan(ir.build_layer_chain(ir.trace(*_tiny())), None, "1x8xh100", global_batch=8,
             space=SearchSpace.from_fixes(["ep_overlap=true"]))


def _tiny():
    built = build_model("moe", ("layers=1", "hidden=64", "ffn_hidden=128", "heads=2", "kv_heads=2", "vocab=128",
                                "experts=4", "top_k=2"), seq=16)
    return built.module, built.example_inputs
