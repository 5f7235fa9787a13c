"""What a stage (or an interleaved chunk) may recompute: one mode for all of its segments, or full recomputation of a
share of them.

Partial recomputation is what Megatron-LM runs with `--recompute-method block --recompute-num-layers N` and
torchtitan with `activation_checkpoint.selective_ac_option = "N"`: some layers keep only their input, the others
all of their activations. It pays recomputation only for the bytes a stage has to give up, where full
recomputation of every layer pays it for all of them: memory-bound pipelines (the first stages of a deep 1F1B
pipeline hold p micro-batches) land between "does not fit" and "recompute everything".

Formulation
-----------
A choice (mode, q) with q quarters recomputes, of a chunk's K segments whose full recomputation saves bytes
(`saved_bytes_none > saved_bytes_full`), ceil(q K / 4) with `mode`; the rest keep everything. Which ones: the
largest saving first, then the lower layer class, then the earlier position. The pick depends only on the chunk's
multiset of (saving, class), so every range with the same class composition picks the same classes and the
search's price of one composition (`planner.search.stage_problem`) holds for all of them; decoding a solved
partition picks the same way over the real range and records the segments (`StageSpec.recomputed`).
Per chunk, time is additive in the segments and memory affine in the in-flight micro-batches, as for a whole-stage
mode, so the choices are more options of the same partition problem.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from costmodel.layer_cost import LayerCost
from costmodel.memory import PricedSegment, runs, uniform_runs
from costmodel.strategy import Recompute, StageSpec

PARTIAL_QUARTERS = (1, 2, 3)
"""Shares of a chunk's layers that partial recomputation may recompute, in quarters."""
_WHOLE = 4


@dataclass(frozen=True, slots=True)
class RecomputeChoice:
    """`mode` on `quarters`/4 of a chunk's recomputable segments (4: all of its segments, as a plain mode)."""

    mode: Recompute
    quarters: int = _WHOLE
    _hash: int = field(init=False, repr=False, compare=False)
    """The hash, computed once: choices key the search's caches, looked up millions of times per plan."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Recompute(self.mode))
        if not 1 <= self.quarters <= _WHOLE:
            raise ValueError(f"a recompute share is 1..4 quarters, got {self.quarters}")
        object.__setattr__(self, "_hash", hash((self.mode, self.quarters)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def partial(self) -> bool:
        return self.quarters < _WHOLE

    @property
    def value(self) -> str:
        """The option's name in a partition problem: the mode, or "mode:q/4"."""
        return self.mode.value if not self.partial else f"{self.mode.value}:{self.quarters}/4"

    @classmethod
    def parse(cls, name: str) -> RecomputeChoice:
        mode, _, share = name.partition(":")
        return cls(Recompute(mode), int(share.partition("/")[0]) if share else _WHOLE)

    def picked(self, costs: Sequence[LayerCost], classes: Sequence[int]) -> frozenset[int]:
        """Positions (in the given lists) of the segments that run `mode` (the module docstring's rule)."""
        if not self.partial:
            return frozenset(range(len(costs)))
        keys = sorted((-(c.saved_bytes_none - c.saved_bytes_full), cls, pos)
                      for pos, (c, cls) in enumerate(zip(costs, classes, strict=True))
                      if c.saved_bytes_none > c.saved_bytes_full)
        return frozenset(pos for _, _, pos in keys[:math.ceil(self.quarters * len(keys) / _WHOLE)])

    def priced(self, costs: Sequence[LayerCost], classes: Sequence[int]) -> list[PricedSegment]:
        """The chunk's segments with their recomputation, runs of identical ones merged (`memory.runs`)."""
        if not self.partial:
            return uniform_runs(costs, self.mode)
        chosen = self.picked(costs, classes)
        return runs([PricedSegment(c, self.mode if pos in chosen else Recompute.NONE) for pos, c in enumerate(costs)])

    def spec(self, start: int, stop: int, costs: Sequence[LayerCost], classes: Sequence[int]) -> StageSpec:
        """The `StageSpec` of chain segments [start, stop) (`costs` and `classes` indexed by chain segment)."""
        if not self.partial:
            return StageSpec(start, stop, self.mode)
        chosen = self.picked(costs[start:stop], classes[start:stop])
        return StageSpec(start, stop, self.mode, recomputed=tuple(start + pos for pos in sorted(chosen)))


_CHOICES = {(mode, q): RecomputeChoice(mode, q) for mode in Recompute for q in (*PARTIAL_QUARTERS, _WHOLE)}
"""One instance per choice, which the search hands out (`search_choices`): its cache lookups then match by
identity, before any comparison."""

NO_RECOMPUTE = _CHOICES[(Recompute.NONE, _WHOLE)]
"""Recomputing nothing: partial recomputation is offered only where this does not fit."""


def search_choices(options: Sequence[Recompute], partial: bool) -> tuple[RecomputeChoice, ...]:
    """The choices of a search over `options`; with `partial`, full recomputation of each share of
    `PARTIAL_QUARTERS` too (when full recomputation is an option)."""
    whole = tuple(_CHOICES[(Recompute(o), _WHOLE)] for o in options)
    if not partial or Recompute.FULL not in options:
        return whole
    return whole + tuple(_CHOICES[(Recompute.FULL, q)] for q in PARTIAL_QUARTERS)
