"""Which of the search's best strategies becomes the plan: the simplest of those the model cannot tell apart.

Step times closer than the validated error band (`costmodel.validation`) are ties: a ranking between them would
claim more than the published runs back. Among the strategies tied with the fastest, the plan is the simplest:

1. fewer parallel dimensions (each of tp, pp, cp, ep above 1 counts; data parallelism is the default use of
   devices and does not);
2. a lower ZeRO stage;
3. fewer micro-batches per step;
4. less recomputation (none < selective < op < full, summed over stages);
5. fewer virtual stages, then no sequence parallelism;
6. then the faster.

The other strategies keep their order by objective after it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from costmodel.breakdown import Estimate
from costmodel.strategy import Recompute, Strategy
from costmodel.validation import within_band

TIE_POOL = 16
"""How many of the best strategies the search keeps so that the simplest tied one can be chosen."""

_RECOMPUTE_WEIGHT = {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.OP: 2, Recompute.FULL: 3}


class Ranked(Protocol):
    strategy: Strategy
    objective: float
    estimate: Estimate


def simplicity_key(strategy: Strategy) -> tuple[int, ...]:
    """Smaller is simpler (module docstring, rules 1-5)."""
    s = strategy
    dims = sum(1 for d in (s.tp, s.pp, s.cp, s.ep) if d > 1)
    recompute = (sum(_RECOMPUTE_WEIGHT[st.recompute] for st in s.stages) if s.stages
                 else _RECOMPUTE_WEIGHT[s.recompute])
    return (dims, s.zero_stage, s.num_microbatches, recompute, s.virtual_stages, int(s.sequence_parallel))


def prefer_simplest(ranked: Sequence[Ranked]) -> list[Ranked]:
    """`ranked` (best objective first) reordered so that the simplest strategy tied with the best leads."""
    if not ranked:
        return []
    best = ranked[0]
    band = best.estimate.error_band
    tied = [r for r in ranked if within_band(r.objective, best.objective, band)
            and r.strategy.num_devices == best.strategy.num_devices]
    lead = min(tied, key=lambda r: (simplicity_key(r.strategy), r.objective))
    return [lead] + [r for r in ranked if r is not lead]
