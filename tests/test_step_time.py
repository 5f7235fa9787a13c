"""Step-time closed forms: bucketed overlap (against a direct simulation), optimizer time, ZeRO communication
patterns, and the breakdown adding up to the pipeline step."""

from __future__ import annotations

import random

import pytest
from costmodel_graphs import A100

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.layer_cost import LayerCost
from costmodel.memory import PricedSegment
from costmodel.pipeline import pipeline_step_time
from costmodel.step_time import (
    ADAM_BYTES_PER_PARAM,
    RankTail,
    StageTime,
    data_parallel_comm,
    optimizer_step_time,
    overlapped_exposed,
    stage_time,
    step_breakdown,
)
from costmodel.strategy import Recompute


def simulate_buckets(comm: float, window: float, n: int) -> float:
    """Bucket i is ready at (i+1) W/n; buckets are sent one after another; exposed = end of last send - W."""
    end = 0.0
    for i in range(n):
        end = max(end, (i + 1) * window / n) + comm / n
    return end - window


def test_overlap_closed_form_matches_simulation():
    rng = random.Random(3)
    for _ in range(200):
        c, w, n = rng.uniform(0, 5), rng.uniform(0, 5), rng.randint(1, 40)
        assert overlapped_exposed(c, w, n) == pytest.approx(simulate_buckets(c, w, n))
    assert overlapped_exposed(0.0, 1.0, 4) == 0.0
    # Fully hidden except the last bucket; fully exposed with no window.
    assert overlapped_exposed(1.0, 10.0, 4) == pytest.approx(0.25)
    assert overlapped_exposed(1.0, 0.0, 4) == pytest.approx(1.0)


def test_optimizer_step_is_memory_bound_over_local_state():
    n = 2_000_000_000
    t = optimizer_step_time(n, A100)
    assert t == pytest.approx(n * ADAM_BYTES_PER_PARAM / (A100.memory_bandwidth * A100.memory_efficiency))
    assert optimizer_step_time(n, A100, speed=0.5) == pytest.approx(2 * t)
    assert optimizer_step_time(0, A100) == 0.0


def _cost(**kw) -> LayerCost:
    base = dict(fwd_compute_s=1.0, bwd_compute_s=2.0, fwd_comm_s=0.1, bwd_comm_s=0.2, param_count=10,
                param_bytes=20, saved_bytes_none=100, saved_bytes_selective=50, saved_bytes_full=10,
                recompute_selective_s=0.05, recompute_full_s=1.1, boundary_bytes=5)
    base.update(kw)
    return LayerCost(**base)


def test_stage_time_sums_and_recompute_and_speed():
    segs = [PricedSegment(_cost()), PricedSegment(_cost(), Recompute.SELECTIVE), PricedSegment(_cost(),
                                                                                              Recompute.FULL)]
    t = stage_time(segs, speed=0.5)
    assert t.compute_fwd_s == pytest.approx(6.0) and t.compute_bwd_s == pytest.approx(12.0)
    assert t.recompute_s == pytest.approx((0.05 + 1.1) / 0.5)
    assert t.tp_fwd_s == pytest.approx(0.3) and t.tp_bwd_s == pytest.approx(0.6)
    assert t.fwd_s == pytest.approx(6.3) and t.bwd_s == pytest.approx(12.0 + 2.3 + 0.6)
    with pytest.raises(ValueError, match="speed"):
        stage_time(segs, speed=0)


def test_breakdown_adds_up_and_splits_the_critical_path():
    stages = [StageTime(1.0, 2.0, 0.5, 0.1, 0.2), StageTime(1.5, 3.0, 0.0, 0.1, 0.2)]
    tails = [RankTail(end_reduce_s=4.0, end_reduce_chunks=4, last_bwd_window_s=2.0, optimizer_s=0.3),
             RankTail(end_reduce_s=1.0, end_reduce_chunks=1, last_bwd_window_s=3.0, optimizer_s=0.2,
                      post_step_s=0.4)]
    b = step_breakdown(stages, tails, schedule="1f1b", num_microbatches=4, p2p_time=0.05)
    pipe = pipeline_step_time([s.fwd_s for s in stages], [s.bwd_s for s in stages], "1f1b", 4, 1, 0.05)
    # Rank 0's reduction: exposed(4, 2, 4) = 2.5, no drain slack; rank 1's: 1.0 minus slack b_0 + p2p.
    assert b.dp_comm_s == pytest.approx(2.5 + 0.4)
    assert b.optimizer_s == pytest.approx(0.3)
    assert b.total_s == pytest.approx(pipe + 2.5 + 0.3 + 0.4)
    # The bottleneck (rank 1) is busy 4 * (1.5 + 3.0 + 0.3): compute 18, tp 1.2, no recompute.
    assert b.compute_s == pytest.approx(18.0) and b.tp_comm_s == pytest.approx(1.2) and b.recompute_s == 0.0


def test_zero_stages_communication_patterns():
    cluster = Cluster.parse("2x8xa100-80gb")
    g = CommGroup(16, stride=1)
    gb = 4e9

    def comm(z):
        return data_parallel_comm(zero_stage=z, grad_bytes=gb, param_bytes=gb, num_segments=10, fwd_window_s=1.0,
                                  bwd_window_s=2.0, group=g, cluster=cluster)

    ar = collective_time(Collective.ALL_REDUCE, gb, g, cluster)
    # ZeRO-1..3: one collective per FSDP unit (10 segments), each paying the latency.
    rs = 10 * collective_time(Collective.REDUCE_SCATTER, gb / 10, g, cluster)
    ag = 10 * collective_time(Collective.ALL_GATHER, gb / 10, g, cluster)
    assert rs > collective_time(Collective.REDUCE_SCATTER, gb, g, cluster)
    z0, z1, z2, z3 = (comm(z) for z in range(4))
    assert z0.end_reduce_s == pytest.approx(ar) and z0.post_step_s == 0 and z0.per_microbatch_bwd_s == 0
    assert z0.end_reduce_chunks == 153  # ceil(4e9 / 25 MiB)
    # ZeRO-1/2's weight gather is prefetched ahead of the next step's first forward.
    assert z1.end_reduce_s == pytest.approx(rs) and z1.post_step_s == pytest.approx(overlapped_exposed(ag, 1.0, 10))
    assert z2.end_reduce_s == 0 and z2.per_microbatch_bwd_s == pytest.approx(overlapped_exposed(rs, 2.0, 10))
    assert z3.per_microbatch_fwd_s == pytest.approx(overlapped_exposed(ag, 1.0, 10))
    assert z3.per_microbatch_bwd_s == pytest.approx(overlapped_exposed(ag + rs, 2.0, 10))
    assert z3.post_step_s == 0
    # Without overlap every collective is exposed; without resharding ZeRO-3 gathers once per micro-batch.
    off = [data_parallel_comm(zero_stage=z, grad_bytes=gb, param_bytes=gb, num_segments=10, fwd_window_s=1.0,
                              bwd_window_s=2.0, group=g, cluster=cluster, overlap=False) for z in (1, 2, 3)]
    assert off[0].post_step_s == pytest.approx(ag) and off[1].per_microbatch_bwd_s == pytest.approx(rs)
    assert off[2].per_microbatch_fwd_s == pytest.approx(ag) and off[2].per_microbatch_bwd_s == pytest.approx(ag + rs)
    kept = data_parallel_comm(zero_stage=3, grad_bytes=gb, param_bytes=gb, num_segments=10, fwd_window_s=1.0,
                              bwd_window_s=2.0, group=g, cluster=cluster, reshard_after_forward=False)
    assert kept.per_microbatch_bwd_s == pytest.approx(overlapped_exposed(rs, 2.0, 10))
    none = data_parallel_comm(zero_stage=0, grad_bytes=gb, param_bytes=gb, num_segments=1, fwd_window_s=0,
                              bwd_window_s=0, group=CommGroup(1), cluster=cluster)
    assert none.end_reduce_s == 0 and none.post_step_s == 0


def test_zero_under_pipelining_reduces_once_and_keeps_weights_gathered():
    """torch.distributed.pipelining runs every backward but the last without gradient sync and without
    resharding: ZeRO-2/3 reduce-scatter once after the last backward (as ZeRO-1 does), the step's first forward
    gathers the weights, and with resharding after forward each backward gathers them again."""
    cluster, g, gb = Cluster.parse("2x8xa100-80gb"), CommGroup(16, stride=1), 4e9

    def comm(z: int, **kw):
        return data_parallel_comm(zero_stage=z, grad_bytes=gb, param_bytes=gb, num_segments=10, fwd_window_s=1.0,
                                  bwd_window_s=2.0, group=g, cluster=cluster, pipelined=True, **kw)

    rs = 10 * collective_time(Collective.REDUCE_SCATTER, gb / 10, g, cluster)
    ag = 10 * collective_time(Collective.ALL_GATHER, gb / 10, g, cluster)
    z1, z2, z3, kept = comm(1), comm(2), comm(3), comm(3, reshard_after_forward=False)
    assert z1 == data_parallel_comm(zero_stage=1, grad_bytes=gb, param_bytes=gb, num_segments=10,
                                    fwd_window_s=1.0, bwd_window_s=2.0, group=g, cluster=cluster)
    for c in (z2, z3, kept):
        assert c.end_reduce_s == pytest.approx(rs) and c.end_reduce_chunks == 153
        assert c.post_step_s == pytest.approx(overlapped_exposed(ag, 1.0, 10)) and c.per_microbatch_fwd_s == 0
    assert z2.per_microbatch_bwd_s == 0 and kept.per_microbatch_bwd_s == 0
    assert z3.per_microbatch_bwd_s == pytest.approx(overlapped_exposed(ag, 2.0, 10))
