"""The event simulation of a pipeline schedule: every rank runs its operations in the schedule's order, each as soon
as its rank is free and its input is there.

Orders (`schedule_order`):

- GPipe (Huang et al. 2019): all forwards, then all backwards.
- 1F1B (Narayanan et al., SC'21, "PipeDream-Flush"): rank d runs min(p - d - 1, m) warm-up forwards, then
  alternates one forward and one backward, then drains the remaining backwards.
- Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM `forward_backward_pipelining_with_interleaving`): each
  rank holds v model chunks, virtual stage s = chunk * p + rank. Forwards run in groups of p micro-batches per
  chunk, the warm-up is (p - d - 1) * 2 + (v - 1) * p operations (all of them when m == p), backwards mirror the
  chunk order. Megatron-LM requires m divisible by p for this schedule, and so does the simulation.
- The zero-bubble schedules (interleaved-zb, zbv, dualpipev): the action lists torch.distributed.pipelining
  itself computes for `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble` and `ScheduleDualPipeV`
  (`torch_actions`), with their backward split into I (input gradient) and W (weight gradient) operations, or a
  whole backward B where torch runs one (DualPipeV's overlapped "F&B" pairs run one after the other).

Dependencies: F(s, j) needs F(s - 1, j); the input gradient of (s, j) -- a whole B or an I -- needs F(s, j) and
the input gradient of (s + 1, j); W(s, j) needs I(s, j). Durations: a rank's forward / backward seconds split
evenly over its v chunks, a backward's W part its weight-gradient seconds. Point-to-point transfers are blocking
as in the cost model (costmodel/pipeline.py): an operation whose input comes from another rank first waits one
send/recv of `p2p_s` (two stages on one rank -- the tip of the V -- send nothing). Start times follow from one
pass over the operations in topological order (Kahn), so the result is exact for this model.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from costmodel.pipeline import pipeline_times, schedule_problem, stage_rank
from costmodel.strategy import Schedule

_BISECTION_STEPS = 200
"""Halvings when solving for the per-boundary send/recv time (far past float resolution)."""


class BackwardPart(enum.StrEnum):
    """Which part of a backward an operation runs: all of it, or the zero-bubble split."""

    WHOLE = "B"
    INPUT = "I"
    WEIGHT = "W"


class PipelineOp(NamedTuple):
    """One pipeline operation; prints as torch.distributed.pipelining does ("F3", "B0", "I2", "W2"), plus "@s" for
    chunks."""

    forward: bool
    virtual_stage: int
    microbatch: int
    part: BackwardPart = BackwardPart.WHOLE
    """For a backward: the whole of it, or its input- or weight-gradient part (zero-bubble schedules)."""

    def __str__(self) -> str:
        return f"{'F' if self.forward else self.part.value}{self.microbatch}@{self.virtual_stage}"

    @property
    def sends_gradient(self) -> bool:
        """Whether this operation produces the input gradient the previous stage waits for."""
        return not self.forward and self.part is not BackwardPart.WEIGHT


def receives(op: PipelineOp, schedule: Schedule, num_stages: int, virtual_stages: int) -> bool:
    """Whether `op` first waits for a send from another rank: a forward's activations from the previous virtual
    stage, an input gradient's from the next; not on the tip of a V (both stages on one rank) nor for W."""
    s, last = op.virtual_stage, num_stages * virtual_stages - 1
    if op.forward:
        neighbour = s - 1
        if s == 0:
            return False
    elif s == last or not op.sends_gradient:
        return False
    else:
        neighbour = s + 1
    return stage_rank(schedule, num_stages, neighbour) != stage_rank(schedule, num_stages, s)


def schedule_order(schedule: Schedule, num_stages: int, num_microbatches: int, virtual_stages: int,
                   stage: int) -> tuple[PipelineOp, ...]:
    """The operations device `stage` runs, in order (see the module docstring for each schedule)."""
    p, m, v = num_stages, num_microbatches, virtual_stages
    schedule = Schedule(schedule)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} is not in [0, {p})")
    if not schedule.chunked and v != 1:
        raise ValueError(f"virtual_stages={v} needs a schedule with model chunks, not {schedule.value}")
    if schedule.zero_bubble:
        return torch_actions(schedule, p, m, v)[stage]
    if schedule is Schedule.GPIPE:
        return (tuple(PipelineOp(True, stage, j) for j in range(m))
                + tuple(PipelineOp(False, stage, j) for j in range(m)))
    if schedule is Schedule.ONE_F_ONE_B:
        fwd = [PipelineOp(True, stage, j) for j in range(m)]
        bwd = [PipelineOp(False, stage, j) for j in range(m)]
        warmup = min(p - stage - 1, m)
    else:
        if m % p:
            raise ValueError(f"the interleaved schedule needs num_microbatches ({m}) divisible by pp ({p}), "
                             "as Megatron-LM requires")
        total = m * v
        fwd = [_interleaved_op(k, p, v, stage, forward=True) for k in range(total)]
        bwd = [_interleaved_op(k, p, v, stage, forward=False) for k in range(total)]
        # Megatron-LM runs every forward first when m == p ("all warm-up"), else the 1F1B-style warm-up.
        warmup = total if m == p else min((p - stage - 1) * 2 + (v - 1) * p, total)
    ops = fwd[:warmup]
    for k in range(len(fwd) - warmup):
        ops += [fwd[warmup + k], bwd[k]]
    ops += bwd[len(bwd) - warmup:] if warmup else []
    return tuple(ops)


def _interleaved_op(k: int, p: int, v: int, stage: int, *, forward: bool) -> PipelineOp:
    group, r = divmod(k, p * v)
    chunk = r // p if forward else v - 1 - r // p
    return PipelineOp(forward, chunk * p + stage, group * p + r % p)


def torch_actions(schedule: Schedule, pp: int, num_microbatches: int,
                  virtual_stages: int) -> tuple[tuple[PipelineOp, ...], ...]:
    """Every rank's operations as torch.distributed.pipelining orders them for a zero-bubble schedule.

    torch computes all ranks' action lists when a schedule is built; stand-in stages (what torch's own
    `_schedule_visualizer.get_schedule_ops` uses) get them without a process group."""
    from unittest import mock

    from torch.distributed.pipelining import schedules as ts
    from torch.distributed.pipelining.stage import PipelineStage

    why = schedule_problem(schedule, pp, num_microbatches)
    if why:
        raise ValueError(why)
    cls = {Schedule.INTERLEAVED_ZB: ts.ScheduleInterleavedZeroBubble, Schedule.ZBV: ts.ScheduleZBVZeroBubble,
           Schedule.DUALPIPEV: ts.ScheduleDualPipeV}[Schedule(schedule)]
    stand_in = mock.create_autospec(PipelineStage, instance=True)
    stand_in.group_rank, stand_in.group_size, stand_in.submod = 0, pp, None
    stand_in.num_stages = pp * virtual_stages
    built = cls([stand_in] * virtual_stages, num_microbatches)
    kinds = {ts._ComputationType.FORWARD: (True, BackwardPart.WHOLE),
             ts._ComputationType.FULL_BACKWARD: (False, BackwardPart.WHOLE),
             ts._ComputationType.BACKWARD_INPUT: (False, BackwardPart.INPUT),
             ts._ComputationType.BACKWARD_WEIGHT: (False, BackwardPart.WEIGHT)}
    out = []
    for rank in range(pp):
        ops = []
        for action in built.pipeline_order[rank]:
            for a in (action.sub_actions or (action,)) if action is not None else ():
                forward, part = kinds[a.computation_type]
                ops.append(PipelineOp(forward, a.stage_index, a.microbatch_index, part))
        out.append(tuple(ops))
    return tuple(out)


class _PipelineDag:
    """The operations of all ranks in one topological order with their predecessors and durations."""

    def __init__(self, stage_fwd_s: Sequence[float], stage_bwd_s: Sequence[float], schedule: Schedule,
                 num_microbatches: int, virtual_stages: int, p2p_s: float,
                 stage_wgrad_s: Sequence[float] | None = None) -> None:
        p, v = len(stage_fwd_s), virtual_stages
        if p == 0 or len(stage_bwd_s) != p:
            raise ValueError(f"need one forward and one backward time per stage, got {len(stage_fwd_s)} and "
                             f"{len(stage_bwd_s)}")
        wgrad = stage_wgrad_s if stage_wgrad_s is not None else [0.0] * p
        orders = [schedule_order(schedule, p, num_microbatches, v, d) for d in range(p)]
        preds = self._dependencies(orders, schedule, p, v)
        topo = _topological(orders, preds)
        if len(topo) != len(preds):  # a cycle: the operation orders contradict the data dependencies
            raise ValueError(f"schedule {Schedule(schedule).value} deadlocks with p={p}, m={num_microbatches}, "
                             f"v={v}")
        index = {op: i for i, op in enumerate(topo)}

        def duration(op: PipelineOp) -> float:
            d = stage_rank(schedule, p, op.virtual_stage)
            if op.forward:
                return stage_fwd_s[d] / v
            share = {BackwardPart.WHOLE: stage_bwd_s[d], BackwardPart.INPUT: stage_bwd_s[d] - wgrad[d],
                     BackwardPart.WEIGHT: wgrad[d]}[op.part]
            return share / v

        self.ops: tuple[PipelineOp, ...] = tuple(topo)
        self.recv = tuple(p2p_s if receives(op, schedule, p, v) else 0.0 for op in topo)
        self.work = tuple(duration(op) for op in topo)
        self.preds = tuple(tuple(index[src] for src in preds[op]) for op in topo)

    @staticmethod
    def _dependencies(orders: Sequence[Sequence[PipelineOp]], schedule: Schedule, p: int,
                      v: int) -> dict[PipelineOp, list[PipelineOp]]:
        """Each operation's predecessors: the one before it on its rank, and its data dependencies."""
        last = p * v - 1
        ops = [op for order in orders for op in order]
        gradient = {(op.virtual_stage, op.microbatch): op for op in ops if op.sends_gradient}
        preds: dict[PipelineOp, list[PipelineOp]] = {op: [] for op in ops}
        for order in orders:
            for a, b in zip(order, order[1:], strict=False):
                preds[b].append(a)
        for op, into in preds.items():
            s, j = op.virtual_stage, op.microbatch
            if op.forward and s > 0:
                into.append(PipelineOp(True, s - 1, j))
            elif op.part is BackwardPart.WEIGHT:
                into.append(gradient[(s, j)])
            elif not op.forward:
                into.append(PipelineOp(True, s, j))
                if s < last:
                    into.append(gradient[(s + 1, j)])
        return preds

    def simulate(self) -> dict[PipelineOp, tuple[float, float]]:
        end = [0.0] * len(self.ops)
        for i, into in enumerate(self.preds):
            end[i] = max((end[k] for k in into), default=0.0) + self.recv[i] + self.work[i]
        return {op: (e - r - w, e) for op, e, r, w in zip(self.ops, end, self.recv, self.work, strict=True)}


def _topological(orders: Sequence[Sequence[PipelineOp]],
                 preds: Mapping[PipelineOp, Sequence[PipelineOp]]) -> list[PipelineOp]:
    """Kahn's algorithm; FIFO over rank order keeps it deterministic (shorter than `preds` on a cycle)."""
    succ: dict[PipelineOp, list[PipelineOp]] = {op: [] for op in preds}
    indegree = {op: len(into) for op, into in preds.items()}
    for op, into in preds.items():
        for src in into:
            succ[src].append(op)
    topo: list[PipelineOp] = []
    queue = deque(op for order in orders for op in order if indegree[op] == 0)
    while queue:
        op = queue.popleft()
        topo.append(op)
        for nxt in succ[op]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                queue.append(nxt)
    return topo


def simulate_pipeline(stage_fwd_s: Sequence[float], stage_bwd_s: Sequence[float], schedule: Schedule,
                      num_microbatches: int, virtual_stages: int = 1, p2p_s: float = 0.0,
                      stage_wgrad_s: Sequence[float] | None = None) -> dict[PipelineOp, tuple[float, float]]:
    """Start and end of every operation, the blocking receive included (module docstring). `stage_fwd_s[d]` is
    one micro-batch's forward on rank d (all its chunks); each of the v chunks takes 1/v of it. `stage_wgrad_s[d]`:
    of `stage_bwd_s[d]`, the weight-gradient part (the W operations of the zero-bubble schedules)."""
    return _PipelineDag(stage_fwd_s, stage_bwd_s, schedule, num_microbatches, virtual_stages, p2p_s,
                        stage_wgrad_s).simulate()


def pipeline_span(times: Mapping[PipelineOp, tuple[float, float]]) -> float:
    return max(end for _, end in times.values())


def per_virtual_stage(per_rank: Sequence[float], schedule: Schedule, virtual_stages: int) -> list[float]:
    """Per virtual stage (pipeline order) its rank's time split evenly over the rank's chunks."""
    p, v = len(per_rank), virtual_stages
    return [per_rank[stage_rank(schedule, p, j)] / v for j in range(p * v)]


def fit_p2p_time(stage_fwd_s: Sequence[float], stage_bwd_s: Sequence[float], schedule: Schedule,
                 num_microbatches: int, virtual_stages: int, pp_comm_s: float,
                 stage_wgrad_s: Sequence[float] | None = None) -> float:
    """The send/recv seconds per virtual-stage boundary for which `costmodel.pipeline.pipeline_times` charges
    `pp_comm_s` of pipeline communication (0 without boundaries or communication). Its p2p share only grows
    with the transfer time, so bisection finds it."""
    v = virtual_stages
    fwd = per_virtual_stage(stage_fwd_s, schedule, v)
    bwd = per_virtual_stage(stage_bwd_s, schedule, v)
    wgrad = per_virtual_stage(stage_wgrad_s, schedule, v) if stage_wgrad_s is not None else None
    if len(fwd) < 2 or pp_comm_s <= 0:
        return 0.0
    p = len(stage_fwd_s)
    local = [stage_rank(schedule, p, j) == stage_rank(schedule, p, j + 1) for j in range(len(fwd) - 1)]

    def charged(c: float) -> float:
        sends = [0.0 if same else c for same in local]
        return pipeline_times(fwd, bwd, schedule, num_microbatches, v, sends, wgrad).p2p_s

    hi = pp_comm_s
    for _ in range(_BISECTION_STEPS):  # charged(c) >= c for c > 0, so this ends at once; kept safe anyway
        if charged(hi) >= pp_comm_s:
            break
        hi *= 2
    lo = 0.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if charged(mid) < pp_comm_s else (lo, mid)
    return hi
