"""Progress records from a running search (`planner.progress.PlanProgress`), throttled for a terminal."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from planner.progress import Phase, PlanProgress, ProgressCallback

if TYPE_CHECKING:
    from planner.search.branch_and_bound import SearchState

INTERVAL_S = 0.1
"""Least time between two records: the search pops thousands of candidates a second; a display redraws ~10 times."""


class SearchReporter:
    """Calls the search's progress callback with a record of its state, at most every `INTERVAL_S`."""

    def __init__(self, state: SearchState, callback: ProgressCallback) -> None:
        self.state = state
        self.callback = callback
        self.last = -math.inf

    @classmethod
    def of(cls, state: SearchState) -> SearchReporter | None:
        """A reporter for the state's search; None without a progress callback (then nothing is built)."""
        callback = state.options.progress
        return cls(state, callback) if callback is not None else None

    def __call__(self, phase: Phase, lower_bound: float, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < INTERVAL_S:
            return
        self.last = now
        s = self.state
        best = s.found[0].objective if s.found else None
        if best is not None:  # the search keeps the K best: its bound can pass the best while it looks for more
            lower_bound = min(lower_bound, best)
        self.callback(PlanProgress(
            phase=phase, elapsed_s=now - s.started, candidates_priced=s.solved, candidates_seen=len(s.candidates),
            layer_solves=s.builder.table.solves, best=best, lower_bound=lower_bound,
            objective=s.options.objective.value))

    def done(self, lower_bound: float) -> None:
        self(Phase.DONE, lower_bound, force=True)
