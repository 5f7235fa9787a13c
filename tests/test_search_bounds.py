"""The level-2 bounds where pipeline ranks differ (a straggler, another device type) against enumeration."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster
from costmodel.pipeline import chunk_stages
from costmodel.strategy import Recompute, Schedule
from planner.search.bounds import _min_max_partition, _min_max_partition_ranks, interleaved_bottleneck
from planner.search.candidate_bounds import CandidateBounds
from planner.search.candidates import enumerate_candidates
from planner.search.interleaved_layout import InterleavedLayout
from planner.search.layer_costs import LayerCostTable
from planner.search.pricing import least_memory_of
from planner.search.space import SearchSpace
from planner.search.stage_problem import StageProblemBuilder


def test_min_max_partition_with_a_price_per_rank_is_the_enumerated_optimum() -> None:
    """Each part priced on its own rank, plus what its rank pays whatever it holds (its sends)."""
    rng = random.Random(1)
    for _ in range(300):
        n, p = rng.randint(1, 8), rng.randint(1, 4)
        base = [rng.uniform(0.1, 2.0) for _ in range(n)]
        speeds = [rng.choice([1.0, 1.0, 0.6, 0.8]) for _ in range(p)]
        works = [np.array(base) / s for s in speeds]
        sends = [rng.choice([0.0, rng.uniform(0, 1.5)]) for _ in range(p)]
        prefixes = [np.concatenate([[0.0], np.cumsum(w)]) for w in works]
        best = min(max(float(prefixes[k][b] - prefixes[k][a]) + sends[k] for k, (a, b) in
                       enumerate(itertools.pairwise((0, *cuts, n))))
                   for cuts in itertools.combinations_with_replacement(range(n + 1), p - 1))
        got = _min_max_partition_ranks(prefixes, sends)
        assert got <= best * (1 + 1e-9)
        assert got >= best * (1 - 1e-8)
        if len(set(speeds)) == 1 and not any(sends):
            assert got == pytest.approx(_min_max_partition(prefixes[0], p), rel=1e-8)


def test_interleaved_bottleneck_with_a_price_per_rank_is_the_enumerated_optimum() -> None:
    """The extra blocks each to the rank that would finish it first: the least largest rank over every way to give
    the E larger chunks out (at most v per rank)."""
    rng = random.Random(2)
    checked = 0
    for _ in range(300):
        pre, post, blocks = rng.choice([0, 1]), rng.choice([0, 1]), rng.randint(2, 14)
        p, v = rng.choice([2, 3, 4]), rng.choice([2, 3])
        layout = InterleavedLayout(p, v, pre + blocks + post, pre=pre, blocks=blocks, post=post,
                                   schedule=Schedule.INTERLEAVED)
        if layout.small < 1:
            continue
        base = np.array([rng.uniform(0.5, 1.5) for _ in range(layout.num_segments)])
        base[pre:pre + blocks] = base[pre]
        works = [base / rng.choice([1.0, 0.5, 0.8]) for _ in range(p)]
        sends = [rng.uniform(0, 0.05) for _ in range(p * v - 1)]
        small = []
        for r in range(p):
            own = sum((sends[j - 1] if j > 0 else 0.0) + (sends[j] if j < p * v - 1 else 0.0)
                      for j in chunk_stages(Schedule.INTERLEAVED, p, v, r))
            small.append(sum(float(works[r][list(c)].sum()) for c in layout.chunk_segments(r, (layout.small,) * v))
                         + own)
        best = min(max(small[r] + e * float(works[r][pre]) for r, e in enumerate(extras))
                   for extras in itertools.product(range(v + 1), repeat=p) if sum(extras) == layout.extra)
        assert interleaved_bottleneck(layout, np.min(works, axis=0), sends, works) == pytest.approx(best, rel=1e-12)
        checked += 1
    assert checked > 100


def test_memory_floor_never_exceeds_a_candidates_least_memory_and_holds_the_loss() -> None:
    """`CandidateBounds.memory_floor` against each candidate's least memory over every partition and recomputation
    (`least_memory_of`), on a chain whose loss over a large vocabulary at a long sequence is most of the memory:
    the bound never exceeds it, and with what the rank running the loss holds in it, it is within 10% (the
    explanation of "nothing fits" visits candidates in the bound's order: a loose bound built every one)."""
    chain = gpt_chain(GptShape(layers=4, hidden=64, heads=4, seq=8192, vocab=32000, batch=1), attention="flash")
    cluster = Cluster.parse("1x4xa100-80gb")
    builder = StageProblemBuilder(chain, cluster, LayerCostTable(chain, cluster))
    bounds = CandidateBounds(chain, "bfloat16", builder)
    options = tuple(Recompute)
    cands, _ = enumerate_candidates(chain, cluster, 4, SearchSpace())
    ratios = []
    for cand in cands:
        built = builder.build(cand, options)
        if built is None:
            continue
        least = least_memory_of(built)
        floor = bounds.memory_floor(cand, options)
        assert floor <= least * (1 + 1e-9), (cand.label, floor, least)
        ratios.append(floor / least)
    assert len(ratios) > 20 and min(ratios) > 0.9, (len(ratios), min(ratios))
