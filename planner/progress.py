"""Progress of a planning call, as records handed to a callback (`planner.api.plan(..., progress=callback)`).

The search reports at most every `planner.search.reporting.INTERVAL_S` seconds and once when it ends, so a
callback may draw on a terminal without slowing the search; the CLI draws them with rich on stderr.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass


class Phase(enum.StrEnum):
    TRACE = "trace"
    """Building and tracing the model (skipped when the trace cache holds it)."""
    PRICE = "price layer classes"
    """Enumerating candidates and pricing their layer classes (the sharding ILP) for their lower bounds."""
    SEARCH = "search meshes"
    """Solving candidates' stage partitions, best lower bound first."""
    DONE = "done"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanProgress:
    """Where a planning call stands."""

    phase: Phase
    elapsed_s: float = 0.0
    """Seconds since the phase's work began (the search's clock for the search phases)."""
    candidates_priced: int = 0
    """Candidates whose stage partition was solved (`SearchInfo.candidates` at the end)."""
    candidates_seen: int = 0
    """Candidates enumerated so far (device counts are expanded lazily, so this grows)."""
    layer_solves: int = 0
    """Layer-class pricings computed (sharding ILP solves for tp > 1)."""
    best: float | None = None
    """The best objective found so far (seconds per step, or cost per step with the cost objective)."""
    lower_bound: float | None = None
    """Proven lower bound on the best objective: nothing unexplored can beat it."""
    objective: str = "time"
    """"time" or "cost": the unit of `best` and `lower_bound`."""

    @property
    def gap(self) -> float | None:
        """Relative gap between the best found and the lower bound (0: proven optimal); None before a plan."""
        if self.best is None or self.lower_bound is None or not self.best > 0:
            return None
        # An infinite bound means nothing is left to explore: the best is optimal.
        lower = min(self.lower_bound, self.best) if math.isfinite(self.lower_bound) else self.best
        return (self.best - lower) / self.best


ProgressCallback = Callable[[PlanProgress], None]
