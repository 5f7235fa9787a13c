"""An interleaved candidate as a stage-partition problem: each pipeline rank picks its chunk layout and
recomputation.

Formulation
-----------
The layouts (`planner.search.interleaved_layout`): rank r holds v chunks, e_r of them one unit larger (sum_r e_r = E),
its lead chunk larger or not, and one recomputation mode. Per choice the rank's terms come from
`costmodel.estimate.rank_step_terms` (as for every stage, `planner.search.stage_problem`): per chunk f_c and b_c,
the exposed end-of-step reduction, the shared-weight sync, the optimizer step, the post-step gather, and its peak
memory `memory.rank_memory` with the schedule's in-flight count of each chunk.

Sends: boundary j (chunk j -> j + 1) costs s_j, by its position only (j % p, and the wrap from rank p-1 back to
rank 0; each carries a block's output). With chunk j = c p + r, rank r's work per micro-batch is

    D_r = sum_c (f_c + b_c + s_{j-1} [j > 0] + s_j [j < p v - 1])

and the step (`pipeline.pipeline_times`, `step_time.step_breakdown`) is

    T = S / v + (m - 1/v) max_r D_r + max_r post_r + max_r opt_r + max_r (max(tail_r - P_r, 0) + c_r)

with S = sum_r D_r and the drain P_r = sum_{k < r} (b of rank k's first chunk + s_k). With overlapped sends
(`RuntimeOptions.p2p_overlap`) the max takes D_r without its sends and S counts them v times: the step without
sends plus 2 sum_j s_j (`pipeline.pipeline_times`).

As a `PartitionProblem`: the "segments" are N = p + E tokens, rank r is stage r and takes e_r + 1 of them (so the
e_r add up to E), and its options are (recomputation, lead larger or not). Stage r's terms depend on its token
count, not on where its tokens start; a choice that is not a layout (`InterleavedLayout.rank_units`) never fits.
Stage r always starts at a token in r .. r + E (each earlier stage took 1 .. v + 1), so ranks r and r + E + 1 never
read the same entries and share one profile: min(p, E + 1) profiles (one when the units divide evenly). The DP's
optimum is then the optimum over every canonical layout and per-rank recomputation, hence over every layout (the
layout module's docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from costmodel.layer_cost import LayerCost
from costmodel.pipeline import chunk_stages, sends_overlap, stage_rank, zero_bubble_extra, zero_bubble_fill
from costmodel.strategy import Schedule, StageSpec
from planner.search.interleaved_layout import InterleavedLayout, RankChoice
from planner.search.recompute_choice import RecomputeChoice
from planner.search.stage_partition import Partition, PartitionProblem, StageChoice

LEAD_SUFFIX = "+lead"
"""Marks the options whose lead chunk is one of the rank's larger ones."""


@dataclass(frozen=True, slots=True)
class ChoiceTerms:
    """One rank's terms for one (layout choice, recomputation), per micro-batch and end of step."""

    fwd: tuple[float, ...]
    """Per chunk: forward seconds (before sends)."""
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    """Per chunk: of `bwd`, the weight-gradient seconds (W of the zero-bubble schedules)."""
    tail: float
    tail_const: float
    optimizer: float
    post: float
    memory: float


def option_names(layout: InterleavedLayout, options: Sequence[RecomputeChoice]) -> tuple[str, ...]:
    """The DP's options: each recomputation, with and (for unit layouts) without a larger lead chunk."""
    return tuple(rc.value + (LEAD_SUFFIX if lead else "") for rc in options for lead in layout.lead_options)


def decode(layout: InterleavedLayout, partition: Partition, rank_costs: Sequence[Sequence[LayerCost]],
           classes: Sequence[int]) -> tuple[StageSpec, ...]:
    """The chunks (`StageSpec`s in chain order) of a solved problem; `rank_costs` (per pipeline rank, its
    segments' costs) and `classes` say which segments a partial recomputation picks."""
    picks, choices = [], []
    for st in partition.stages:
        lead = st.option.endswith(LEAD_SUFFIX)
        picks.append((st.stop - st.start - 1, lead))
        choices.append(RecomputeChoice.parse(st.option.removesuffix(LEAD_SUFFIX)))
    specs = layout.stages(picks, [c.mode for c in choices])
    ranks = [stage_rank(layout.schedule, layout.pp, j) for j in range(len(specs))]
    return tuple(choices[r].spec(s.start, s.stop, rank_costs[r], classes) for s, r in zip(specs, ranks, strict=True))


def rank_terms(layout: InterleavedLayout, rank: int, terms: ChoiceTerms, sends: Sequence[float],
               num_microbatches: int, p2p_overlap: bool = False) -> tuple[float, float, float]:
    """The rank's (additive, steady, extra) terms of the step (module docstring): D_r, D_r, 0 for interleaved
    1F1B, or with `p2p_overlap` D_r with its sends counted v times, D_r without them, 0 (they wait only in the
    fill and drain); E_r, m D_r - E_r / v, X_r / v for the zero-bubble schedules. Sends join the receiving forward
    and the sending input gradient."""
    schedule, p, v = layout.schedule, layout.pp, layout.virtual_stages
    last = len(sends)
    f = i = w = 0.0
    for j, fc, bc, wc in zip(chunk_stages(schedule, p, v, rank), terms.fwd, terms.bwd, terms.wgrad, strict=True):
        f += fc + (sends[j - 1] if j > 0 else 0.0)
        i += bc - wc + (sends[j] if j < last else 0.0)
        w += wc
    d = f + i + w
    if sends_overlap(schedule, p2p_overlap):
        plain = sum(terms.fwd) + sum(terms.bwd)
        return plain + v * (d - plain), plain, 0.0
    if not schedule.zero_bubble:
        return d, d, 0.0
    e = zero_bubble_fill(schedule, f, i, w)
    return e, num_microbatches * d - e / v, zero_bubble_extra(schedule, p, f, i) / v


def interleaved_problem(layout: InterleavedLayout, options: Sequence[RecomputeChoice],
                        price: Callable[[int, RankChoice, RecomputeChoice], ChoiceTerms | None] | None,
                        sends: Sequence[float],
                        capacity: Sequence[float], num_microbatches: int, *,
                        only: Sequence[tuple[int, bool]] | None = None,
                        preferred: tuple[StageChoice, ...] | None = None,
                        choices: Callable[[int], Sequence[RankChoice]] | None = None,
                        p2p_overlap: bool = False) -> PartitionProblem:
    """The `PartitionProblem` of the module docstring; `price(rank, choice, recompute)` gives a choice's terms
    (None: the choice cannot beat the caller's bound, and never fits; `price` None: no choice can), `sends` one
    time per chunk boundary.
    `only`: per rank the one (extra, lead_large) it may take (the even split); `preferred`: the partition that
    wins ties; `choices`: `layout.choices`, or a cache of it; `p2p_overlap`: `RuntimeOptions.p2p_overlap`."""
    p, extra = layout.pp, layout.extra
    n, profiles = p + extra, min(p, extra + 1)
    names = option_names(layout, options)
    shape = (profiles, len(names), n + 1, n + 1)
    zero_bubble = layout.schedule.zero_bubble
    additive, bottleneck = np.zeros(shape + (1,)), np.zeros(shape + (4 if zero_bubble else 3,))
    memory_base = np.full(shape, np.inf)  # a choice that is not a layout never fits
    tail, tail_const, drain = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    rows: list[tuple[float, ...]] = []
    for k in range(p if price is not None else 0):
        for choice in (choices or layout.choices)(k):
            if only is not None and (choice.extra, choice.lead_large) != tuple(only[k]):
                continue
            tokens = choice.extra + 1
            last_start = min(k + extra, n - tokens)
            if last_start < k:
                continue
            for r, rc in enumerate(options):
                o = r * len(layout.lead_options) + layout.lead_options.index(choice.lead_large)
                t = price(k, choice, rc)
                if t is None:
                    continue
                add, steady, paired = rank_terms(layout, k, t, sends, num_microbatches, p2p_overlap)
                # The drain behind rank k+1 runs through virtual stage k (this rank's first chunk) and its send;
                # the zero-bubble schedules fill it with weight gradients (`pipeline.drain_slack`).
                drain_k = 0.0 if zero_bubble else t.bwd[0] + sends[k]
                rows.append((k % profiles, o, k, last_start, tokens, add, steady, t.post, t.optimizer, paired,
                             t.memory, t.tail, t.tail_const, drain_k))
    if rows:
        # One scatter per array: each (profile, option, start, stop) is written by one entry only (ranks that
        # share a profile start at disjoint tokens).
        table = np.array(rows)
        first, last = table[:, 2].astype(int), table[:, 3].astype(int)
        counts = last - first + 1
        entry = np.repeat(np.arange(len(rows)), counts)
        a = first[entry] + np.arange(len(entry)) - np.repeat(np.cumsum(counts) - counts, counts)
        q, o, b = table[entry, 0].astype(int), table[entry, 1].astype(int), a + table[entry, 4].astype(int)
        additive[q, o, a, b, 0] = table[entry, 5]
        bottleneck[q, o, a, b] = table[entry][:, 6:6 + bottleneck.shape[-1]]
        memory_base[q, o, a, b] = table[entry, 10]
        tail[q, o, a, b] = table[entry, 11]
        tail_const[q, o, a, b] = table[entry, 12]
        drain[q, o, a, b] = table[entry, 13]
    # Memory is all in `memory_base` (the in-flight counts are in it, per chunk).
    return PartitionProblem(num_segments=n, num_stages=p, options=names,
                            stage_profile=tuple(k % profiles for k in range(p)), in_flight=(0,) * p,
                            capacity=tuple(capacity), additive=tuple(additive),
                            objective=step_objective(layout.schedule, num_microbatches, layout.virtual_stages),
                            weights=step_weights(layout.schedule, num_microbatches, layout.virtual_stages,
                                                 bottleneck.shape[-1]),
                            bottleneck=tuple(bottleneck), memory_base=tuple(memory_base),
                            memory_per_microbatch=tuple(np.zeros(shape)), tail=tuple(tail),
                            tail_const=tuple(tail_const), drain=tuple(drain), preferred=preferred)


def least_step_time(schedule: Schedule, num_microbatches: int, virtual_stages: int,
                    least_work: Sequence[float]) -> float:
    """A lower bound on the step from each rank's least work per micro-batch D_r over the choices that fit.

    Interleaved 1F1B: T = S / v + (m - 1/v) max_r D_r + (post, optimizer, tail: all >= 0), S = sum_r D_r, and
    every D_r is at least its least, so T >= sum_r least_r / v + (m - 1/v) max_r least_r (Phi is monotone).
    Zero-bubble: T = sum_r E_r / v + max_r (m D_r - E_r / v) + (>= 0 terms) >= E_r / v + m D_r - E_r / v = m D_r
    for every r (E_r >= 0), so T >= m max_r least_r."""
    m, v = num_microbatches, virtual_stages
    if Schedule(schedule).zero_bubble:
        return m * max(least_work)
    return sum(least_work) / v + (m - 1 / v) * max(least_work)


def least_step_time_by_extra(schedule: Schedule, num_microbatches: int, virtual_stages: int, extra: int,
                             least_work: Sequence[Sequence[float]]) -> float:
    """`least_step_time` knowing that the ranks share E larger chunks: `least_work[r][e]` is rank r's least work
    per micro-batch over its choices with e larger chunks that fit (inf: none), and every layout has
    sum_r e_r = E.

    The largest D_r of a layout is at least U* = the least U at which every rank has an e with
    least_work[r][e] <= U and those largest such e add up to E or more (the layout's own e_r qualify at its
    largest D). The sum S is at least the least sum_r least_work[r][e_r] over e_r adding up to E (a knapsack
    over the ranks). Phi is monotone in both, so T >= S / v + (m - 1/v) U* (m U* for a zero-bubble schedule);
    this is never below `least_step_time`, whose max and sum take every rank at its least over all e."""
    m, v = num_microbatches, virtual_stages

    def room(u: float) -> int:
        fits = [[e for e, x in enumerate(row) if x <= u] for row in least_work]
        return sum(max(f) for f in fits) if all(fits) else -1

    values = sorted({x for row in least_work for x in row if math.isfinite(x)})
    lo, hi = 0, len(values)
    while lo < hi:  # room(u) grows with u: the first value with room for E
        mid = (lo + hi) // 2
        if room(values[mid]) >= extra:
            hi = mid
        else:
            lo = mid + 1
    if lo == len(values):
        return math.inf
    largest = values[lo]
    if Schedule(schedule).zero_bubble:
        return m * largest
    sums = {0: 0.0}
    for row in least_work:
        nxt: dict[int, float] = {}
        for j, total in sums.items():
            for e, x in enumerate(row):
                if j + e <= extra and math.isfinite(x) and total + x < nxt.get(j + e, math.inf):
                    nxt[j + e] = total + x
        sums = nxt
    return sums.get(extra, math.inf) / v + (m - 1 / v) * largest


def step_weights(schedule: Schedule, num_microbatches: int, virtual_stages: int, num_bottleneck: int
                 ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`step_objective` as the linear form the partition solver's dominance uses (`PartitionProblem.weights`):
    one sum, then `num_bottleneck` maxima and the tail."""
    m, v = num_microbatches, virtual_stages
    if Schedule(schedule).zero_bubble:
        return (1 / v,), (1.0,) * (num_bottleneck + 1)
    return (1 / v,), (m - 1 / v,) + (1.0,) * num_bottleneck


def step_objective(schedule: Schedule, num_microbatches: int, virtual_stages: int):
    """Phi(S, U) of the step (`pipeline._steady_formula` plus the step's tails): S / v + (m - 1/v) U_pipe + U_post
    + U_opt + tail for 1F1B and interleaved; S / v + U_pipe + U_post + U_opt [+ U_extra] + tail for the
    zero-bubble schedules, whose U_pipe is already m D_r - E_r / v."""
    m, v = num_microbatches, virtual_stages
    if not Schedule(schedule).zero_bubble:
        def phi(s, u):
            return s[0] / v + (m - 1 / v) * u[0] + u[1] + u[2] + u[-1]
        return phi

    def phi_zero_bubble(s, u):
        return s[0] / v + sum(u[:-1]) + u[-1]
    return phi_zero_bubble
