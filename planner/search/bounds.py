"""Lower bounds on a candidate's step time for the branch and bound (`planner.search.branch_and_bound`): a cheap
one before its layer classes are priced (level 1), a tight one from its own layer prices (level 2)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.layer_cost import LayerCost
from costmodel.pipeline import chunk_stages, sends_overlap
from costmodel.step_time import tp_bwd_exposed, tp_exposed
from costmodel.strategy import Schedule
from planner.search.candidates import Candidate
from planner.search.interleaved_layout import InterleavedLayout
from planner.search.stage_problem import segment_work, tp_overlap_chunks


@dataclass(frozen=True, slots=True)
class PipelineBound:
    """A pipeline bound (`cheap_lower_bound`'s, `tight_lower_bound`'s) and two of its parts, which
    `end_reduce_lower_bound` builds on."""

    value: float
    bottleneck: float
    """U: at most the busiest rank's work per micro-batch."""
    head: float
    """At most the pipeline's first term, S / v (the whole chain's work over v)."""


def cheap_lower_bound(cand: Candidate, replicated_s: float, *, optimizer_s: float, forward_s: float = 0.0,
                      comm_s: float = 0.0, comm_forward_s: float = 0.0) -> PipelineBound:
    """A lower bound on the candidate's step time from tp == 1 prices, without solving any sharding.

    `replicated_s`: forward + backward compute of one micro-batch of the whole chain replicated on one device,
    divided by the fastest rank's speed -- or, where larger, tp times a tp rank's work at the candidate's own
    prices once the search has them (`CandidateBounds.shape_bound`), which then holds the division by tp. Tensor
    parallelism at best divides a replicated op's time by tp (the GEMM efficiency curve only rises with size, the
    memory and launch terms scale at most as 1/tp),
    communication and recomputation are >= 0, and the busiest pipeline rank carries at least 1/p of the work:
    ``T >= S/v + (m - 1/v) S/p`` with ``S = replicated_s / tp`` (v = 1 for GPipe and 1F1B), plus the smallest
    possible optimizer step (`optimizer_s`, computed by the caller for an even split). A zero-bubble schedule's
    fill and drain can be less than S/v: ``T >= max(m S/p, (m - 2/v) S/p + F/v)`` with F the forward part of S
    (`forward_s` replicated; `tight_lower_bound` says why). With cp > 1 both already hold the attention as cp ranks
    run it, cp times (`CandidateBounds.cheap`), and cp splits the rest of every op's work cp ways. `comm_s`: per
    micro-batch, communication of the whole chain that nothing overlaps, at most the candidate's own (the expert
    all-to-alls: `tight_lower_bound`'s work counts them whole), `comm_forward_s` its forward part; both add to S
    and F as they are."""
    split = cand.mesh.tp * cand.mesh.cp
    total = replicated_s / split + comm_s
    m, p = cand.num_microbatches, cand.mesh.pp
    if cand.schedule.zero_bubble:
        v = cand.virtual_stages
        value = max(m * total / p, (m - 2 / v) * total / p + (forward_s / split + comm_forward_s) / v)
        return PipelineBound(value + optimizer_s, total / p, total / v)
    v = cand.virtual_stages if cand.schedule is Schedule.INTERLEAVED else 1
    return PipelineBound(total / v + (m - 1 / v) * total / p + optimizer_s, total / p, total / v)


def _min_max_partition(prefix: np.ndarray, p: int) -> float:
    """A lower bound (within 1e-9 relative) on min over contiguous p-partitions of the largest part sum."""
    return _min_max_partition_ranks([prefix] * p)


def tight_lower_bound(cand: Candidate, costs: Sequence[tuple[Sequence[LayerCost], float]], *, optimizer_s: float,
                      layout: InterleavedLayout | None = None, p2p: Sequence[float] = (),
                      rank_sends: Sequence[float] = (),
                      work: Callable[[Sequence[LayerCost], float], np.ndarray] | None = None) -> PipelineBound:
    """A lower bound on the candidate's step time from its own layer prices (tp sharding solved).

    `costs`: per pipeline rank in order, its segment prices and speed. Per segment ``w_j`` is the least over ranks
    of ``(forward + backward compute) / speed + forward + backward TP communication`` (recomputation and
    data-parallel communication are >= 0). The pipeline's bottleneck rank carries at least the min-max
    contiguous split of ``w`` over p stages -- where the ranks differ, of each rank's own work, stage k priced on
    rank k; for interleaved, the least bottleneck of its chunk layouts (`interleaved_bottleneck`) with the sends
    (`p2p`, one per chunk boundary). A contiguous stage also pays its receive and send, at least `rank_sends[k]`
    on rank k, once per micro-batch (across a slow tier, seconds). So
    ``T >= W / v + (m - 1/v) U + optimizer_s``. A zero-bubble schedule's step is at least m D_* + the other
    ranks' E_r / v (`costmodel.pipeline`, * the busiest rank). For interleaved-zb and dualpipev E_r = f_r +
    max(i_r - w_r, 0) <= D_r and their sum is at least F + max(I - W, 0) over the chain (W: the weight-gradient
    compute, I the rest of the backward, F the forward); ZB-V's E_r is at least f_r and at most 2 D_r. So
    ``T >= max(m U, (m - 1/v) U + (F + max(I - W, 0)) / v)``, resp. ``max(m U, (m - 2/v) U + F / v)``, plus
    `optimizer_s`. `work(segs, speed)`: `segment_work` of the candidate's overlap settings (a caller's cache)."""
    keys = [(id(segs), speed) for segs, speed in costs]
    unique = dict(zip(keys, costs, strict=True))  # ranks on one device type and speed share their prices
    if work is None:
        def work(segs: Sequence[LayerCost], speed: float) -> np.ndarray:
            return segment_work(segs, speed, tp_overlap_chunks(cand), cand.runtime.tp_grad_overlap)
    work_of = {key: work(segs, speed) for key, (segs, speed) in unique.items()}
    w = np.min(list(work_of.values()), axis=0)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    m, p = cand.num_microbatches, cand.mesh.pp
    total = float(prefix[-1])
    # Ranks that differ (a straggler, another device type) each carry their own work: the bottleneck is then
    # over partitions priced rank by rank, which no longer assumes the slow rank as fast as the fastest.
    per_rank = [work_of[key] for key in keys] if len(keys) == p and len(work_of) > 1 else None
    if layout is not None:
        v = cand.virtual_stages
        # Every boundary is sent once and received once; overlapped sends (`RuntimeOptions.p2p_overlap`) wait
        # only in the fill and drain, each once: v times in the total, not in U.
        overlapped = sends_overlap(cand.schedule, cand.runtime.p2p_overlap)
        u = interleaved_bottleneck(layout, w, [0.0] * len(p2p) if overlapped else p2p, per_rank)
        total += 2 * sum(p2p) * (v if overlapped else 1)
    else:
        v = 1
        total += sum(rank_sends)
        prefixes = [prefix] * p if per_rank is None else [np.concatenate([[0.0], np.cumsum(x)]) for x in per_rank]
        u = _min_max_partition_ranks(prefixes, rank_sends)
    if cand.schedule.zero_bubble:
        n = tp_overlap_chunks(cand)
        parts = np.min([[(c.fwd_compute_s / speed + tp_exposed(c.fwd_comm_s, c.fwd_compute_s / speed, n),
                          c.bwd_compute_s * (1 - 2 * c.weight_grad_share) / speed
                          + tp_bwd_exposed(c, c.bwd_compute_s / speed, n, cand.runtime.tp_grad_overlap))
                         for c in segs]
                         for segs, speed in unique.values()], axis=0).sum(axis=0) + sum(p2p)
        forward, input_less_weight = float(parts[0]), max(float(parts[1]), 0.0)
        if cand.schedule is Schedule.ZBV:
            value = max(m * u, (m - 2 / v) * u + forward / v)
        else:
            value = max(m * u, (m - 1 / v) * u + (forward + input_less_weight) / v)
        return PipelineBound(value + optimizer_s, u, total / v)
    return PipelineBound(total / v + (m - 1 / v) * u + optimizer_s, u, total / v)


def end_reduce_lower_bound(cand: Candidate, pipe: PipelineBound, end_reduce_s: float) -> float:
    """A lower bound on the step time (optimizer step left out) from the end-of-step gradient reduction (ZeRO-0/1,
    and ZeRO-2/3 under pipelining), `end_reduce_s` at most the largest rank's C_r: what the pipeline's drain and
    the last backward cannot hide, where a slow tier makes it seconds.

    The step is the pipeline plus ``max_r max(e_r - P_r, 0)`` (`step_time.step_breakdown`) with ``e_r >= C_r -
    W_r`` (`step_time.overlapped_exposed`), W_r rank r's last backward and P_r the drain behind it
    (`pipeline.drain_slack`):
    - 1F1B and GPipe: W_r + P_r is at most one micro-batch's backward of the whole chain, sends included, B,
      and the pipeline is at least F + B + (m - 1) max_k d_k: ``T >= (m - 1) U + C_r``;
    - zero-bubble schedules: P_r = 0 and W_r <= D_r, and the pipeline is at least m max_r D_r: the same bound;
    - interleaved: W_r + P_r <= sum_{k <= r} D_k <= p max D (with overlapped sends, plus sends that S counts
      twice), and the pipeline is S / v + (m - 1/v) max D: ``T >= S / v + (m - 1/v - p) U + C_r`` where
      m - 1/v >= p (0 otherwise: the bound would need an upper bound on max D)."""
    if end_reduce_s <= 0:
        return 0.0
    m = cand.num_microbatches
    if cand.schedule.zero_bubble or not (cand.schedule.chunked and cand.virtual_stages > 1):
        return (m - 1) * pipe.bottleneck + end_reduce_s
    coefficient = m - 1 / cand.virtual_stages - cand.mesh.pp
    return pipe.head + coefficient * pipe.bottleneck + end_reduce_s if coefficient >= 0 else 0.0


def _min_max_partition_ranks(prefixes: Sequence[np.ndarray], fixed: Sequence[float] = ()) -> float:
    """`_min_max_partition` where part k is priced by its own prefix sums `prefixes[k]` (rank k's work) plus
    `fixed[k]` (what its stage pays whatever it holds, such as its sends): the least U (within 1e-9 relative) such
    that the parts, filled in order each as far as it stays within U, cover the chain -- filling a part as far as
    it can never leaves the later ones more to do, so this is the least largest part over every contiguous
    partition (empty parts allowed, which only lowers it; every rank pays its fixed part)."""
    # Lists and `bisect` (the same search as np.searchsorted side="right"): the probes are scalars, where numpy's
    # per-call overhead is most of the time.
    as_list = {id(x): x.tolist() for x in prefixes}  # ranks alike share one array
    sums = [as_list[id(x)] for x in prefixes]
    fixed = list(fixed) or [0.0] * len(sums)
    n = len(sums[0]) - 1
    # Some rank holds at least the cheapest mean, every rank its fixed part; rank 0 holding everything fits.
    lo = max(min(s[-1] for s in sums) / len(sums), max(fixed))
    hi = sums[0][-1] + max(fixed)
    if lo <= 0:
        return 0.0

    def feasible(x: float) -> bool:
        pos = 0
        for rank, own in zip(sums, fixed, strict=True):
            pos = max(pos, bisect.bisect_right(rank, rank[pos] + x - own) - 1)
            if pos >= n:
                return True
        return False

    if feasible(lo):
        return lo
    for _ in range(60):
        if hi - lo <= 1e-9 * hi:
            break
        mid = 0.5 * (lo + hi)
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return lo


def comm_lower_bound(cand: Candidate, comm: np.ndarray, layout: InterleavedLayout | None = None,
                     num_sends: int = 0) -> float:
    """A lower bound on the candidate's step time from the data-parallel communication its micro-batches issue.

    `comm[j]`: per segment, the whole ZeRO-2/3 collectives one micro-batch issues for it (gathers and
    reduce-scatters, nothing overlapped). A chunk's collectives go one after another, so its forward + backward
    is at least their sum however much of it the compute hides (``W + exposed(C, W, n) >= C``,
    `costmodel.step_time.overlapped_exposed`); and the chunk's sum is at least the sum of its segments' (each
    unit pays a latency and the bytes term is linear). The pipeline then bounds the step as the compute does
    in `tight_lower_bound`: ``T >= C / v + (m - 1/v) U_c`` (``m U_c`` for a zero-bubble schedule), with
    ``U_c`` the least largest rank load over the partitions (or chunk layouts, `num_sends` boundaries)."""
    m, p = cand.num_microbatches, cand.mesh.pp
    if layout is not None:
        v = cand.virtual_stages
        u = interleaved_bottleneck(layout, comm, [0.0] * num_sends)
    else:
        v = 1
        u = _min_max_partition(np.concatenate([[0.0], np.cumsum(comm)]), p)
    if cand.schedule.zero_bubble:
        return m * u
    return float(comm.sum()) / v + (m - 1 / v) * u


def interleaved_bottleneck(layout: InterleavedLayout, w: np.ndarray, p2p: Sequence[float],
                           per_rank: Sequence[np.ndarray] | None = None) -> float:
    """The least largest rank work max_r D_r over the layouts (`planner.search.interleaved_problem`), from the
    per-segment work ``w`` (or each rank's own, `per_rank`) and the sends: each rank starts with its smaller
    chunks (its sends are fixed by position), and the E extra blocks go one by one to the rank with room (at most
    v each) that would finish them first -- optimal for min-max with a fixed increment per rank (unit jobs on
    machines of different speeds). Layouts the sends leave out only raise it."""
    p, v, n = layout.pp, layout.virtual_stages, len(p2p) + 1
    ranks_w = list(per_rank) if per_rank is not None else [w] * p

    def mine(r: int) -> tuple[int, ...]:
        return chunk_stages(layout.schedule, p, v, r)

    def sends(r: int) -> float:
        return sum((p2p[j - 1] if j > 0 else 0.0) + (p2p[j] if j < n - 1 else 0.0) for j in mine(r))

    if layout.fixed:
        return max(sum(float(ranks_w[r][layout.fixed[j].start:layout.fixed[j].stop].sum()) for j in mine(r))
                   + sends(r) for r in range(p))
    # Each rank's smaller chunks (`InterleavedLayout.chunk_segments` with q units each): q blocks per chunk, the
    # embedding and the head in place of a block where they sit.
    q, head = layout.small, layout.head_chunk
    block = [float(x[layout.pre]) for x in ranks_w]

    def small_chunks(r: int) -> float:
        x, total = ranks_w[r], 0.0
        for c in range(v):
            pre, post = r == 0 and c == 0 and layout.pre > 0, (r, c) == head and layout.post > 0
            total += max(q - pre - post, 0) * block[r]
            total += (float(x[:layout.pre].sum()) if pre else 0.0) + (
                float(x[layout.pre + layout.blocks:].sum()) if post else 0.0)
        return total

    work = [small_chunks(r) + sends(r) for r in range(p)]
    room = [v] * p
    for _ in range(layout.extra):
        r = min((r for r in range(p) if room[r]), key=lambda r: work[r] + block[r])
        work[r] += block[r]
        room[r] -= 1
    return max(work)
