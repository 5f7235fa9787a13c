"""The stage-partition dynamic program against brute force on seeded random instances."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from planner.search.stage_partition import (
    PartitionProblem,
    StageChoice,
    StageKind,
    evaluate,
    solve_partition,
    stage_kind,
)

OPTIONS = ("none", "selective", "full")


def _random_problem(rng: np.random.Generator, n: int, p: int, num_options: int, ns: int, nu: int,
                    m: int, integer: bool, with_tail: bool = False, weighted: bool = False) -> PartitionProblem:
    shape = (num_options, n + 1, n + 1)

    def draw(extra: tuple[int, ...]) -> np.ndarray:
        if integer:  # small integers make exact ties common, which exercises the dominance rules
            return rng.integers(0, 6, size=shape + extra).astype(float)
        return rng.uniform(0.1, 10.0, size=shape + extra)

    sums = tuple(draw((ns,)) for _ in StageKind)
    maxes = tuple(draw((nu,)) for _ in StageKind)
    base = tuple(rng.uniform(0.0, 6.0, size=shape) for _ in StageKind)
    act = tuple(rng.uniform(0.0, 2.0, size=shape) for _ in StageKind)
    profile = tuple(int(stage_kind(k, p)) for k in range(p))
    inflight = tuple(min(p - k, m) for k in range(p))
    capacity = tuple(float(rng.uniform(4.0, 12.0)) for _ in range(p))

    def objective(s, u):
        return s[0] + (m - 1) * u[0] + sum(s[1:]) * 0.5 + sum(u[1:])

    tail = drain = const = None
    if with_tail:  # end-of-step tails that hide behind the drain of the earlier stages, plus a part none hides
        tail = tuple(draw(()) * 2 for _ in StageKind)
        drain = tuple(draw(()) for _ in StageKind)
        const = tuple(draw(()) * 0.3 for _ in StageKind)
    weights = None
    if weighted:  # the objective's linear form: labels are then also dropped by what they can still gain
        weights = ((1.0,) + (0.5,) * (ns - 1), (m - 1.0,) + (1.0,) * (nu - 1 + with_tail))
    return PartitionProblem(num_segments=n, num_stages=p, options=OPTIONS[:num_options], additive=sums,
                            bottleneck=maxes, memory_base=base, memory_per_microbatch=act, stage_profile=profile,
                            in_flight=inflight, capacity=capacity, objective=objective, tail=tail, drain=drain,
                            tail_const=const, weights=weights)


def _brute_force(problem: PartitionProblem) -> float:
    n, p = problem.num_segments, problem.num_stages
    best = math.inf
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        for opts in itertools.product(problem.options, repeat=p):
            stages = [StageChoice(bounds[i], bounds[i + 1], opts[i]) for i in range(p)]
            best = min(best, evaluate(problem, stages)[0])
    return best


@pytest.mark.parametrize("weighted", [False, True])
def test_dp_matches_brute_force_on_random_instances(weighted: bool) -> None:
    rng = np.random.default_rng(20240601)
    checked = infeasible = 0
    for trial in range(600):
        n = int(rng.integers(1, 8))
        p = int(rng.integers(1, min(n, 4) + 1))
        problem = _random_problem(rng, n, p, int(rng.integers(1, 4)), int(rng.integers(1, 3)),
                                  int(rng.integers(1, 3)), m=int(rng.integers(1, 9)), integer=trial % 2 == 0,
                                  with_tail=trial % 3 == 0, weighted=weighted)
        expected = _brute_force(problem)
        got = solve_partition(problem)
        if weighted and got is not None:  # the optimum of the plain dominance, with no more labels
            plain = solve_partition(dataclasses.replace(problem, weights=None))
            assert plain is not None and plain.objective == pytest.approx(got.objective, rel=1e-12), f"trial {trial}"
            assert got.labels_created <= plain.labels_created
        if math.isinf(expected):
            assert got is None, f"trial {trial}: brute force finds nothing feasible, DP returned {got}"
            infeasible += 1
        else:
            assert got is not None, f"trial {trial}: DP found nothing, brute force {expected}"
            assert got.objective == pytest.approx(expected, rel=1e-12), f"trial {trial}"
            # The returned partition is a real partition whose own value is the reported one.
            assert evaluate(problem, got.stages)[0] == pytest.approx(got.objective, rel=1e-12)
            assert got.stages[0].start == 0 and got.stages[-1].stop == n
            assert all(s.stop == t.start for s, t in zip(got.stages, got.stages[1:], strict=False))
        checked += 1
    print(f"stage partition: {checked} random instances agree with brute force ({infeasible} infeasible)")
    assert checked == 600 and 0 < infeasible < 600


def test_weights_must_match_the_objective() -> None:
    rng = np.random.default_rng(3)
    problem = _random_problem(rng, 5, 2, 2, 1, 2, m=4, integer=False, weighted=True)
    with pytest.raises(ValueError, match="do not match"):
        dataclasses.replace(problem, weights=((1.0,), (4.0, 1.0)))
    with pytest.raises(ValueError, match="non-negative"):
        dataclasses.replace(problem, weights=((1.0,), (3.0,)))


def test_upper_bound_only_returns_improvements() -> None:
    rng = np.random.default_rng(7)
    problem = _random_problem(rng, 6, 3, 3, 1, 1, m=4, integer=False)
    best = solve_partition(problem)
    assert best is not None
    assert solve_partition(problem, upper_bound=best.objective) is None
    again = solve_partition(problem, upper_bound=best.objective * 1.5)
    assert again is not None and again.objective == pytest.approx(best.objective)


def test_even_split_is_optimal_for_identical_layers() -> None:
    # 8 identical layers of 1 s (fwd+bwd) on 4 stages, 1F1B with m=8: T = 8 + 7 * 2 = 22 s, two layers per stage.
    n, p, m = 8, 4, 8
    idx = np.arange(n + 1)
    length = np.maximum(idx[None, :] - idx[:, None], 0).astype(float)
    sums = tuple(length[None, :, :, None] for _ in StageKind)
    zeros = (np.zeros((1, n + 1, n + 1)),) * 4
    problem = PartitionProblem(num_segments=n, num_stages=p, options=("none",), additive=sums, bottleneck=sums,
                               memory_base=zeros, memory_per_microbatch=zeros, stage_profile=(0, 1, 1, 2),
                               in_flight=(4, 3, 2, 1), capacity=(1.0,) * p, objective=lambda s, u: s[0] + (m - 1) * u[0])
    got = solve_partition(problem)
    assert got is not None and got.objective == 22.0
    assert [(s.start, s.stop) for s in got.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_memory_forces_recompute_on_early_stages_only() -> None:
    # 1F1B keeps p - k micro-batches alive on stage k, so the first stage needs recomputation first.
    n, p, m = 4, 2, 8
    idx = np.arange(n + 1)
    length = np.maximum(idx[None, :] - idx[:, None], 0).astype(float)
    time = np.stack([length, 1.3 * length])            # full recompute costs 30% more
    act = np.stack([length, 0.1 * length])             # and keeps a tenth of the activations
    sums = tuple(time[..., None] for _ in StageKind)
    problem = PartitionProblem(num_segments=n, num_stages=p, options=("none", "full"), additive=sums,
                               bottleneck=sums, memory_base=(np.zeros_like(time),) * 4, memory_per_microbatch=(act,) * 4,
                               stage_profile=(0, 2), in_flight=(2, 1), capacity=(3.0, 3.0),
                               objective=lambda s, u: s[0] + (m - 1) * u[0])
    got = solve_partition(problem)
    assert got is not None
    # Stage 0 holds 2 micro-batches: 2 layers * 2 = 4 > 3, so it recomputes; stage 1 (1 in flight) does not.
    assert [(s.start, s.stop, s.option) for s in got.stages] == [(0, 2, "full"), (2, 4, "none")]
    assert got.objective == pytest.approx(2 * 1.3 + 2 + (m - 1) * 2.6)


def test_slow_device_gets_fewer_layers() -> None:
    # Two stages on devices of speed 1.0 and 0.5 (a per-stage profile): the slow one gets a third of the layers.
    n, p, m = 6, 2, 16
    idx = np.arange(n + 1)
    length = np.maximum(idx[None, :] - idx[:, None], 0).astype(float)[None]
    fast, slow = length[..., None], 2.0 * length[..., None]
    zeros = (np.zeros_like(length),) * 2
    problem = PartitionProblem(num_segments=n, num_stages=p, options=("none",), additive=(fast, slow),
                               bottleneck=(fast, slow), memory_base=zeros, memory_per_microbatch=zeros,
                               stage_profile=(0, 1), in_flight=(2, 1), capacity=(1.0, 1.0),
                               objective=lambda s, u: s[0] + (m - 1) * u[0])
    got = solve_partition(problem)
    assert got is not None
    assert [(s.start, s.stop) for s in got.stages] == [(0, 4), (4, 6)]
    assert got.objective == pytest.approx(4 + 4 + (m - 1) * 4)


def test_a_deadline_stops_the_dp_with_its_best_so_far() -> None:
    """Under a time limit a partition solve that has not finished returns its incumbent, marked not proven; with
    time to spare it is the exact optimum."""
    from planner.search.stage_partition import solve_partition_until

    rng = np.random.default_rng(7)
    problem = _random_problem(rng, n=40, p=8, num_options=3, ns=2, nu=2, m=8, integer=False, with_tail=True)
    exact = solve_partition(problem)
    assert exact is not None and exact.labels_created > 1024
    cut, proven = solve_partition_until(problem, deadline=0.0)  # long past
    assert not proven
    assert cut is not None and cut.objective >= exact.objective - 1e-9
    assert cut.objective == pytest.approx(evaluate(problem, cut.stages)[0])
    done, proven = solve_partition_until(problem, deadline=math.inf)
    assert proven and done is not None and done.objective == exact.objective
