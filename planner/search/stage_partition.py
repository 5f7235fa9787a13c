"""The inner search: cut the layer chain into pipeline stages and pick each stage's recomputation, exactly.

Formulation
-----------
Segments ``0 .. L-1`` (the layer chain) are split into ``p`` contiguous, non-empty stages
``[a_0, b_0), [a_1, b_1), ...`` with ``a_0 = 0``, ``a_{k+1} = b_k``, ``b_{p-1} = L``; stage ``k`` also picks an
option ``r_k`` (a recomputation mode: none / selective / full, or any subset of them).

A stage contributes a vector of *additive* terms ``s(k, r, a, b)`` (e.g. its forward + backward time) and a vector
of *bottleneck* terms ``u(k, r, a, b)`` (e.g. its per-micro-batch time, its exposed gradient-sync tail); the
step time is

    T = Phi(sum_k s(k, r_k, a_k, b_k),  max_k u(k, r_k, a_k, b_k))

for a caller-supplied ``Phi`` that is non-decreasing in every argument (for 1F1B / GPipe,
``Phi(S, U) = S + (m - 1) U_0 + U_1``: Narayanan et al., SC'21, with the slowest stage setting the steady state).
Terms depend on the stage index only through its *profile* ``profile[k]``: usually its kind (first / middle /
last / only), because the first and last stages differ (no receive before the first, no send after the last),
and on mixed clusters also the device type and speed of the ranks that run it.

Drain tails (the end-of-step gradient reduction of `costmodel.step_time.step_breakdown`): stage ``k`` may also
have a tail ``e(k, r, a, b)`` that hides in the pipeline drain behind it, whose length is the running sum
``P_k = sum_{i<k} d(i, r_i, a_i, b_i)`` of the earlier stages' drain terms ``d``; its exposed part
``max(e - P_k, 0) + c(k, r, a, b)`` (``c``: a part no drain hides) joins the maxima as one more coordinate
(the last). Labels then also carry ``P``, and a label
dominates another only if its ``P`` is at least as large (a longer drain hides more of every later tail).

Where Phi is linear, ``Phi(S, U) = w_S . S + w_U . U`` with non-negative weights (`PartitionProblem.weights`, every
pipeline objective of the search), a label A also drops a label B of the same state when every completion of A is
strictly better than B's: for any completion, ``Phi(A + c) - Phi(B + c) <= w_S . (S_A - S_B) + sum_j w_U,j
max(U_A,j - U_B,j, 0) + w_T max(T_A - T_B, P_B - P_A, 0)`` (a max moves by at most the difference of its
arguments; a drain shorter by d exposes at most d more of every later tail), and that is below 0 -- or is 0 (up
to rounding) and A came first, so that ties keep the earlier label. Labels that trade a longer sum for a longer
drain, or differ in a small term by less than they gain elsewhere, then no longer multiply: on pipelines whose
ranks run at different speeds the fronts otherwise hold thousands of labels on such a plateau (a straggler's
16-stage 1F1B pipeline of GPT-3 175B: 246K labels and 15 s, then 0.3 s). The optimum is the same; among tied
partitions the one kept can differ from what coordinatewise dominance alone keeps.

Memory: stage ``k`` fits when ``base(r, a, b) + inflight[k] * act(r, a, b) <= capacity[k]``, where ``base`` holds
weights, gradients, optimizer state, temporaries and overhead, ``act`` the activations one micro-batch saves, and
``inflight[k]`` the micro-batches the schedule keeps alive on stage ``k`` (GPipe: m; 1F1B: min(p - k, m)).

Algorithm: a label-setting dynamic program over states ``(j, k)`` = "segments ``[0, j)`` cut into ``k`` stages".
A label is ``(S, U, P)`` (partial sums, maxima, drain); a label is dropped when another label of the same state is
no worse in every coordinate (Pareto dominance, exact because Phi is monotone), or when a lower bound on every
completion, ``Phi(S + h[k][j], max(U, g[k][j]))``, is no better than the incumbent (future exposed tails are
bounded below by 0). ``h[k][j]`` (least remaining
sum) and ``g[k][j]`` (least remaining maximum, per coordinate) come from two suffix dynamic programs over the same
feasibility, so the bound is valid. The incumbent starts from the min-max (bottleneck) partition. The result is
the exact optimum of ``Phi`` over all partitions and options (tested against brute force); among ties a given
`PartitionProblem.preferred` partition wins, then the first found in the fixed visiting order (stages left to
right, shorter stages first, options in the given order).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


class StageKind(enum.IntEnum):
    """Where a stage sits in the pipeline; stage terms may differ by kind (first/last carry no recv/send)."""

    FIRST = 0
    MIDDLE = 1
    LAST = 2
    ONLY = 3


def stage_kind(k: int, num_stages: int) -> StageKind:
    if num_stages == 1:
        return StageKind.ONLY
    if k == 0:
        return StageKind.FIRST
    if k == num_stages - 1:
        return StageKind.LAST
    return StageKind.MIDDLE


Objective = Callable[[Sequence[float], Sequence[float]], float]
"""Phi(sums, maxima) -> step time; must be non-decreasing in every argument."""


@dataclass(frozen=True, kw_only=True)
class PartitionProblem:
    """Arrays over stage candidates. ``L`` segments, ``R`` options, ``NS`` additive terms, ``NU`` bottleneck terms.

    ``additive[q]`` has shape (R, L+1, L+1, NS) and ``bottleneck[q]`` (R, L+1, L+1, NU) for stage profile q: entry
    ``[r, a, b]`` is the stage ``[a, b)`` with option r (entries with ``b <= a`` are ignored). ``memory_base[q]`` and
    ``memory_per_microbatch[q]`` have shape (R, L+1, L+1); ``stage_profile``, ``in_flight`` and ``capacity`` have
    one entry per stage.
    """

    num_segments: int
    num_stages: int
    options: tuple[str, ...]
    additive: tuple[np.ndarray, ...]
    bottleneck: tuple[np.ndarray, ...]
    memory_base: tuple[np.ndarray, ...]
    memory_per_microbatch: tuple[np.ndarray, ...]
    stage_profile: tuple[int, ...]
    in_flight: tuple[int, ...]
    capacity: tuple[float, ...]
    objective: Objective
    tail: tuple[np.ndarray, ...] | None = None
    """Per profile (R, L+1, L+1): the stage's end-of-step tail e (see module docstring); None: no tail term."""
    drain: tuple[np.ndarray, ...] | None = None
    """Per profile (R, L+1, L+1): what the stage adds to the drain of the stages after it."""
    tail_const: tuple[np.ndarray, ...] | None = None
    """Per profile (R, L+1, L+1): the part c of the stage's tail that no drain hides (None: zero)."""
    preferred: tuple[StageChoice, ...] | None = None
    """A partition that wins ties: the solver takes it as its first incumbent (when it fits), so another partition
    replaces it only with a strictly smaller objective."""
    weights: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    """(w_S, w_U) when ``objective`` is linear, ``Phi(S, U) = w_S . S + w_U . U`` (U with the tail last when there is
    one), weights >= 0: labels are then also compared by what they can still gain (module docstring). Checked
    against ``objective`` at two points."""

    @property
    def has_tail(self) -> bool:
        return self.tail is not None

    def __post_init__(self) -> None:
        n, p, r = self.num_segments, self.num_stages, len(self.options)
        if not 1 <= p <= n:
            raise ValueError(f"cannot cut {n} segments into {p} non-empty stages")
        if not len(self.stage_profile) == len(self.in_flight) == len(self.capacity) == p:
            raise ValueError(f"stage_profile, in_flight and capacity need {p} entries each")
        q = len(self.additive)
        if not len(self.bottleneck) == len(self.memory_base) == len(self.memory_per_microbatch) == q or not all(0 <= x < q for x in self.stage_profile):
            raise ValueError(f"additive, bottleneck, memory_base and memory_per_microbatch need one array per profile; profiles used: {self.stage_profile}")
        if (self.tail is None) != (self.drain is None):
            raise ValueError("tail and drain go together")
        extra = (*self.tail, *self.drain) if self.tail is not None and self.drain is not None else ()
        if self.tail_const is not None:
            if not extra:
                raise ValueError("tail_const needs tail and drain")
            extra = (*extra, *self.tail_const)
        if extra and len(extra) != (3 if self.tail_const is not None else 2) * q:
            raise ValueError("tail and drain need one array per profile")
        for arr in (*self.additive, *self.bottleneck, *self.memory_base, *self.memory_per_microbatch, *extra):
            if arr.shape[:3] != (r, n + 1, n + 1):
                raise ValueError(f"array shape {arr.shape[:3]} != {(r, n + 1, n + 1)}")
        if self.weights is not None:
            self._check_weights()

    def _check_weights(self) -> None:
        ns, nu = self.additive[0].shape[3], self.bottleneck[0].shape[3] + self.has_tail
        ws, wu = self.weights
        if len(ws) != ns or len(wu) != nu or min((*ws, *wu)) < 0:
            raise ValueError(f"weights need {ns} + {nu} non-negative entries, got {len(ws)} + {len(wu)}")
        for s, u in (([1.0] * ns, [1.0] * nu), ([0.5 + i for i in range(ns)], [2.0 + 3 * i for i in range(nu)])):
            linear = sum(w * x for w, x in zip(ws, s, strict=True)) + sum(w * x for w, x in zip(wu, u, strict=True))
            if not math.isclose(float(self.objective(s, u)), linear, rel_tol=1e-9):
                raise ValueError("weights do not match the objective")

    def fits(self, k: int) -> np.ndarray:
        """Boolean (R, L+1, L+1): which stage candidates fit in memory at stage index k."""
        q = self.stage_profile[k]
        return self.memory_base[q] + self.in_flight[k] * self.memory_per_microbatch[q] <= self.capacity[k]


@dataclass(frozen=True, slots=True)
class StageChoice:
    start: int
    stop: int
    option: str


@dataclass(frozen=True, slots=True)
class Partition:
    stages: tuple[StageChoice, ...]
    objective: float
    sums: tuple[float, ...]
    maxes: tuple[float, ...]
    labels_created: int
    """Labels the dynamic program created (a measure of work; deterministic)."""


@dataclass(frozen=True, slots=True)
class _Label:
    sums: tuple[float, ...]
    maxes: tuple[float, ...]
    drain: float
    parent: _Label | None
    choice: StageChoice | None


def _valid_mask(problem: PartitionProblem, k: int) -> np.ndarray:
    """(R, L+1, L+1) mask of candidates usable as stage k: non-empty, leaves room for the later stages, fits."""
    n, p = problem.num_segments, problem.num_stages
    a = np.arange(n + 1)[:, None]
    b = np.arange(n + 1)[None, :]
    # Stage k starts at >= k and must leave p-1-k segments for the stages after it; the last stage ends at n.
    shape_ok = (b > a) & (a >= k) & (b <= n - (p - 1 - k))
    if k == p - 1:
        shape_ok &= b == n
    if k == 0:
        shape_ok &= a == 0
    return shape_ok[None, :, :] & problem.fits(k)


def _suffix_bounds(problem: PartitionProblem, masks: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """h[k, j, i]: least sum of additive term i over stages k.. covering [j, L); g[k, j, i]: least max of term i.

    Each coordinate is minimized on its own, so each is a valid lower bound on every completion. The exposed
    drain tail (when present) is bounded below by 0 and is not part of g."""
    n, p = problem.num_segments, problem.num_stages
    ns = problem.additive[0].shape[3]
    nu = problem.bottleneck[0].shape[3]
    h = np.full((p + 1, n + 1, ns), np.inf)
    g = np.full((p + 1, n + 1, nu), np.inf)
    h[p, n, :] = 0.0
    g[p, n, :] = -np.inf
    for k in range(p - 1, -1, -1):
        q = problem.stage_profile[k]
        mask = masks[k][:, :, :, None]
        # The least over the options first: h and g do not depend on the option, and adding or taking the larger
        # with the same value is monotone, so the minima are the same numbers at a fraction of the work.
        s = np.where(mask, problem.additive[q], np.inf).min(axis=0)      # (a, b, NS)
        u = np.where(mask, problem.bottleneck[q], np.inf).min(axis=0)
        h[k] = np.min(s + h[k + 1][None, :, :], axis=1)
        g[k] = np.min(np.maximum(u, g[k + 1][None, :, :]), axis=1)
    return h, g


def _bottleneck_partition(problem: PartitionProblem, masks: list[np.ndarray]) -> list[StageChoice] | None:
    """A feasible partition minimizing the first bottleneck term then the first sum (the incumbent's seed)."""
    n, p = problem.num_segments, problem.num_stages
    best = np.full((p + 1, n + 1), np.inf)
    best_sum = np.full((p + 1, n + 1), np.inf)
    arg: dict[tuple[int, int], tuple[int, int]] = {}
    best[p, n] = -np.inf
    best_sum[p, n] = 0.0
    for k in range(p - 1, -1, -1):
        q = problem.stage_profile[k]
        mask = masks[k]                                                   # (R, a, b)
        cand_u = np.where(mask, np.maximum(problem.bottleneck[q][..., 0], best[k + 1][None, None, :]), np.inf)
        cand_s = np.where(mask, problem.additive[q][..., 0] + best_sum[k + 1][None, None, :], np.inf)
        flat_u = cand_u.transpose(1, 0, 2).reshape(n + 1, -1)             # (a, R*b), flat index r*(n+1)+b
        flat_s = cand_s.transpose(1, 0, 2).reshape(n + 1, -1)
        min_u = flat_u.min(axis=1)
        tie_s = np.where(flat_u == min_u[:, None], flat_s, np.inf)
        min_s = tie_s.min(axis=1)
        first = np.argmax((flat_u == min_u[:, None]) & (tie_s == min_s[:, None]), axis=1)
        for a in np.nonzero(np.isfinite(min_u))[0]:
            r, b = divmod(int(first[a]), n + 1)
            best[k, a], best_sum[k, a] = min_u[a], min_s[a]
            arg[(k, int(a))] = (r, b)
    if not np.isfinite(best[0, 0]):
        return None
    stages, a = [], 0
    for k in range(p):
        r, b = arg[(k, a)]
        stages.append(StageChoice(a, b, problem.options[r]))
        a = b
    return stages


def evaluate(problem: PartitionProblem, stages: Sequence[StageChoice]
             ) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """Phi of a given partition (inf when a stage does not fit), with its sums and maxima (tail last)."""
    ns = problem.additive[0].shape[3]
    nu = problem.bottleneck[0].shape[3]
    sums, maxes = [0.0] * ns, [-math.inf] * nu
    tail, drain = 0.0, 0.0
    for k, st in enumerate(stages):
        r = problem.options.index(st.option)
        if not problem.fits(k)[r, st.start, st.stop]:
            return math.inf, tuple(sums), tuple(maxes)
        q = problem.stage_profile[k]
        sums = [x + float(y) for x, y in zip(sums, problem.additive[q][r, st.start, st.stop], strict=True)]
        maxes = [max(x, float(y)) for x, y in zip(maxes, problem.bottleneck[q][r, st.start, st.stop], strict=True)]
        if problem.tail is not None and problem.drain is not None:
            const = float(problem.tail_const[q][r, st.start, st.stop]) if problem.tail_const is not None else 0.0
            tail = max(tail, max(float(problem.tail[q][r, st.start, st.stop]) - drain, 0.0) + const)
            drain += float(problem.drain[q][r, st.start, st.stop])
    if problem.has_tail:
        maxes.append(tail)
    return float(problem.objective(sums, maxes)), tuple(sums), tuple(maxes)


class _Front:
    """A Pareto front of labels, none dominating another, in the order they were added. Label a dominates b when
    a.drain >= b.drain and a's sums and maxes are each <= b's: its key (-drain, sums, maxes) is <= b's in every
    entry; with linear weights also when a's every completion is strictly better (module docstring). The keys are
    kept as one array, so a check against the whole front is one comparison (fronts of pipelines whose ranks
    differ in speed hold hundreds of labels)."""

    __slots__ = ("keys", "labels", "gain")

    def __init__(self, gain: _Gain | None = None) -> None:
        self.labels: list[_Label] = []
        self.keys = np.empty((0, 0))
        self.gain = gain

    def insert(self, label: _Label) -> bool:
        """Add `label` unless a label of the front dominates it; drop the labels it dominates. Returns whether it
        was added."""
        key = np.array((-label.drain, *label.sums, *label.maxes))
        if self.labels:
            if (self.keys <= key).all(axis=1).any():
                return False
            if self.gain is not None and self.gain.beats(self.keys, key, ties=True).any():
                return False
            keep = ~(key <= self.keys).all(axis=1)
            if self.gain is not None:
                keep &= ~self.gain.beats(key, self.keys, ties=False)
            if not keep.all():
                self.keys = self.keys[keep]
                self.labels = [o for o, k in zip(self.labels, keep, strict=True) if k]
            self.keys = np.vstack((self.keys, key))
        else:
            self.keys = key[None, :]
        self.labels.append(label)
        return True


@dataclass(frozen=True)
class _Gain:
    """The weighted dominance test of the module docstring over the keys (-drain, sums, maxes[, tail]) of labels
    with the same stages still to place: `future_tail` and `future_const` are the largest tail e and unhidden part
    c among those stages, so none of them exposes more than max(e - P, 0) + c beyond a label's drain P."""

    sums: np.ndarray
    maxes: np.ndarray
    tail: float
    has_tail: bool
    future_tail: float = 0.0
    future_const: float = 0.0

    @classmethod
    def per_stage(cls, problem: PartitionProblem, masks: Sequence[np.ndarray]) -> list[_Gain] | None:
        """Per number k of stages placed, the test for labels with stages k.. still to place (None: no weights)."""
        if problem.weights is None:
            return None
        ws, wu = np.array(problem.weights[0], dtype=float), np.array(problem.weights[1], dtype=float)
        if not problem.has_tail or problem.tail is None:
            return [cls(ws, wu, 0.0, False)] * (problem.num_stages + 1)
        out, tail, const = [], -math.inf, 0.0
        for k in range(problem.num_stages, -1, -1):
            out.append(cls(ws, wu[:-1], float(wu[-1]), True, max(tail, 0.0), const))
            if k > 0:
                q, valid = problem.stage_profile[k - 1], masks[k - 1]
                if valid.any():
                    tail = max(tail, float(problem.tail[q][valid].max()))
                    if problem.tail_const is not None:
                        const = max(const, float(problem.tail_const[q][valid].max()))
        return out[::-1]

    def beats(self, a: np.ndarray, b: np.ndarray, *, ties: bool) -> np.ndarray:
        """Whether every completion of key(s) `a` is better than the same completion of key(s) `b`: strictly, or
        with `ties` also as good (beyond rounding either way).

        The tail term: a's later exposed tails exceed b's by at most b's extra drain, and are at most `exposed`
        beyond a's drain, so a's tail maximum exceeds b's by at most max(T_a - T_b, min(P_b - P_a, F_a - T_b), 0)
        with F_a = max(e - P_a, 0) + c."""
        d = a - b
        ns, nu = len(self.sums), len(self.maxes)
        gain = d[..., 1:1 + ns] @ self.sums + np.maximum(d[..., 1 + ns:1 + ns + nu], 0.0) @ self.maxes
        if self.has_tail:
            later = np.maximum(self.future_tail + a[..., 0], 0.0) + self.future_const  # a[0] = -P_a
            shortfall = np.minimum(d[..., 0], later - b[..., -1])
            gain = gain + self.tail * np.maximum(np.maximum(d[..., -1], shortfall), 0.0)
        scale = 1e-12 * (1.0 + np.abs(a[..., 1:1 + ns]) @ self.sums + np.abs(b[..., 1:1 + ns]) @ self.sums)
        return gain <= scale if ties else gain < -scale


def partition_lower_bound(problem: PartitionProblem) -> float:
    """A lower bound on the optimum (inf when nothing fits): Phi of the suffix bounds at the root."""
    masks = [_valid_mask(problem, k) for k in range(problem.num_stages)]
    h, g = _suffix_bounds(problem, masks)
    if not np.isfinite(h[0, 0]).all():
        return math.inf
    maxes = list(g[0, 0]) + ([0.0] if problem.has_tail else [])
    return float(problem.objective(list(h[0, 0]), maxes))


def solve_partition(problem: PartitionProblem, *, upper_bound: float = math.inf) -> Partition | None:
    """The exact optimum of the formulation in the module docstring, or None when nothing fits (or nothing beats
    `upper_bound`, a known objective value the caller only wants to improve on).

    `problem.objective` is also called with numpy arrays (one entry per candidate) in place of floats, so it must
    use only elementwise operations (+, -, *, /, np.maximum)."""
    return solve_partition_until(problem, upper_bound=upper_bound)[0]


CLOCK_EVERY_LABELS = 256
"""How many labels `solve_partition_until` expands between looks at the clock."""


def solve_partition_until(problem: PartitionProblem, *, upper_bound: float = math.inf,
                          deadline: float | None = None) -> tuple[Partition | None, bool]:
    """`solve_partition`, stopped at `deadline` (`time.monotonic()` seconds) if it has not finished: then the best
    partition found so far (the bottleneck seed at least, when it beats `upper_bound`) and False -- not proven
    optimal. (result, True) when the dynamic program ran to the end."""
    masks = [_valid_mask(problem, k) for k in range(problem.num_stages)]
    h, g = _suffix_bounds(problem, masks)
    if not np.isfinite(h[0, 0]).all():
        return None, True
    search = _LabelSearch(problem, upper_bound, masks)
    if problem.preferred is not None:
        search.offer(evaluate(problem, problem.preferred)[0], list(problem.preferred))
    seed = _bottleneck_partition(problem, masks)
    if seed is not None:
        search.offer(evaluate(problem, seed)[0], seed)
    proven = _expand_all(search, masks, h, g, deadline)
    if search.incumbent is None:
        return None, proven
    exact, sums, maxes = evaluate(problem, search.incumbent)
    return Partition(tuple(search.incumbent), exact, sums, maxes, search.created), proven


def _expand_all(search: _LabelSearch, masks: Sequence[np.ndarray], h: np.ndarray, g: np.ndarray,
                deadline: float | None) -> bool:
    """Run the label-setting DP over every (stage, segment) front in order; False when `deadline` stopped it."""
    problem = search.problem
    expanded = 0
    for k in range(problem.num_stages):
        for a in range(problem.num_segments):
            front = search.fronts.pop((a, k), None)
            if front is None or not front.labels:
                continue
            stages = _NextStages.of(problem, masks, h, g, k, a)
            for label in front.labels:
                expanded += 1
                if deadline is not None and expanded % CLOCK_EVERY_LABELS == 0 and time.monotonic() > deadline:
                    return False
                search.extend(label, stages, last=k + 1 == problem.num_stages)
    return True


@dataclass(frozen=True, slots=True)
class _NextStages:
    """The stages that may follow a label at (segment `a`, stage `k`), in visiting order (shorter stages first,
    then options in the given order), with their terms and the least that any completion after them adds."""

    k: int
    a: int
    options: np.ndarray
    stops: np.ndarray
    sums: np.ndarray          # (C, NS)
    maxes: np.ndarray         # (C, NU)
    rest_sums: np.ndarray     # (C, NS): h[k + 1, stop]
    rest_maxes: np.ndarray    # (C, NU): g[k + 1, stop]
    tail: np.ndarray | None
    drain: np.ndarray | None
    tail_const: np.ndarray | float

    @classmethod
    def of(cls, problem: PartitionProblem, masks: Sequence[np.ndarray], h: np.ndarray, g: np.ndarray, k: int,
           a: int) -> _NextStages:
        q = problem.stage_profile[k]
        rs, bs = np.nonzero(masks[k][:, a, :])
        order = np.lexsort((rs, bs))
        rs, bs = rs[order], bs[order]
        tail = drain = None
        const: np.ndarray | float = 0.0
        if problem.tail is not None and problem.drain is not None:
            tail, drain = problem.tail[q][rs, a, bs], problem.drain[q][rs, a, bs]
            if problem.tail_const is not None:
                const = problem.tail_const[q][rs, a, bs]
        return cls(k, a, rs, bs, problem.additive[q][rs, a, bs], problem.bottleneck[q][rs, a, bs], h[k + 1, bs],
                   g[k + 1, bs], tail, drain, const)


class _LabelSearch:
    """The label-setting DP's state: the Pareto front of each (segment, stage), the incumbent and its value."""

    def __init__(self, problem: PartitionProblem, upper_bound: float, masks: Sequence[np.ndarray]) -> None:
        self.problem = problem
        self.ns, self.nu = problem.additive[0].shape[3], problem.bottleneck[0].shape[3]
        root = _Label((0.0,) * self.ns, (-math.inf,) * self.nu + ((0.0,) if problem.has_tail else ()), 0.0,
                      None, None)
        self.gains = _Gain.per_stage(problem, masks)
        self.fronts: dict[tuple[int, int], _Front] = {(0, 0): _Front(self.gains[0] if self.gains else None)}
        self.fronts[(0, 0)].insert(root)
        self.created = 1
        self.bound = upper_bound
        """Labels whose completion bound is no better are dropped: the incumbent's value, or the caller's bound."""
        self.incumbent: list[StageChoice] | None = None

    def offer(self, value: float, stages: list[StageChoice]) -> None:
        """Take a known partition of objective `value` as the incumbent when it beats the bound."""
        if value < self.bound:
            self.bound, self.incumbent = value, stages

    def extend(self, label: _Label, nxt: _NextStages, *, last: bool) -> None:
        """Append each next stage to `label` whose completion bound beats the incumbent."""
        new_s, new_u, new_t, lb = self._completion_bounds(label, nxt)
        has_tail = self.problem.has_tail
        for c in np.nonzero(lb < self.bound)[0]:
            if lb[c] >= self.bound:  # the bound tightened while this front was being expanded
                continue
            maxes = tuple(float(x) for x in new_u[c]) + ((float(new_t[c]),) if has_tail else ())
            choice = StageChoice(nxt.a, int(nxt.stops[c]), self.problem.options[int(nxt.options[c])])
            drain = label.drain + (float(nxt.drain[c]) if has_tail else 0.0)
            new = _Label(tuple(float(x) for x in new_s[c]), maxes, drain, label, choice)
            if last:  # lb is then the exact objective (no stages remain)
                self.bound = float(lb[c])
                self.incumbent = _unwind(new)
                continue
            self.created += 1
            front = self.fronts.get((int(nxt.stops[c]), nxt.k + 1))
            if front is None:
                front = self.fronts[(int(nxt.stops[c]), nxt.k + 1)] = _Front(
                    self.gains[nxt.k + 1] if self.gains else None)
            front.insert(new)

    def _completion_bounds(self, label: _Label, nxt: _NextStages
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """Per next stage: the new sums, maxima and exposed tail, and Phi's lower bound over every completion."""
        new_s = np.asarray(label.sums)[None, :] + nxt.sums
        new_u = np.maximum(np.asarray(label.maxes[:self.nu])[None, :], nxt.maxes)
        lb_s = new_s + nxt.rest_sums
        lb_u = np.maximum(new_u, nxt.rest_maxes)
        lb_cols = [lb_u[:, i] for i in range(self.nu)]
        new_t = None
        if self.problem.has_tail:
            new_t = np.maximum(label.maxes[self.nu], np.maximum(nxt.tail - label.drain, 0.0) + nxt.tail_const)
            lb_cols.append(new_t)
        with np.errstate(invalid="ignore"):
            lb = np.asarray(self.problem.objective([lb_s[:, i] for i in range(self.ns)], lb_cols), dtype=float)
        return new_s, new_u, new_t, np.broadcast_to(lb, nxt.stops.shape)


def _unwind(label: _Label) -> list[StageChoice]:
    out: list[StageChoice] = []
    node: _Label | None = label
    while node is not None and node.choice is not None:
        out.append(node.choice)
        node = node.parent
    return out[::-1]
