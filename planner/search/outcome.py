"""What a search is asked for and what it gives back: the options of one search (`SearchOptions`), each plan it
ranks (`RankedStrategy`), its result (`SearchResult`), and what the branch and bound
(`planner.search.branch_and_bound`) records of each solved candidate (`Found`) and each mesh (`MeshRecord`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from costmodel.breakdown import Estimate
from costmodel.layer_cost import LayerCost
from costmodel.strategy import Strategy
from planner.plan import Alternative, ModuleSharding
from planner.progress import ProgressCallback
from planner.search.candidates import Candidate
from planner.search.space import Objective

DEFAULT_RELATIVE_GAP = 0.01
"""The gap a plan is proven within unless the caller asks for another: a third of the smallest step-time error band
of the catalog's validated GPUs (H100 +-2.9%, A100 +-5.3%: `DeviceSpec.prediction_error`), so that a plan it may
miss is a tie by the model's own account (bench/search.py: 30% fewer candidates priced for GPT-3 175B on 1024 A100)."""


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    objective: Objective = Objective.TIME
    top_k: int = 1
    """How many distinct strategies (different candidates) to return, best first."""
    time_limit_s: float | None = None
    """Stop after this many seconds of search with the best found so far (status "feasible"). The limit is checked
    between heap entries and between the meshes of an expansion; if it passes before any plan is found, the
    search stops at the first one, or with a `TimeLimitError` when none is found within
    `branch_and_bound.NO_PLAN_GRACE_S` more."""
    progress: ProgressCallback | None = None
    """Called with a `planner.progress.PlanProgress` record, at most every `reporting.INTERVAL_S` and at the end."""
    num_alternatives: int = 8
    """How many losing meshes (distinct dp, tp, pp) to explain in `alternatives`."""
    explain_slack: float = 0.1
    """Losing meshes within this fraction of the best are priced exactly for `alternatives` (the others get
    their lower bound); it never changes the chosen plans, only how much work goes into explaining them."""
    relative_gap: float = 0.0
    """Stop once the K best are proven within this fraction of the optimum of the space (no bound left below the
    K-th best over 1 + gap); 0 proves them optimal. The front doors (`planner.api`, the CLI, the scenarios) use
    `DEFAULT_RELATIVE_GAP`."""
    tie_band: float | None = None
    """Beyond the K best, also solve every candidate that could be the simplest strategy within this relative band
    of the best (`planner.search.ranking.TieSet`) and return the simplest tied ones; None: the K best only."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective(self.objective))
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top must be a positive integer, got {self.top_k!r}")
        if self.time_limit_s is not None and not 0 < self.time_limit_s < math.inf:
            raise ValueError(f"time limit must be a positive number of seconds, got {self.time_limit_s!r}")
        if not 0 <= self.relative_gap < 1:
            raise ValueError(f"relative gap must be a fraction in [0, 1), got {self.relative_gap!r}")
        if self.tie_band is not None and not 0 <= self.tie_band < math.inf:
            raise ValueError(f"tie band must be a non-negative fraction, got {self.tie_band!r}")

    @classmethod
    def for_users(cls, **changes: Any) -> SearchOptions:
        """The options of a search a user asked for (the API, the CLI, the scenarios): `DEFAULT_RELATIVE_GAP`
        unless `changes` say otherwise; `search()` itself stays exact by default."""
        return cls(**{"relative_gap": DEFAULT_RELATIVE_GAP, **changes})


@dataclass(frozen=True)
class RankedStrategy:
    """One of the best strategies: what the search predicted and what `costmodel.estimate` says."""

    candidate: Candidate
    strategy: Strategy
    objective: float
    """Search objective (seconds, or cost per step) of this strategy."""
    predicted_step_time_s: float
    """The partition DP's step time (equals estimate.step_time_s up to float summation order)."""
    estimate: Estimate
    sharding: tuple[ModuleSharding, ...]
    layer_costs: Mapping[tuple[int, str], LayerCost]


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[RankedStrategy, ...]
    alternatives: tuple[Alternative, ...]
    status: str
    """"optimal" (the space was exhausted or pruned by bounds) or "feasible" (cut short by the time limit)."""
    cut_short: bool
    lower_bound: float
    """Proven lower bound on the best objective (objective units)."""
    optimality_gap: float
    candidates: int
    """Candidates whose stage partition was solved."""
    pruned: int
    """Candidates skipped by a lower bound (never priced)."""
    layer_solves: int
    """Layer-class pricings (intra-op ILP solves for tp > 1) actually computed."""
    time_s: float

    @property
    def best(self) -> RankedStrategy:
        return self.ranked[0]

    @property
    def fastest(self) -> float:
        """The least objective among the ranked strategies (the best's, unless a tie made a simpler one best)."""
        return min(r.objective for r in self.ranked)


@dataclass(order=True)
class Found:
    objective: float
    order: int
    candidate: Candidate = field(compare=False)
    step_time_s: float = field(compare=False)
    strategy: Strategy = field(compare=False)


@dataclass
class MeshRecord:
    """What happened to one (dp, tp, pp): its best solved candidate, or why none was."""

    best: Found | None = None
    lower_bound: float = math.inf
    memory_need_bytes: float = math.inf
    beyond_slack: bool = False
    """Its partition was solved but nothing came within `explain_slack` of the best."""
