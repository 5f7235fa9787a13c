"""Pipeline sends as trainers run them (`RuntimeOptions.p2p_scatter_gather`, `p2p_blocking`).

Closed forms of `costmodel.estimate.p2p_time`, and the blocking model checked against an event simulation of
DeepSpeed's own `TrainSchedule` instruction lists (deepspeed/runtime/pipe/schedule.py): every `SendActivation`,
`RecvActivation`, `SendGrad` and `RecvGrad` is a rendezvous of the two neighbours that blocks both until the
transfer is done, executed in order on each stage. The simulator shares no code with the cost model.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel import Cluster, Schedule, Strategy
from costmodel.estimate import p2p_time
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.pipeline import pipeline_step_time
from costmodel.strategy import RuntimeOptions

NBYTES = 64 * 2**20


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster.parse("4x8xa100-80gb")


def _strategy(**runtime: bool) -> Strategy:
    # tp=8 inside a node, pp=4 across the four nodes: every boundary crosses the network.
    return Strategy(dp=1, tp=8, pp=4, microbatch_size=1, num_microbatches=8, runtime=RuntimeOptions(**runtime))


def test_paired_whole_sends_are_one_transfer(cluster) -> None:
    s = _strategy()
    send = collective_time(Collective.SEND_RECV, NBYTES, CommGroup(2, stride=8, start=0), cluster, concurrent=8)
    assert p2p_time(s, 0, NBYTES, cluster) == pytest.approx(send)


def test_scatter_gather_sends_a_tp_slice_and_all_gathers_it(cluster) -> None:
    s = _strategy(p2p_scatter_gather=True)
    send = collective_time(Collective.SEND_RECV, NBYTES / 8, CommGroup(2, stride=8, start=0), cluster, concurrent=8)
    gather = collective_time(Collective.ALL_GATHER, NBYTES, CommGroup(8, stride=1, start=8), cluster)
    assert p2p_time(s, 0, NBYTES, cluster) == pytest.approx(send + gather)
    # Across a network an eighth of the bytes plus an NVLink gather is much less than the whole send.
    assert p2p_time(s, 0, NBYTES, cluster) < 0.5 * p2p_time(_strategy(), 0, NBYTES, cluster)
    # With sequence parallelism the activation is already sharded: nothing to scatter.
    sp = replace(s, sequence_parallel=True)
    assert p2p_time(sp, 0, NBYTES, cluster) == pytest.approx(p2p_time(replace(sp, runtime=RuntimeOptions()), 0,
                                                                      NBYTES, cluster))


def test_blocking_sends_cost_both_ends(cluster) -> None:
    paired = p2p_time(_strategy(), 1, NBYTES, cluster)
    assert p2p_time(_strategy(p2p_blocking=True), 1, NBYTES, cluster) == pytest.approx(2 * paired)


# ---- DeepSpeed's TrainSchedule, simulated ---------------------------------------------------------------------

_PEER = {"SendActivation": (1, "RecvActivation"), "RecvActivation": (-1, "SendActivation"),
         "SendGrad": (-1, "RecvGrad"), "RecvGrad": (1, "SendGrad")}


def _deepspeed_step_time(p: int, m: int, fwd: float, bwd: float, transfer: float) -> float:
    """Makespan of DeepSpeed's TrainSchedule with blocking rendezvous sends of `transfer` seconds."""
    schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    queues = []
    for stage in range(p):
        ops = [type(cmd).__name__ for step in schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=stage)
               .steps() for cmd in step]
        queues.append([op for op in ops if op in _PEER or op in ("ForwardPass", "BackwardPass")])
    at, clock = [0] * p, [0.0] * p
    remaining = sum(len(q) for q in queues)
    while remaining:
        moved = False
        for s in range(p):
            while at[s] < len(queues[s]):
                op = queues[s][at[s]]
                if op in ("ForwardPass", "BackwardPass"):
                    clock[s] += fwd if op == "ForwardPass" else bwd
                    at[s], remaining, moved = at[s] + 1, remaining - 1, True
                    continue
                step, wanted = _PEER[op]
                q = s + step
                if at[q] >= len(queues[q]) or queues[q][at[q]] != wanted:
                    break  # the neighbour is not at the matching operation yet
                clock[s] = clock[q] = max(clock[s], clock[q]) + transfer
                at[s], at[q], remaining, moved = at[s] + 1, at[q] + 1, remaining - 2, True
        assert moved, "the simulated schedule deadlocked"
    return max(clock)


@pytest.mark.parametrize(("p", "m", "transfer"), [(8, 32, 0.25), (12, 64, 0.1), (8, 64, 0.5)])
def test_blocking_model_matches_deepspeeds_train_schedule(p: int, m: int, transfer: float) -> None:
    fwd, bwd = 1.0, 3.0  # full recomputation: the backward reruns the forward
    simulated = _deepspeed_step_time(p, m, fwd, bwd, transfer)
    blocking = pipeline_step_time([fwd] * p, [bwd] * p, Schedule.ONE_F_ONE_B, m, p2p_time=2 * transfer)
    paired = pipeline_step_time([fwd] * p, [bwd] * p, Schedule.ONE_F_ONE_B, m, p2p_time=transfer)
    assert blocking == pytest.approx(simulated, rel=0.025)
    assert abs(paired / simulated - 1) > 2 * abs(blocking / simulated - 1)


def test_deepspeed_schedule_without_transfers_is_one_f_one_b() -> None:
    """The lock-step look of the instruction lists costs nothing by itself: with free sends the makespan is
    the 1F1B closed form (m + p - 1)(F + B)."""
    assert _deepspeed_step_time(8, 32, 1.0, 3.0, 0.0) == pytest.approx((32 + 8 - 1) * 4.0)
