"""The integer problem of intra-operator sharding, and its reference objective.

Nodes pick one option each; flows (tensors) pay for each distinct pair of layouts between their source and their
readers, once per pair (see `costmodel.sharding.layout` for the semantics). `ShardingProblem.objective` evaluates any
assignment directly: the planner's CP-SAT model (`planner.search.intra_op`) must reach the same value, and brute force in
the tests minimizes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

UNITS_PER_SECOND = 10**12
"""The integer problem counts picoseconds: a 1 ns op is 1000 units, a 10 s segment 1e13 (far from int64 limits)."""

FIXED = -1
"""Node index of a value fixed outside the segment (a segment input, or the boundary that reads an output)."""
NO_GRAD = -1


@dataclass(frozen=True, slots=True)
class ProblemFlow:
    """One tensor: who writes it, who reads it, and what each pair of layouts costs (layouts are small ints).

    ``source_layouts[s]`` is the layout the source writes under its option ``s`` (one entry when FIXED);
    ``reader_layouts[r][s]`` what reader ``r`` wants under its option ``s``; ``*_grads`` the same for gradients
    (NO_GRAD where none flows). ``forward`` lists (written, wanted, cost) and ``backward`` (produced, expected,
    cost) for the pairs with a positive cost. ``forbidden`` lists (written, wanted) pairs no node reader may
    realize (FIXED readers, the segment boundary, are exempt).
    """

    source: int
    source_layouts: tuple[int, ...]
    source_grads: tuple[int, ...]
    readers: tuple[int, ...]
    reader_layouts: tuple[tuple[int, ...], ...]
    reader_grads: tuple[tuple[int, ...], ...]
    forward: tuple[tuple[int, int, int], ...]
    backward: tuple[tuple[int, int, int], ...]
    forbidden: tuple[tuple[int, int], ...] = ()

    def _pick(self, node: int, table: Sequence[int], assignment: Sequence[int]) -> int:
        return table[0] if node == FIXED else table[assignment[node]]

    def feasible(self, assignment: Sequence[int]) -> bool:
        a = self._pick(self.source, self.source_layouts, assignment)
        banned = set(self.forbidden)
        return not any((a, self._pick(r, self.reader_layouts[k], assignment)) in banned
                       for k, r in enumerate(self.readers) if r != FIXED)

    def cost(self, assignment: Sequence[int]) -> tuple[int, int]:
        """(forward, backward) cost under an assignment: each distinct layout pair is paid once."""
        a = self._pick(self.source, self.source_layouts, assignment)
        e = self._pick(self.source, self.source_grads, assignment)
        fwd_pairs = {(a, self._pick(r, self.reader_layouts[k], assignment)) for k, r in enumerate(self.readers)}
        bwd_pairs = {(self._pick(r, self.reader_grads[k], assignment), e) for k, r in enumerate(self.readers)}
        fwd = dict(((x, y), c) for x, y, c in self.forward)
        bwd = dict(((x, y), c) for x, y, c in self.backward)
        return (sum(fwd.get(p, 0) for p in fwd_pairs),
                sum(bwd.get(p, 0) for p in bwd_pairs if p[0] != NO_GRAD and p[1] != NO_GRAD))


@dataclass(frozen=True, slots=True)
class ShardingProblem:
    """Choose one option per node to minimize node costs plus flow costs (all non-negative integers)."""

    node_costs: tuple[tuple[int, ...], ...]
    flows: tuple[ProblemFlow, ...]

    def __post_init__(self) -> None:
        for i, costs in enumerate(self.node_costs):
            if not costs:
                raise ValueError(f"node {i} has no option")
            if min(costs) < 0:
                raise ValueError(f"node {i} has a negative cost")
        for f in self.flows:
            if any(c < 0 for *_, c in f.forward + f.backward):
                raise ValueError("flow costs must be non-negative")

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    def feasible(self, assignment: Sequence[int]) -> bool:
        """No flow realizes a forbidden move (the replicated assignment of a built model always is feasible)."""
        return all(f.feasible(assignment) for f in self.flows)

    def objective(self, assignment: Sequence[int]) -> int:
        """Node costs plus flow costs; meaningful for feasible assignments."""
        if len(assignment) != self.num_nodes:
            raise ValueError(f"assignment has {len(assignment)} entries for {self.num_nodes} nodes")
        total = sum(costs[s] for costs, s in zip(self.node_costs, assignment, strict=True))
        return total + sum(sum(f.cost(assignment)) for f in self.flows)


def to_units(seconds: float) -> int:
    return round(seconds * UNITS_PER_SECOND)


