"""Pricing an interleaved candidate's rank choices for `planner.search.interleaved_problem`, cheapest checks first.

The problem's entries are each rank's (layout choice, recomputation) terms (`planner.search.stage_problem` prices
them with `costmodel.estimate.rank_chunk_times` / `rank_tail` and `memory.rank_memory`). Most candidates the branch
and bound hands over cannot beat its incumbent, and most of the price of an entry is its memory and its end-of-step
tail, so they are priced in order of cost, each step able to end the work:

1. the chunk times (cached per rank signature and chunk classes), hence the rank's work per micro-batch D_r, sends
   included;
2. the candidate's bound from each rank's least D_r over the choices that fit in memory
   (`interleaved_problem.least_step_time`; memory priced cheapest work first, until one fits): a candidate whose
   bound reaches the caller's is left out unbuilt, and one with a rank that fits with no choice builds its memory
   alone (what `pricing.least_memory_of` reports);
3. per entry: T >= m D_r for every schedule (`interleaved_problem.least_step_time`, with each D_r at its own
   value), so an entry with m D_r above the bound is left out (the problem is then `pruned`); an entry that does
   not fit in memory gets its memory alone;
4. only the rest pays for the tail (gradient syncs, optimizer step).

Every step leaves out only what cannot beat the caller's bound or cannot fit, so the partition found below the
bound is the one the full problem has (`tests/test_search_bruteforce.py`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from costmodel.memory import ChunkBoundary, PricedSegment, returned_bytes
from costmodel.pipeline import chunk_stages, in_flight_per_chunk, sends_overlap
from costmodel.step_time import DataParallelComm, StageTime
from planner.search.candidates import Candidate
from planner.search.interleaved_layout import InterleavedLayout, RankChoice
from planner.search.interleaved_problem import ChoiceTerms, least_step_time
from planner.search.recompute_choice import NO_RECOMPUTE, RecomputeChoice

if TYPE_CHECKING:
    from costmodel.layer_cost import LayerCost
    from planner.search.stage_problem import RankContext, RankPlacement, StageProblemBuilder


@dataclass
class InterleavedCache:
    """What the interleaved candidates of one search share: each rank's layout choices with their chunks' layer
    classes, and the times of a chunk and of a rank's chunks by rank signature, recomputation and classes.

    A rank's chunk classes (a tuple per chunk) are interned to a small number, `class_ids`, so that the keys of the
    per-entry caches hash fast: tens of thousands of entries are looked up per search."""

    choices: dict[tuple, dict[RankChoice, int]] = field(default_factory=dict)
    class_ids: dict[tuple[tuple[int, ...], ...], int] = field(default_factory=dict)
    classes: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    """The chunk classes of each interned number."""
    chunk_class_times: dict[tuple, tuple[StageTime, DataParallelComm]] = field(default_factory=dict)
    works: dict[tuple, float] = field(default_factory=dict)
    """A rank's chunks' forward + backward seconds by (signature, recomputation, chunk classes' number)."""

    def rank_choices(self, builder: StageProblemBuilder, layout: InterleavedLayout, rank: int
                     ) -> dict[RankChoice, int]:
        """`layout.choices(rank)`, each with the number of its chunks' layer classes, cached (the same layouts come
        back for every candidate of a p and v)."""
        key = (layout.pp, layout.virtual_stages, layout.schedule, rank)
        hit = self.choices.get(key)
        if hit is None:
            classes = [s.class_id for s in builder.chain.segments]
            hit = self.choices[key] = {c: self._intern(tuple(tuple(classes[i] for i in chunk) for chunk in c.chunks))
                                        for c in layout.choices(rank)}
        return hit

    def _intern(self, chunk_classes: tuple[tuple[int, ...], ...]) -> int:
        number = self.class_ids.get(chunk_classes)
        if number is None:
            number = self.class_ids[chunk_classes] = len(self.classes)
            self.classes.append(chunk_classes)
        return number

    def chunk_times(self, builder: StageProblemBuilder, cand: Candidate, ctx: RankContext, rc: RecomputeChoice,
                    classes: tuple[int, ...], segments: Sequence[int], costs: Sequence[LayerCost]
                    ) -> tuple[StageTime, DataParallelComm]:
        """One chunk's time and data-parallel communication, by rank signature and layer classes (cached)."""
        key = (ctx.signature, rc, classes)
        hit = self.chunk_class_times.get(key)
        if hit is None:
            times, comms = builder.chunk_times_of(cand, ctx, [rc.priced([costs[i] for i in segments], classes)])
            hit = self.chunk_class_times[key] = (times[0], comms[0])
        return hit


@dataclass
class ChoicePricer:
    """Prices one interleaved candidate's rank choices for `interleaved_problem`, cheapest checks first (module
    docstring); `pruned` says whether an entry was left out by the bound."""

    builder: StageProblemBuilder
    cand: Candidate
    layout: InterleavedLayout
    placements: tuple[RankPlacement, ...]
    sends: Sequence[float]
    upper_bound: float
    pruned: bool = False
    plain_fits: dict[tuple[int, RankChoice], bool] = field(default_factory=dict)
    least_peaks: dict[int, float] = field(default_factory=dict)
    """Per rank that fits with no choice (`least_work` is inf): its least peak bytes over its choices."""
    least: tuple[float, ...] | None = None
    """Per rank its `least_work`, once every rank's is known and finite (`set_least_work`)."""

    def __post_init__(self) -> None:
        b, cand, p = self.builder, self.cand, self.cand.mesh.pp
        # Tied weights sit on the embedding's and the head's ranks whatever the layout (interleaved_layout).
        copies = b.structure.shared_copies(self.layout.example_stages(), p, cand.schedule)
        self.shared = [-(-x // cand.mesh.tp) for x in copies]
        self.contexts = [b.context(cand, k, pl) for k, pl in enumerate(self.placements)]
        self.rank_classes = [b.interleaved.rank_choices(b, self.layout, k) for k in range(p)]
        self.costs_of = {pl.device.name: b.segment_costs(cand, pl.device) for pl in self.placements}
        self.counts = [in_flight_per_chunk(cand.schedule, p, k, cand.num_microbatches, cand.virtual_stages)
                       for k in range(p)]
        last = len(self.sends)
        # The sends in a rank's work per micro-batch (its D_r); overlapped sends wait only in the fill and drain,
        # not in D_r, so the bounds on D_r leave them out (`interleaved_problem.rank_terms`).
        overlapped = sends_overlap(cand.schedule, cand.runtime.p2p_overlap)
        self.rank_sends = [0.0 if overlapped else
                           sum((self.sends[j - 1] if j > 0 else 0.0) + (self.sends[j] if j < last else 0.0)
                               for j in chunk_stages(cand.schedule, p, cand.virtual_stages, k)) for k in range(p)]

    def choices(self, rank: int) -> Sequence[RankChoice]:
        return tuple(self.rank_classes[rank])

    def _key(self, k: int, choice: RankChoice, rc: RecomputeChoice) -> tuple:
        # Ranks with the same signature and chunks share their terms; only memory depends on the in-flight
        # counts, and affinely. The pipeline buffers depend on the micro-batch count, which the signature fixes
        # only for one global batch.
        return (self.contexts[k].signature, rc, self.rank_classes[k][choice], self.shared[k],
                self.cand.num_microbatches)

    def _chunk_classes(self, k: int, choice: RankChoice) -> tuple[tuple[int, ...], ...]:
        return self.builder.interleaved.classes[self.rank_classes[k][choice]]

    def _times(self, k: int, choice: RankChoice, rc: RecomputeChoice) -> tuple[list[StageTime], list[DataParallelComm]]:
        b, costs = self.builder, self.costs_of[self.placements[k].device.name]
        pairs = [b.interleaved.chunk_times(b, self.cand, self.contexts[k], rc, c, chunk, costs)
                 for c, chunk in zip(self._chunk_classes(k, choice), choice.chunks, strict=True)]
        return [x for x, _ in pairs], [y for _, y in pairs]

    def _segments(self, k: int, choice: RankChoice, rc: RecomputeChoice) -> list[list[PricedSegment]]:
        costs = self.costs_of[self.placements[k].device.name]
        return [rc.priced([costs[i] for i in chunk], chunk_classes)
                for chunk, chunk_classes in zip(choice.chunks, self._chunk_classes(k, choice), strict=True)]

    def _boundaries(self, k: int, choice: RankChoice) -> tuple[ChunkBoundary, ...]:
        """Per chunk of the choice, the activations it receives and sends (`estimate.chunk_boundaries`); () where
        the runtime keeps no pipeline buffers. The rank's class fixes them: only the chunks holding the embedding
        or the head lack a neighbour (the head's returns its logits where the schedule is asked for its outputs),
        and every boundary carries a block's output (`StageProblemBuilder.
        interleaved_sends`; a chunk's indices stand a block for every block)."""
        if not self.cand.runtime.keeps_p2p_buffers(self.cand.mesh.pp):
            return ()
        costs, layout = self.costs_of[self.placements[k].device.name], self.layout
        last = len(costs) - 1

        def received(chunk: tuple[int, ...]) -> int:
            if chunk[0] == 0:
                return 0
            return costs[chunk[0] - 1 if layout.fixed else layout.pre].boundary_bytes

        returns = self.cand.runtime.pp_returns_outputs
        return tuple(ChunkBoundary(received=received(chunk),
                                   sent=costs[chunk[-1]].boundary_bytes if chunk[-1] < last else 0,
                                   returned=returned_bytes(costs[last].loss_elements, self.builder.dtype)
                                   if returns and chunk[-1] == last else 0)
                     for chunk in choice.chunks)

    def _peak(self, k: int, choice: RankChoice, rc: RecomputeChoice) -> float:
        """The rank's peak bytes with the schedule's in-flight micro-batches."""
        b, key = self.builder, self._key(k, choice, rc)
        memory = b.memory_cache.get(key)
        if memory is None:
            segs = self._segments(k, choice, rc)
            memory = b.memory_cache[key] = b.memory_terms(self.cand, self.contexts[k], segs, self.shared[k],
                                                          self._boundaries(k, choice))
        return memory[0] + sum(n * a for n, a in zip(self.counts[k], memory[1], strict=True))

    def least_work(self, k: int, options: Sequence[RecomputeChoice]) -> tuple[float, ...]:
        """Per count e = 0..v of larger chunks, a lower bound on the rank's work D_r (sends included) over its
        choices with e larger chunks that fit in memory: the larger of the least work of any choice that fits and
        the least work of a choice with e (inf where no choice has e; all inf when none fits, and then
        `least_peaks[k]` holds the least peak of them all). Memory is priced cheapest work first, until one fits.
        A partial recomputation enters at its choice's work with no recomputation (a lower bound) and is priced
        only when it comes up, which is only where recomputing nothing does not fit (that entry comes first)."""
        whole = [rc for rc in options if not rc.partial]
        partial = [rc for rc in options if rc.partial] if NO_RECOMPUTE in whole else []
        heap: list[tuple[float, int, bool, RankChoice, RecomputeChoice]] = []
        by_extra = [math.inf] * (self.cand.virtual_stages + 1)
        for c in self.rank_classes[k]:
            works = {rc: self._work(k, c, rc) for rc in whole}
            by_extra[c.extra] = min(by_extra[c.extra], *works.values())
            heap += [(works[rc], len(heap) + i, True, c, rc) for i, rc in enumerate(whole)]
            heap += [(works[NO_RECOMPUTE], len(heap) + i, False, c, rc) for i, rc in enumerate(partial)]
        heapq.heapify(heap)
        capacity = self.placements[k].device.memory_bytes
        least = math.inf
        while heap:
            work, order, exact, c, rc = heapq.heappop(heap)
            if not exact:
                heapq.heappush(heap, (self._work(k, c, rc), order, True, c, rc))
                continue
            peak = self._peak(k, c, rc)
            if peak <= capacity:
                return tuple(max(work, x) + self.rank_sends[k] for x in by_extra)
            least = min(least, peak)
        self.least_peaks[k] = least
        return (math.inf,) * len(by_extra)

    def _plain_fits(self, k: int, choice: RankChoice) -> bool:
        """Whether the choice fits recomputing nothing (cached per rank and choice)."""
        fits = self.plain_fits.get((k, choice))
        if fits is None:
            fits = self.plain_fits[(k, choice)] = (self._peak(k, choice, NO_RECOMPUTE)
                                                   <= self.placements[k].device.memory_bytes)
        return fits

    def _work(self, k: int, choice: RankChoice, rc: RecomputeChoice) -> float:
        """The rank's chunks' forward + backward seconds (cached by signature, recomputation and chunk classes)."""
        b = self.builder
        key = (self.contexts[k].signature, rc, self.rank_classes[k][choice])
        work = b.interleaved.works.get(key)
        if work is None:
            work = b.interleaved.works[key] = sum(x.fwd_s + x.bwd_s for x in self._times(k, choice, rc)[0])
        return work

    def memory_only(self, k: int, choice: RankChoice, rc: RecomputeChoice) -> ChoiceTerms:
        """The choice's peak memory and nothing else: for a candidate that does not fit."""
        zeros = (0.0,) * len(choice.chunks)
        return ChoiceTerms(zeros, zeros, zeros, 0.0, 0.0, 0.0, 0.0, self._peak(k, choice, rc))

    def set_least_work(self, least: Sequence[float]) -> None:
        """Each rank's least work per micro-batch over the choices that fit (the least of `least_work`, all
        finite): an entry is then left out when the step with it and every other rank at its least reaches the
        bound."""
        self.least = tuple(least)

    def _beyond_bound(self, k: int, work: float) -> bool:
        """Whether every partition in which rank k works `work` per micro-batch (sends included) takes longer than
        the bound: `interleaved_problem.least_step_time` with rank k at `work` and the others at their least (or
        m * work alone before those are known). Sets `pruned` when it does."""
        cand = self.cand
        if self.least is None:
            bound = cand.num_microbatches * work
        else:
            others = [x for r, x in enumerate(self.least) if r != k]
            bound = least_step_time(cand.schedule, cand.num_microbatches, cand.virtual_stages, [work, *others])
        if bound > self.upper_bound * (1 + 1e-9):
            self.pruned = True
            return True
        return False

    def price(self, k: int, choice: RankChoice, rc: RecomputeChoice) -> ChoiceTerms | None:
        b, cand = self.builder, self.cand
        if rc.partial:
            # It works at least as long as recomputing nothing, and is offered only where that does not fit.
            if self._beyond_bound(k, self._work(k, choice, NO_RECOMPUTE) + self.rank_sends[k]):
                return None
            if self._plain_fits(k, choice):
                return None
        if self._beyond_bound(k, self._work(k, choice, rc) + self.rank_sends[k]):
            return None
        cache_key = self._key(k, choice, rc)
        t = b.terms.get(cache_key)
        if t is None:
            if self._peak(k, choice, rc) > self.placements[k].device.memory_bytes:
                return self.memory_only(k, choice, rc)
            t = b.terms[cache_key] = b.rank_terms_of(cand, self.contexts[k], self._segments(k, choice, rc),
                                                    self.shared[k], self._times(k, choice, rc),
                                                    b.memory_cache[cache_key])
        peak = t.memory0 + sum(n * a for n, a in zip(self.counts[k], t.chunk_act, strict=True))
        return ChoiceTerms(t.fwd, t.bwd, t.wgrad, t.tail, t.tail_const, t.optimizer, t.post, peak)
