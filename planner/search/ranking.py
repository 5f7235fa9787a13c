"""Which of the search's best strategies becomes the plan: the simplest of those the model cannot tell apart.

Step times closer than the validated error band (`costmodel.validation`) are ties: a ranking between them would
claim more than the published runs back. Among the strategies tied with the fastest, the plan is the simplest:

0. no offload before an offloaded optimizer before offloaded parameters (the host's memory, link and CPU join the
   step, and `planner.parallelize` runs only the last);
1. fewer parallel dimensions (each of tp, pp, cp, ep above 1 counts; data parallelism is the default use of
   devices and does not);
2. a lower ZeRO stage;
3. fewer micro-batches per step;
4. less recomputation (none < selective < op < full, summed over stages);
5. fewer virtual stages, then a plain schedule before a zero-bubble one (its split backward and deferred weight
   gradients hold activations longer), then no sequence parallelism;
6. then the faster.

The other strategies keep their order by objective after it.

The search proves this choice, not just the fastest plan: with `SearchOptions.tie_band` it keeps solving, past
the K best, every candidate whose bound is within the band of the best and whose `simplicity_floor` could still
beat the simplest tied strategy found so far (`TieSet`), and skips the rest unsolved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from costmodel.breakdown import Estimate
from costmodel.strategy import Offload, Recompute, Strategy
from costmodel.validation import within_band

TIE_LEADS = 4
"""How many of the simplest tied strategies the search hands back beside its K best: `prefer_simplest` re-checks
each against its own estimate's band, which for a plan on part of a mixed cluster can be narrower."""

_RECOMPUTE_WEIGHT = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.OP: 2, Recompute.FULL: 3}
_OFFLOAD_WEIGHT = {Offload.NONE: 0, Offload.OPTIMIZER: 1, Offload.PARAMS: 2}


class Ranked(Protocol):
    strategy: Strategy
    objective: float
    estimate: Estimate


class Solved(Protocol):
    strategy: Strategy
    objective: float


def simplicity_key(strategy: Strategy) -> tuple[float, ...]:
    """Smaller is simpler (module docstring, rules 1-5)."""
    s = strategy
    dims = sum(1 for d in (s.tp, s.pp, s.cp, s.ep) if d > 1)
    recompute = (sum(_RECOMPUTE_WEIGHT[st.recompute] * st.recomputed_share for st in s.stages) if s.stages
                 else _RECOMPUTE_WEIGHT[s.recompute])
    return (_OFFLOAD_WEIGHT[s.runtime.offload], dims, s.zero_stage, s.num_microbatches, recompute, s.virtual_stages, int(s.schedule.zero_bubble),
            int(s.sequence_parallel))


def simplicity_floor(*, tp: int, pp: int, cp: int, ep: int, zero_stage: int, num_microbatches: int,
                     virtual_stages: int = 0, zero_bubble: bool = False,
                     offload: Offload = Offload.NONE) -> tuple[int, ...]:
    """The smallest `simplicity_key` a strategy with these degrees (and, when given, chunks per rank and
    schedule) can have, whatever its recomputation and sequence parallelism (known only once its partition is
    solved)."""
    dims = sum(1 for d in (tp, pp, cp, ep) if d > 1)
    return (_OFFLOAD_WEIGHT[Offload(offload)], dims, zero_stage, num_microbatches, 0, virtual_stages,
            int(zero_bubble), 0)


@dataclass
class TieSet:
    """The solved strategies the search keeps to find the simplest one tied with the best (module docstring).

    A strategy can still lead only if it runs on the best's device count, its bound is within `band` of the best
    and its `simplicity_floor` is not above the simplest tied strategy's key; the search proves the rest only
    for its K best."""

    band: float
    members: list[Solved] = field(default_factory=list)
    _lead: tuple[int, int, tuple[float, ...]] | None = None

    def add(self, solved: Solved) -> None:
        self.members.append(solved)
        self._lead = None

    def tied(self, best: Solved) -> list[Solved]:
        """Members tied with `best` on its device count, simplest first."""
        return sorted(tied_with(best, self.members, self.band), key=_simplest_first)

    def cutoff(self, best: Solved) -> float:
        """Bounds at or above this cannot tie with `best`."""
        return best.objective * (1 + self.band)

    def may_lead(self, best: Solved, num_devices: int, floor: tuple[int, ...] | None) -> bool:
        """Whether a strategy on `num_devices` whose key is at least `floor` (None: not known yet) could become
        the simplest tied one."""
        if num_devices != best.strategy.num_devices:
            return False
        if floor is None:
            return True
        key = (id(best), len(self.members))
        if self._lead is None or self._lead[:2] != key:
            tied = self.tied(best)
            self._lead = (*key, simplicity_key(tied[0].strategy) if tied else (math.inf,))
        return floor <= self._lead[2]


def tied_with(best: Solved, solved: Sequence[Solved], band: float) -> list[Solved]:
    """The strategies of `solved` on `best`'s device count within `band` of its objective (ties)."""
    n = best.strategy.num_devices
    return [s for s in solved if s.strategy.num_devices == n and within_band(s.objective, best.objective, band)]


def _simplest_first(s: Solved) -> tuple:
    return (simplicity_key(s.strategy), s.objective)


def prefer_simplest(ranked: Sequence[Ranked]) -> list[Ranked]:
    """`ranked` (best objective first) reordered so that the simplest strategy tied with the best leads."""
    if not ranked:
        return []
    best = ranked[0]
    lead = min(tied_with(best, ranked, best.estimate.error_band), key=_simplest_first)
    return [lead] + [r for r in ranked if r is not lead]
