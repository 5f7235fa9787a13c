"""Pipeline-parallel schedules: bubble fractions, in-flight micro-batches, and the pipeline's step time.

Notation: p pipeline ranks, m micro-batches, v virtual stages (model chunks) per rank; `stage_fwd[j]`,
`stage_bwd[j]` are the forward/backward seconds of one micro-batch on virtual stage j (pipeline order, length
p*v; virtual stage j runs on rank j % p as chunk j // p, as in Megatron-LM's interleaved schedule).

Bubble fractions (Narayanan et al., SC'21, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Sec. 2.2): GPipe and 1F1B idle (p-1)/m of the busy time; interleaved 1F1B (p-1)/(v*m).

Step time with stages of unequal cost. Let D_r = sum over the chunks j of rank r of (f_j + b_j), S = sum_j (f_j + b_j):

    1F1B, interleaved:  T = m * max_r D_r + (S - max_r D_r) / v
    GPipe:              T = [m * max_r F_r + (sum_j f_j - max_r F_r)] + [m * max_r B_r + (sum_j b_j - max_r B_r)]

For v = 1 the first is the classic T = sum_i (f_i + b_i) + (m - 1) * max_i (f_i + b_i): the first micro-batch
fills the pipeline through every stage and the last drains it, and in steady state the slowest stage sets the pace
(one forward and one backward per micro-batch). With v > 1 the slowest rank is still busy m * D_max, while the fill
and drain pass through the other ranks' chunks, each a 1/v slice, so only 1/v of their work is exposed -- for equal
stages this gives (m*v + p - 1) * (f+b)/v, i.e. the (p-1)/(v*m) bubble. GPipe runs all forwards, then (after a
flush) all backwards, each phase a fill-steady-drain of its own. All three reduce to (m + p - 1)(f + b) for
equal stages and v = 1. Checked against an event-driven simulation of the three schedules (tests/test_pipeline.py):
exact for equal stages and for GPipe; for 1F1B with stage costs differing up to 4x the formula is an upper bound,
at most ~17% above the simulated makespan (the slow stage's fill overlaps better than the sum assumes); the
interleaved analogue is within about +-20% there. Real stages are nearly equal, where all three are exact.

Pipeline send/recv: `p2p_time[j]` is the seconds to send one micro-batch's boundary activation from virtual stage
j to j+1 (and its gradient back). Megatron-LM's p2p is blocking, so stage j+1's forward waits for it and stage j's
backward waits for the returning gradient: f_{j+1} += p2p_time[j], b_j += p2p_time[j]. The p2p share of the step
is T(with) - T(without).

In-flight micro-batches (activations held at the peak, which is the end of the warm-up phase):
GPipe holds all m; 1F1B rank r holds min(p - r, m) (Narayanan et al. 2021, Sec. 2.2.1); interleaved rank r runs
w = 2(p - r - 1) + (v - 1)p warm-up forwards plus one (Megatron-LM schedules.py), the k-th on chunk (k // p) % v,
capped at m*v. For rank 0 that is v*p + p - 1 chunk-micro-batches = (1 + (p-1)/(p*v)) times the 1F1B amount
(Korthikanti et al. 2022, Sec. 4.2.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.strategy import Schedule


def _check(schedule: Schedule, pp: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    schedule = Schedule(schedule)
    if pp < 1 or num_microbatches < 1 or virtual_stages < 1:
        raise ValueError(f"pp, num_microbatches and virtual_stages must be >= 1, got {pp}, {num_microbatches}, "
                         f"{virtual_stages}")
    if virtual_stages > 1 and schedule is not Schedule.INTERLEAVED:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule 'interleaved', got {schedule.value!r}")
    return schedule


def bubble_fraction(schedule: Schedule, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time / busy time of equal stages: (p-1)/m, or (p-1)/(v*m) for interleaved."""
    schedule = _check(schedule, pp, num_microbatches, virtual_stages)
    if schedule is Schedule.INTERLEAVED:
        return (pp - 1) / (virtual_stages * num_microbatches)
    return (pp - 1) / num_microbatches


def in_flight_per_chunk(schedule: Schedule, pp: int, rank: int, num_microbatches: int,
                        virtual_stages: int = 1) -> tuple[int, ...]:
    """Micro-batches whose activations rank `rank` holds at its peak, per model chunk (length v)."""
    schedule = _check(schedule, pp, num_microbatches, virtual_stages)
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} is outside the pipeline 0..{pp - 1}")
    m, v = num_microbatches, virtual_stages
    if schedule is Schedule.GPIPE:
        return (m,)
    if schedule is Schedule.ONE_F_ONE_B:
        return (min(pp - rank, m),)
    units = min(2 * (pp - rank - 1) + (v - 1) * pp + 1, m * v)
    counts = [0] * v
    for k in range(units):
        counts[(k // pp) % v] += 1
    return tuple(counts)


def in_flight_microbatches(schedule: Schedule, pp: int, rank: int, num_microbatches: int,
                           virtual_stages: int = 1) -> int:
    """The most micro-batches in flight on any one chunk of `rank` (GPipe: m; 1F1B: min(p - rank, m))."""
    return max(in_flight_per_chunk(schedule, pp, rank, num_microbatches, virtual_stages))


def _p2p_list(p2p_time: float | Sequence[float], n: int) -> list[float]:
    if isinstance(p2p_time, int | float):
        return [float(p2p_time)] * max(n - 1, 0)
    out = [float(x) for x in p2p_time]
    if len(out) != max(n - 1, 0):
        raise ValueError(f"p2p_time needs one value per stage boundary ({n - 1}), got {len(out)}")
    return out


def _with_p2p(stage_fwd: Sequence[float], stage_bwd: Sequence[float], p2p: Sequence[float]
              ) -> tuple[list[float], list[float]]:
    f, b = list(stage_fwd), list(stage_bwd)
    for j, c in enumerate(p2p):
        f[j + 1] += c
        b[j] += c
    return f, b


def _steady_formula(f: Sequence[float], b: Sequence[float], schedule: Schedule, m: int, pp: int, v: int) -> float:
    if schedule is Schedule.GPIPE:
        fr = [sum(f[r::pp]) for r in range(pp)]
        br = [sum(b[r::pp]) for r in range(pp)]
        return (m * max(fr) + sum(f) - max(fr)) + (m * max(br) + sum(b) - max(br))
    d = [sum(f[r::pp]) + sum(b[r::pp]) for r in range(pp)]
    return m * max(d) + (sum(f) + sum(b) - max(d)) / v


@dataclass(frozen=True, slots=True)
class PipelineTime:
    """The pipeline part of a step, split as the critical path sees it (terms add up to `total_s`)."""

    total_s: float
    busy_s: float
    """m * (forward + backward) of one micro-batch on the busiest rank."""
    bubble_s: float
    p2p_s: float
    bottleneck_rank: int


def pipeline_times(stage_fwd: Sequence[float], stage_bwd: Sequence[float], schedule: Schedule,
                   num_microbatches: int, virtual_stages: int = 1,
                   p2p_time: float | Sequence[float] = 0.0) -> PipelineTime:
    """Step time of the pipeline and its busy / bubble / p2p split (formulas in the module docstring)."""
    n = len(stage_fwd)
    if n == 0 or len(stage_bwd) != n:
        raise ValueError(f"need equally many forward and backward stage times, got {n} and {len(stage_bwd)}")
    if n % virtual_stages:
        raise ValueError(f"{n} stages is not a multiple of virtual_stages={virtual_stages}")
    pp = n // virtual_stages
    schedule = _check(schedule, pp, num_microbatches, virtual_stages)
    m, v = num_microbatches, virtual_stages
    p2p = _p2p_list(p2p_time, n)
    plain = _steady_formula(stage_fwd, stage_bwd, schedule, m, pp, v)
    f, b = _with_p2p(stage_fwd, stage_bwd, p2p)
    total = _steady_formula(f, b, schedule, m, pp, v)
    d = [sum(stage_fwd[r::pp]) + sum(stage_bwd[r::pp]) for r in range(pp)]
    rank = max(range(pp), key=lambda r: (d[r], -r))
    busy = m * d[rank]
    return PipelineTime(total_s=total, busy_s=busy, bubble_s=plain - busy, p2p_s=total - plain,
                        bottleneck_rank=rank)


def pipeline_step_time(stage_fwd: Sequence[float], stage_bwd: Sequence[float], schedule: Schedule,
                       num_microbatches: int, virtual_stages: int = 1,
                       p2p_time: float | Sequence[float] = 0.0) -> float:
    """Seconds from the first forward to the last backward of a step (see module docstring)."""
    return pipeline_times(stage_fwd, stage_bwd, schedule, num_microbatches, virtual_stages, p2p_time).total_s


def drain_slack(stage_bwd: Sequence[float], pp: int, p2p_time: float | Sequence[float] = 0.0) -> tuple[float, ...]:
    """Per rank: seconds between its last backward and the end of the pipeline (the drain through lower ranks).

    The last micro-batch's gradient still flows through ranks r-1 .. 0 (their first-chunk backwards and the p2p
    between them) after rank r finishes; gradient reduction on rank r can hide in that time.
    """
    p2p = _p2p_list(p2p_time, len(stage_bwd))
    slack = [0.0] * pp
    for r in range(1, pp):
        slack[r] = slack[r - 1] + stage_bwd[r - 1] + p2p[r - 1]
    return tuple(slack)
