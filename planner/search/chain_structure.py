"""What a layer chain's stage candidates share, computed once per chain: the distinct class compositions of the
ranges [a, b) (stages with the same composition have the same terms) and the weights a stage keeps a copy of."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from costmodel.estimate import shared_parameter_copies
from costmodel.strategy import Schedule, StageSpec
from ir.layer_chain import LayerChain

Composition = tuple[tuple[int, ...], int, int, np.ndarray, np.ndarray]
"""(class counts and shared parameters, representative a, b, every a, every b) of one distinct composition."""


@dataclass
class ChainStructure:
    """Class compositions and shared weights of one chain's stage ranges (cached)."""

    chain: LayerChain
    _groups: list[Composition] | None = field(default=None, repr=False)
    _tied: list[tuple[int, np.ndarray, int]] | None = field(default=None, repr=False)
    _shared: dict[tuple, tuple[int, ...]] = field(default_factory=dict, repr=False)

    @cached_property
    def classes(self) -> tuple[int, ...]:
        """Each segment's layer class."""
        return tuple(s.class_id for s in self.chain.segments)

    def compositions(self) -> list[Composition]:
        """(composition, representative a, b, all a's, all b's) for every distinct (multiset of classes in
        [a, b), parameters it shares with earlier segments)."""
        if self._groups is None:
            n = len(self.chain.segments)
            classes = sorted({s.class_id for s in self.chain.segments})
            col = {c: i for i, c in enumerate(classes)}
            counts = np.zeros((n + 1, len(classes)), dtype=np.int64)
            for s in self.chain.segments:
                counts[s.index + 1] = counts[s.index]
                counts[s.index + 1, col[s.class_id]] += 1
            groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
            for a in range(n):
                diff = counts[a + 1:] - counts[a]
                shared = [self.shared_params(a, b) for b in range(a + 1, n + 1)]
                for i, row in enumerate(diff):
                    key = (*(int(x) for x in row), shared[i])
                    groups.setdefault(key, []).append((a, a + 1 + i))
            self._groups = [(key, pairs[0][0], pairs[0][1], np.array([p[0] for p in pairs]),
                             np.array([p[1] for p in pairs])) for key, pairs in groups.items()]
        return self._groups

    def shared_params(self, a: int, b: int) -> int:
        """Parameters used in segments [a, b) whose first use is before a: the copy a stage [a, b) keeps of a
        weight owned by an earlier stage (`costmodel.estimate.shared_parameter_copies` for contiguous stages)."""
        if self._tied is None:
            first: dict[str, int] = {}
            uses: dict[str, set[int]] = {}
            numel: dict[str, int] = {}
            for seg in self.chain.segments:
                for node in self.chain.nodes_of(seg):
                    for name, spec in zip(node.param_names, node.param_specs, strict=False):
                        first.setdefault(name, seg.index)
                        uses.setdefault(name, set()).add(seg.index)
                        numel[name] = spec.numel
            self._tied = [(first[k], np.array(sorted(uses[k])), numel[k]) for k in sorted(uses) if len(uses[k]) > 1]
        total = 0
        for f, used, size in self._tied:
            if f < a and ((used >= a) & (used < b)).any():
                total += size
        return total

    def shared_copies(self, chunks: tuple[StageSpec, ...], pp: int,
                      schedule: Schedule = Schedule.ONE_F_ONE_B) -> tuple[int, ...]:
        """`costmodel.estimate.shared_parameter_copies` of fixed chunks (cached per chunking and placement)."""
        key = (tuple((c.start, c.stop) for c in chunks), pp, schedule.v_shape)
        if key not in self._shared:
            self._shared[key] = shared_parameter_copies(self.chain, chunks, pp, schedule)
        return self._shared[key]
