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
is T(with) - T(without). With `p2p_overlap` (Megatron-Core's interleaved schedule, `overlap_p2p_comm`: each
chunk's send and the next chunk's receive are posted without waiting and waited only before the data is used) a
transfer runs while the rank computes another chunk, so the steady state does not wait for it and only the fill
and drain do. The first micro-batch's forward crosses every one of the p v - 1 chunk boundaries in turn, and the
last one's backward crosses them back, so the step is the step without sends plus 2 sum_j p2p_time[j], whatever
m: of the interleaved step S / v + (m - 1/v) max_r D_r the sends leave D_r and count v times in S. An event
simulation of Megatron's interleaved order in which a send delays only the chunk that reads it gives exactly that
for equal stages (tests/test_pipeline.py; at p 4, v 2, m 8 and sends of a tenth of a forward, 1.4 s of sends in
a 58.4 s step where blocking sends cost 3.7 s). That assumes a send no longer than the chunk computed meanwhile
(at one layer of a 340B model per chunk on 8-way tensor parallelism, 0.5 ms against 11 ms).

In-flight micro-batches (activations held at the peak, which is the end of the warm-up phase):
GPipe holds all m; 1F1B rank r holds min(p - r, m) (Narayanan et al. 2021, Sec. 2.2.1); interleaved rank r runs
w = 2(p - r - 1) + (v - 1)p warm-up forwards plus one (Megatron-LM schedules.py), the k-th on chunk (k // p) % v,
capped at m*v. For rank 0 that is v*p + p - 1 chunk-micro-batches = (1 + (p-1)/(p*v)) times the 1F1B amount
(Korthikanti et al. 2022, Sec. 4.2.3).

Zero-bubble schedules
---------------------
The backward of a chunk splits into B (the input gradient, which the previous stage waits for) and W (the weight
gradient, which nothing waits for): b = i + w. torch.distributed.pipelining runs them as `stage_backward_input`
and `stage_backward_weight`; the activations a micro-batch saved stay until its W (the input-gradient pass keeps
the graph for the weight pass). With f_r, i_r, w_r a rank's per-micro-batch sums over its chunks and D_r = f_r +
i_r + w_r, each schedule's fill and drain per rank is E_r, and

    T = max_r (m D_r - E_r / v) + sum_r E_r / v + X / v

    interleaved-zb:  E_r = f_r + max(i_r - w_r, 0)                              X = 0
    zbv:             E_r = max(f_r, i_r, 2 (i_r - w_r))                          X = 0
    dualpipev:       E_r = f_r + max(i_r - w_r, 0)     X = max_r max((p - 1)(i_r - f_r) - f_r, 0)

For equal stages (F, I, W one chunk's times) the bubble is (p - 1)(F + I - W) + X when W <= I: 1F1B's fill and
drain (p - 1)(F + I + W) less two W per rank, because W runs in the bubbles (Qi et al. 2024, ZB-H1; DeepSeek-V3
Table 2 lists (PP - 1)(F + B - 2W) for ZB1P with B = I + W). ZB-V pays more when I outgrows F + W, DualPipeV when
I outgrows F (its F&B pairs wait on the input gradients). These are derived from, and checked against, an event
simulation of torch 2.13's own action lists (`planner.reports.schedule_simulation`, tests/test_zero_bubble.py):
exact for equal stages whenever W <= F <= I (a weight gradient costs about its forward GEMMs, and the input
gradient at least that -- every transformer layer), within 5% of the simulated step elsewhere and within 6% for
stage costs 30% apart. The max over ranks of m D_r - E_r / v (rather than m max D + the others' E) keeps the form
Phi(sum, max) the stage-partition DP needs; for equal stages the two agree. DualPipeV's overlapped "F&B" chunks
run one after the other in torch's default runtime (the overlap needs a custom function), so they are priced as F
then B. Sends are blocking as above, and the gradient goes out after the input-gradient pass: f_{j+1} += p2p[j],
i_j += p2p[j]. W fills the drain too, so no end-of-step reduction hides there (`drain_slack` is 0).

Placement and constraints. None of them recomputes activations, and under ZeRO-3 they keep the gathered weights
from forward to backward (`split_backward_problem`). interleaved-zb (torch's ZB1P, `ScheduleInterleavedZeroBubble`) loops virtual stage j
onto rank j % p as interleaved 1F1B does, v >= 1 chunks, m a multiple of p. zbv and dualpipev are V-shaped: rank r
holds exactly virtual stages r and 2p - 1 - r (so the first and the last stage, the embedding and the loss, are on
rank 0, and stages p - 1 and p meet on rank p - 1 without a send), m >= 2p (DualPipeV refuses fewer; ZB-V pads
to 2p - 1 and idles).

Paired all-to-all overlap (`RuntimeOptions.ep_overlap`). DualPipe runs each F&B pair of chunks
as one overlapped unit: the forward's expert-parallel all-to-alls while the backward computes and the backward's
while the forward computes (DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.1, Figure 4). torch's `ScheduleDualPipeV`
emits rank r's pairs as OVERLAP_F_B actions: in its main step m - 2p + r + 1 pairs of (F of chunk 0, B of chunk
1) -- one fewer on rank p - 1, whose first one is left unpaired -- and as many of (F of chunk 1, B of chunk 0),
plus p - r - 1 more of the latter in its step 5: N01_r = m - 2p + r + 1 - [r = p - 1], N10_r = m - p. A pair of
F on chunk a (compute C_Fa, all-to-all A_Fa per micro-batch) and B on chunk b hides

    h(a, b) = min(A_Fa, C_Bb) + min(A_Bb, C_Fa)       (exposed: max(0, A_Fa - C_Bb) + max(0, A_Bb - C_Fa))

and rank r's steady state shrinks by H_r = N01_r h(0, 1) + N10_r h(1, 0): T = max_r (m D_r - H_r - E_r / v) +
(sum_r E_r + X) / v, the fill and drain (E_r, X) unchanged because their chunks run alone. Checked against an
event simulation of torch's action lists in which a pair starts once both its chunks' inputs are there and takes
F + B - h (tests/test_ep_overlap.py): for equal stages the formula is 0-4% above the simulated step, never below
(rank 0, with the fewest pairs, stands for the critical path). One communication stream carries both passes'
all-to-alls in turn; h fits it: when both are hidden, A_F + A_B <= C_B + C_F. The sends are blocking as above.

Megatron-Core pairs the same way in 1F1B and interleaved 1F1B (`--overlap-moe-expert-parallel-comm`, NeMo's
`moe_a2a_overlap`): every step of the steady state runs the forward of one micro-batch merged with the backward of
another. Rank r's steady state has m v - w_r such steps after its w_r warm-up forwards, w_r = min(m v, (p - r - 1)
2 + (v - 1) p) interleaved (torch's and Megatron-Core's warm-up count) and min(m, p - r - 1) for 1F1B, each
hiding h over the rank's mean chunk (a pair mixes its chunks; the mean of the rank's chunks stands for them, which
can only overstate h -- it is concave), and the steady state shrinks: T = max_r (m D_r - H_r) + (sum F + sum B -
max_r D_r) / v.

In flight (F started, W not finished), from the same simulation: interleaved-zb holds p micro-batches on every
chunk of every rank (min(p, m)); zbv holds 2p - 1 - r on rank r's first chunk and r + 1 on its second (2p per
rank, 1F1B's first-rank peak on every rank); dualpipev 2p - r and r + 1 (2p + 1, DeepSeek-V3's "PP + 1").
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
    if virtual_stages > 1 and not schedule.chunked:
        raise ValueError(f"virtual_stages={virtual_stages} needs a schedule with model chunks (interleaved, "
                         f"interleaved-zb, zbv, dualpipev), got {schedule.value!r}")
    if schedule.v_shape and virtual_stages != 2:
        raise ValueError(f"{schedule.value} runs exactly 2 chunks per rank, got virtual_stages={virtual_stages}")
    return schedule


def schedule_problem(schedule: Schedule, pp: int, num_microbatches: int) -> str:
    """Why the schedule cannot run m micro-batches on p ranks ('' when it can; module docstring)."""
    schedule, m = Schedule(schedule), num_microbatches
    if schedule in (Schedule.INTERLEAVED, Schedule.INTERLEAVED_ZB) and m % pp:
        return f"the {schedule.value} schedule needs the number of micro-batches ({m}) to be a multiple of pp ({pp})"
    if schedule.v_shape and m < 2 * pp:
        return f"the {schedule.value} schedule needs at least 2 * pp = {2 * pp} micro-batches, got {m}"
    return ""


def split_backward_problem(schedule: Schedule, *, recomputed: bool, resharded: bool) -> str:
    """Why a zero-bubble schedule cannot run this way ('' when it can). Its backward differentiates each chunk
    twice, input then weight gradients; torch 2.13's activation checkpointing recomputes a region for one backward
    pass only (the second fails re-entering its context), and FSDP2 resharding after the forward (ZeRO-3's
    default) reduces the weight gradients before the weight pass has made them (measured: wrong gradients)."""
    name = Schedule(schedule).value
    if not Schedule(schedule).zero_bubble:
        return ""
    if recomputed:
        return (f"the {name} schedule runs without activation recomputation (its split backward differentiates "
                "each chunk twice); use recompute none or another schedule")
    if resharded:
        return (f"the {name} schedule needs ZeRO-3 to keep the gathered weights from forward to backward "
                "(reshard_after_forward=false, estimate --keep-gathered); its weight gradients come after the "
                "input-gradient pass")
    return ""


def chunk_stages(schedule: Schedule, pp: int, virtual_stages: int, rank: int) -> tuple[int, ...]:
    """The virtual stages pipeline rank `rank` holds, in its chunk order: r, r + p, ... (looped), or r and
    2p - 1 - r (V-shaped)."""
    if _as_schedule(schedule).v_shape:
        return (rank, 2 * pp - 1 - rank)
    return tuple(range(rank, pp * virtual_stages, pp))


def sends_overlap(schedule: Schedule, p2p_overlap: bool) -> bool:
    """Whether a schedule's pipeline sends wait only in the fill and drain (`RuntimeOptions.p2p_overlap`, module
    docstring): only the interleaved schedule has it; every other schedule's sends block."""
    return p2p_overlap and schedule is Schedule.INTERLEAVED


def stage_rank(schedule: Schedule, pp: int, stage: int) -> int:
    """The pipeline rank that runs virtual stage `stage`."""
    if stage >= pp and _as_schedule(schedule).v_shape:
        return 2 * pp - 1 - stage
    return stage % pp


def _as_schedule(schedule: Schedule | str) -> Schedule:
    """`Schedule(schedule)` without the enum's lookup when it is one already (the search asks hundreds of
    thousands of times)."""
    return schedule if schedule.__class__ is Schedule else Schedule(schedule)


def bubble_fraction(schedule: Schedule, pp: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time / busy time of equal stages: (p-1)/m, or (p-1)/(v*m) for interleaved; the zero-bubble schedules'
    (p-1)(F + I - W) / (v m (F + I + W)) taken at F = I = W: (p-1)/(3 v m)."""
    schedule = _check(schedule, pp, num_microbatches, virtual_stages)
    if schedule.zero_bubble:
        return (pp - 1) / (3 * virtual_stages * num_microbatches)
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
    if schedule is Schedule.INTERLEAVED_ZB:
        return (min(pp, m),) * v
    if schedule is Schedule.ZBV:
        return (min(2 * pp - 1 - rank, m), min(rank + 1, m))
    if schedule is Schedule.DUALPIPEV:
        return (min(2 * pp - rank, m), min(rank + 1, m))
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


def _rank_sums(x: Sequence[float], schedule: Schedule, pp: int, v: int) -> list[float]:
    return [sum(x[j] for j in chunk_stages(schedule, pp, v, r)) for r in range(pp)]


def _steady_formula(f: Sequence[float], b: Sequence[float], schedule: Schedule, m: int, pp: int, v: int,
                    w: Sequence[float] | None = None, hidden: Sequence[float] | None = None) -> float:
    if schedule is Schedule.GPIPE:
        fr = [sum(f[r::pp]) for r in range(pp)]
        br = [sum(b[r::pp]) for r in range(pp)]
        return (m * max(fr) + sum(f) - max(fr)) + (m * max(br) + sum(b) - max(br))
    d = _rank_sums([x + y for x, y in zip(f, b, strict=True)], schedule, pp, v)
    if schedule.zero_bubble:
        e, x = _zero_bubble_fill(f, b, w if w is not None else [0.0] * len(f), schedule, pp, v)
        h = hidden if hidden is not None else [0.0] * pp
        return max(m * dr - hr - er / v for dr, hr, er in zip(d, h, e, strict=True)) + (sum(e) + x) / v
    if hidden is not None:
        return max(m * dr - hr for dr, hr in zip(d, hidden, strict=True)) + (sum(f) + sum(b) - max(d)) / v
    return m * max(d) + (sum(f) + sum(b) - max(d)) / v


def _zero_bubble_fill(f: Sequence[float], b: Sequence[float], w: Sequence[float], schedule: Schedule, pp: int,
                      v: int) -> tuple[list[float], float]:
    """Per rank E_r and the schedule's X (module docstring)."""
    fr = _rank_sums(f, schedule, pp, v)
    ir = _rank_sums([x - y for x, y in zip(b, w, strict=True)], schedule, pp, v)
    wr = _rank_sums(w, schedule, pp, v)
    e = [zero_bubble_fill(schedule, a, c, d) for a, c, d in zip(fr, ir, wr, strict=True)]
    return e, max(zero_bubble_extra(schedule, pp, a, c) for a, c in zip(fr, ir, strict=True))


def zero_bubble_fill(schedule: Schedule, fwd_s: float, input_grad_s: float, weight_grad_s: float) -> float:
    """E_r of a rank whose chunks take `fwd_s`, `input_grad_s` and `weight_grad_s` per micro-batch, sends
    included (module docstring); the search prices its partition problems with it too."""
    if schedule is Schedule.ZBV:
        return max(fwd_s, input_grad_s, 2 * (input_grad_s - weight_grad_s))
    return fwd_s + max(input_grad_s - weight_grad_s, 0.0)


def zero_bubble_extra(schedule: Schedule, pp: int, fwd_s: float, input_grad_s: float) -> float:
    """X_r: what DualPipeV's paired chunks add when a rank's input gradients outgrow its forwards (0 for the other
    schedules); X is its largest over the ranks."""
    if schedule is not Schedule.DUALPIPEV:
        return 0.0
    return max((pp - 1) * (input_grad_s - fwd_s) - fwd_s, 0.0)


def dualpipev_pairs(pp: int, num_microbatches: int, rank: int) -> tuple[int, int]:
    """(N01, N10): rank `rank`'s overlapped F&B pairs in torch's ScheduleDualPipeV, forward of chunk 0 with
    backward of chunk 1 and the reverse (module docstring)."""
    main = num_microbatches - 2 * pp + rank + 1
    return main - (1 if rank == pp - 1 else 0), num_microbatches - pp


@dataclass(frozen=True, slots=True)
class ChunkWork:
    """One virtual stage's seconds per micro-batch that the paired overlap sees: compute (recomputation
    included) and expert-parallel all-to-alls, per pass."""

    compute_fwd_s: float
    compute_bwd_s: float
    a2a_fwd_s: float = 0.0
    a2a_bwd_s: float = 0.0


PAIRED_SCHEDULES = frozenset({Schedule.DUALPIPEV, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED})
"""Schedules whose steady state runs forward and backward passes as overlapped pairs (module docstring)."""


def steady_pairs(schedule: Schedule, pp: int, num_microbatches: int, virtual_stages: int, rank: int) -> int:
    """Steps of 1F1B's or interleaved 1F1B's steady state on `rank`: m v less its warm-up forwards (module
    docstring)."""
    total = num_microbatches * virtual_stages
    if Schedule(schedule) is Schedule.INTERLEAVED:
        warmup = (pp - rank - 1) * 2 + (virtual_stages - 1) * pp
    else:
        warmup = pp - rank - 1
    return total - min(total, warmup)


def _hidden(f: ChunkWork, b: ChunkWork) -> float:
    return min(f.a2a_fwd_s, b.compute_bwd_s) + min(b.a2a_bwd_s, f.compute_fwd_s)


def paired_overlap(chunks: Sequence[ChunkWork], pp: int, num_microbatches: int,
                   schedule: Schedule = Schedule.DUALPIPEV, virtual_stages: int = 2) -> list[float]:
    """H_r: per rank, the all-to-all seconds its F&B pairs hide in one step (module docstring); `chunks` are the
    p v virtual stages in pipeline order."""
    schedule = Schedule(schedule)
    if schedule not in PAIRED_SCHEDULES:
        raise ValueError(f"the {schedule.value} schedule runs no forward and backward passes as pairs")
    if schedule is not Schedule.DUALPIPEV:
        out = []
        for r in range(pp):
            mine = [chunks[j] for j in chunk_stages(schedule, pp, virtual_stages, r)]
            mean = ChunkWork(*(sum(getattr(c, k) for c in mine) / len(mine)
                               for k in ("compute_fwd_s", "compute_bwd_s", "a2a_fwd_s", "a2a_bwd_s")))
            out.append(steady_pairs(schedule, pp, num_microbatches, virtual_stages, r) * _hidden(mean, mean))
        return out
    if len(chunks) != 2 * pp:
        raise ValueError(f"the paired overlap needs the 2 * pp = {2 * pp} virtual stages of DualPipeV, got "
                         f"{len(chunks)}")
    out = []
    for r in range(pp):
        first, second = (chunks[j] for j in chunk_stages(Schedule.DUALPIPEV, pp, 2, r))
        n01, n10 = dualpipev_pairs(pp, num_microbatches, r)
        out.append(n01 * _hidden(first, second) + n10 * _hidden(second, first))
    return out


@dataclass(frozen=True, slots=True)
class PipelineTime:
    """The pipeline part of a step, split as the critical path sees it (terms add up to `total_s`)."""

    total_s: float
    busy_s: float
    """m * (forward + backward) of one micro-batch on the busiest rank."""
    bubble_s: float
    p2p_s: float
    bottleneck_rank: int
    hidden_s: float = 0.0
    """Of the bottleneck rank's busy time, the all-to-all seconds the paired overlap hides (`busy_s` is net)."""


def pipeline_times(stage_fwd: Sequence[float], stage_bwd: Sequence[float], schedule: Schedule,
                   num_microbatches: int, virtual_stages: int = 1,
                   p2p_time: float | Sequence[float] = 0.0,
                   stage_wgrad: Sequence[float] | None = None,
                   rank_hidden: Sequence[float] | None = None, p2p_overlap: bool = False) -> PipelineTime:
    """Step time of the pipeline and its busy / bubble / p2p split (formulas in the module docstring).
    `stage_wgrad[j]`: of `stage_bwd[j]`, the weight-gradient seconds (W) the zero-bubble schedules defer.
    `rank_hidden[r]`: H_r of the paired all-to-all overlap (`paired_overlap`, `PAIRED_SCHEDULES` only).
    `p2p_overlap`: the interleaved schedule's sends wait only in the fill and drain (module docstring)."""
    n = len(stage_fwd)
    if n == 0 or len(stage_bwd) != n or (stage_wgrad is not None and len(stage_wgrad) != n):
        raise ValueError(f"need equally many forward, backward (and weight-gradient) stage times, got {n} and "
                         f"{len(stage_bwd)}")
    if n % virtual_stages:
        raise ValueError(f"{n} stages is not a multiple of virtual_stages={virtual_stages}")
    pp = n // virtual_stages
    schedule = _check(schedule, pp, num_microbatches, virtual_stages)
    m, v = num_microbatches, virtual_stages
    if rank_hidden is not None and (schedule not in PAIRED_SCHEDULES or len(rank_hidden) != pp):
        raise ValueError(f"rank_hidden is the paired overlap of {', '.join(sorted(PAIRED_SCHEDULES))}, one value "
                         f"per rank ({pp}); got {schedule.value} with {len(rank_hidden)}")
    h = list(rank_hidden) if rank_hidden is not None else [0.0] * pp
    p2p = _p2p_list(p2p_time, n)
    plain = _steady_formula(stage_fwd, stage_bwd, schedule, m, pp, v, stage_wgrad, h)
    if sends_overlap(schedule, p2p_overlap):
        total = plain + 2 * sum(p2p)
    else:
        f, b = _with_p2p(stage_fwd, stage_bwd, p2p)
        total = _steady_formula(f, b, schedule, m, pp, v, stage_wgrad, h)
    d = _rank_sums([x + y for x, y in zip(stage_fwd, stage_bwd, strict=True)], schedule, pp, v)
    rank = max(range(pp), key=lambda r: (m * d[r] - h[r], -r))
    busy = m * d[rank] - h[rank]
    return PipelineTime(total_s=total, busy_s=busy, bubble_s=plain - busy, p2p_s=total - plain,
                        bottleneck_rank=rank, hidden_s=h[rank])


def pipeline_step_time(stage_fwd: Sequence[float], stage_bwd: Sequence[float], schedule: Schedule,
                       num_microbatches: int, virtual_stages: int = 1,
                       p2p_time: float | Sequence[float] = 0.0,
                       stage_wgrad: Sequence[float] | None = None) -> float:
    """Seconds from the first forward to the last backward of a step (see module docstring)."""
    return pipeline_times(stage_fwd, stage_bwd, schedule, num_microbatches, virtual_stages, p2p_time,
                          stage_wgrad).total_s


def drain_slack(stage_bwd: Sequence[float], pp: int, p2p_time: float | Sequence[float] = 0.0,
                schedule: Schedule = Schedule.ONE_F_ONE_B) -> tuple[float, ...]:
    """Per rank: seconds between its last backward and the end of the pipeline (the drain through lower ranks).

    The last micro-batch's gradient still flows through ranks r-1 .. 0 (their first-chunk backwards and the p2p
    between them) after rank r finishes; gradient reduction on rank r can hide in that time. The zero-bubble
    schedules fill that time with deferred weight gradients: no slack.
    """
    if Schedule(schedule).zero_bubble:
        return (0.0,) * pp
    p2p = _p2p_list(p2p_time, len(stage_bwd))
    slack = [0.0] * pp
    for r in range(1, pp):
        slack[r] = slack[r - 1] + stage_bwd[r - 1] + p2p[r - 1]
    return tuple(slack)
