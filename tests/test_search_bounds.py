"""The level-2 bounds where pipeline ranks differ (a straggler, another device type) against enumeration."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from costmodel.pipeline import chunk_stages
from costmodel.strategy import Schedule
from planner.search.bounds import _min_max_partition, _min_max_partition_ranks, interleaved_bottleneck
from planner.search.interleaved_layout import InterleavedLayout


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
