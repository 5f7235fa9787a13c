"""The branch and bound under a time limit: the schedule families take turns, each best first on its own bounds.

Why: best first over all candidates pops them in order of lower bound, and the bounds of some families are much
weaker than others' (an interleaved candidate's bubble bound shrinks with its chunks, its exact partition does not;
a 1F1B candidate's bound ignores the activations that keep it from fitting). On a large job that order spends a
whole time limit refining and solving candidates of the weak-bound families and returns a plan three times slower
than the one a single family, pinned, finds and proves in seconds (Llama 3.1 405B on 16,384 H100: 19.3 s against
ZB-V's 6.45 s within 45 s).

So with a limit each schedule family keeps its own heap, and once the search has done `PLAIN_WORK` units of work
(`branch_and_bound.WorkUnits`) the family that has used the least work so far goes next, on its smallest bound
(fair-share scheduling, as if the pinned searches ran side by side): a family whose bounds are tight finds its best
plan within its share whatever the others' bounds are, and that plan, as the incumbent, prunes every family. The
device counts and meshes stay in one heap and are expanded as soon as their bound is below that of the family about
to work, so each family sees every candidate that could matter to it, in bound order. Until then the global
smallest bound goes next, exactly as without a limit: a search that small gives the same result either way.

Work, not the clock, is what is shared and what decides the switch: a search that ends within its limit gives the
same result on every run and machine (the clock only decides when a search is cut short).

Every unexplored entry keeps a valid bound in one of the heaps, so the smallest of their tops is a proven lower
bound at any moment: the search stops there when it reaches the cutoff (the result is proven, as without a limit)
and the gap it reports when the limit cuts it short is proven too.

Only with a time limit: without one the search proves the same optimum in any order, but what it explains (the
losing meshes it happened to price) depends on the order, and that result stays exactly as it was.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from costmodel.strategy import Schedule

FIRST_PLAN_FRACTION = 0.5
"""With a time limit, once this fraction of it has passed without any plan, `SearchState.first_plan` looks for one
among the candidates that are cheap to solve, leaving the rest of the limit to improve on it."""

if TYPE_CHECKING:
    from planner.search.branch_and_bound import SearchState
    from planner.search.reporting import SearchReporter

Entry = tuple[float, int, tuple, int]
"""A heap entry of `SearchState.run`: (bound, depth, fixed order, payload)."""

_ORDER = {s: i for i, s in enumerate(Schedule)}


class WorkUnits:
    """Rough relative costs of the search's steps (CPU time on GPT-3 175B x 1,024 A100 and Llama 3.1 405B x 16,384
    H100: a level-1 bound ~0.05 ms, a cached level-2 refinement ~0.25 ms, a sharding solve 25-100 ms (more for
    an MoE layer), a partition solve ~10 ms per 16 segments of the chain): a deterministic stand-in for time, so
    that a search which ends within its time limit gives the same result on any machine (module docstring). Only
    the switch to fair shares and the shares depend on them, never what is proven."""

    BOUND = 0.2
    REFINE = 1.0
    LAYER_SOLVE = 100.0
    VISIT_PER_16_SEGMENTS = 40.0


PLAIN_WORK = 40_000.0
"""Work (`WorkUnits`, about 4 to 10 s of CPU time) done in plain best-first order before the families take turns:
more than the small jobs need to finish (the golden plans take 1,500 to 26,300), so their plans stay exactly those
of the search without a limit."""


@dataclass
class _Queues:
    """The heap of device counts and meshes, and one heap per schedule family, with the work each family has used."""

    counts: list[Entry] = field(default_factory=list)
    families: dict[Schedule, list[Entry]] = field(default_factory=dict)
    used: dict[Schedule, float] = field(default_factory=dict)

    @classmethod
    def of(cls, state: SearchState, heap: list[Entry], used: dict[Schedule, float] | None = None) -> _Queues:
        queues = cls(used=used if used is not None else {})
        for entry in heap:
            queues.push(state, entry)
        return queues

    def push(self, state: SearchState, entry: Entry) -> None:
        if entry[1] <= 1:  # a device count or a mesh: not yet a candidate of one family
            heapq.heappush(self.counts, entry)
            return
        schedule = state.candidates[entry[3]].schedule
        heapq.heappush(self.families.setdefault(schedule, []), entry)
        self.used.setdefault(schedule, 0.0)

    def smallest(self) -> float:
        """The smallest bound of any unexplored entry (inf when none is left)."""
        tops = [q[0][0] for q in (self.counts, *self.families.values()) if q]
        return min(tops, default=math.inf)

    def smallest_queue(self) -> tuple[list[Entry], Schedule | None]:
        """The heap with the smallest bound on top (plain best first) and its family (None: the heap of device
        counts and meshes)."""
        tops = [(q[0], s) for s, q in self.families.items() if q]
        if self.counts:
            tops.append((self.counts[0], None))
        top, family = min(tops, key=lambda t: t[0])
        return (self.counts if family is None else self.families[family]), family

    def next_queue(self, cutoff: float) -> tuple[list[Entry], Schedule | None]:
        """The heap to pop next and the family charged for it: the family that has used the least work among
        those with a bound below `cutoff`, or the device counts and meshes when their smallest bound is below its."""
        live = [s for s, q in self.families.items() if q and q[0][0] < cutoff]
        if not live:
            return self.counts, None
        family = min(live, key=lambda s: (self.used[s], self.families[s][0][0], _ORDER[s]))
        if self.counts and self.counts[0][0] <= self.families[family][0][0]:
            return self.counts, family
        return self.families[family], family

    def merged(self) -> list[Entry]:
        heap = [e for q in (self.counts, *self.families.values()) for e in q]
        heapq.heapify(heap)
        return heap


def fair_share(state: SearchState, heap: list[Entry], skipped: list[Entry],
               report: SearchReporter | None) -> float | None:
    """`SearchState.best_first`'s contract, with the families taking turns (module docstring): None when the
    smallest bound left reaches the cutoff, else the smallest bound when the limit cuts the search short. On
    return `heap` holds every entry left; entries that cannot matter go to `skipped`."""
    queues = _Queues.of(state, heap)
    rushed = False
    try:
        while True:
            if not state.found and not rushed and state.out_of_time(FIRST_PLAN_FRACTION):
                rushed = True  # no plan yet: look among the candidates that are cheap to solve
                merged = queues.merged()
                state.first_plan(merged)
                queues = _Queues.of(state, merged, queues.used)
            lb = queues.smallest()
            if not math.isfinite(lb) or lb >= state.cutoff():
                return None
            if state.stop_for_time(lb):
                return lb if lb < state.target() else None
            fair = state.work >= PLAIN_WORK
            queue, family = queues.next_queue(state.cutoff()) if fair else queues.smallest_queue()
            entry = heapq.heappop(queue)
            if not state.may_matter(entry[0], entry[1], entry[3]):
                skipped.append(entry)
                continue
            out: list[Entry] = []
            work = state.process(entry, out, report)
            if family is not None:
                queues.used[family] += work
            for new in out:
                queues.push(state, new)
    finally:
        heap[:] = queues.merged()
