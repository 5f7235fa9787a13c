"""Group data parallelism: data-parallel replicas on different device types, each group on its own batch share.

Each device group trains its own replicas (its best strategy from the search on the group alone) on a share of
the global batch; the shares balance the groups' step times exactly:

    minimize  max_g T_g(m_g) + sync     subject to  sum_g dp_g * mbs_g * m_g = global_batch,  m_g >= 0,

where T_g(m) is `costmodel.estimate` of group g's strategy with m micro-batches (non-decreasing in m) and `sync`
is the gradient all-reduce between the groups (one rank of each group, over the tier that connects them, the bytes
of the largest gradient shard a device holds; it is not overlapped with the backward: a conservative price).
`balance_shares` solves the min-max exactly by bisection on the step time with a bounded subset-sum feasibility
test (`tests/test_heterogeneous.py` checks it against brute force). `proportional_split` is the closed form the
stage partition approaches on a uniform chain: counts proportional to speed, capped by what fits in memory
(largest remainders).

The other way to use devices of different speed, pipeline stages on different types, is the search's own
(`planner.search.device_groups`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from costmodel.breakdown import Estimate
from costmodel.estimate import estimate as costmodel_estimate
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.layer_cost import LayerCost
from costmodel.model_flops import model_flops
from costmodel.pipeline import schedule_problem
from costmodel.strategy import Strategy
from ir.layer_chain import LayerChain
from planner.errors import UserError
from planner.search.branch_and_bound import search
from planner.search.layer_costs import LayerCostTable
from planner.search.outcome import SearchOptions
from planner.strategy_label import Detail, strategy_label

# ---- proportional shares --------------------------------------------------------------------------------------


def proportional_split(total: int, weights: Sequence[float], caps: Sequence[int] | None = None) -> tuple[int, ...]:
    """Integers summing to `total`, proportional to `weights`, each at most its cap (largest remainders).

    Items at their cap are fixed and the rest re-split among the others, until nothing exceeds a cap
    (water-filling); remainders go to the largest fractional parts, ties to the earlier item. Raises ValueError
    when the caps cannot hold `total`."""
    n = len(weights)
    if n == 0 or any(w < 0 for w in weights) or not any(w > 0 for w in weights):
        raise ValueError(f"weights must be >= 0 with one > 0, got {list(weights)}")
    limit = list(caps) if caps is not None else [total] * n
    if len(limit) != n:
        raise ValueError(f"{len(limit)} caps for {n} weights")
    if sum(min(c, total) for c, w in zip(limit, weights, strict=True) if w > 0) < total:
        raise ValueError(f"caps {list(limit)} cannot hold {total}")
    fixed: dict[int, int] = {}
    while True:
        free = [i for i in range(n) if i not in fixed and weights[i] > 0]
        left = total - sum(fixed.values())
        wsum = sum(weights[i] for i in free)
        ideal = {i: left * weights[i] / wsum for i in free}
        over = [i for i in free if ideal[i] > limit[i]]
        if not over:
            break
        for i in over:
            fixed[i] = limit[i]
    shares = {i: math.floor(ideal[i]) for i in free}
    rest = left - sum(shares.values())
    order = sorted(free, key=lambda i: (-(ideal[i] - shares[i]), i))
    for i in order:
        if rest == 0:
            break
        if shares[i] < limit[i]:
            shares[i] += 1
            rest -= 1
    return tuple(fixed.get(i, shares.get(i, 0)) for i in range(n))


# ---- balancing batch shares ----------------------------------------------------------------------------------


def _reachable(units: Sequence[int], caps: Sequence[int], total: int) -> list[int]:
    """Bitsets: reach[g] has bit s set when groups 0..g-1 can make exactly s samples within their caps."""
    mask = (1 << (total + 1)) - 1
    reach = [1]
    for u, c in zip(units, caps, strict=True):
        r = 0
        for m in range(c + 1):
            r |= reach[-1] << (u * m)
        reach.append(r & mask)
    return reach


def balance_shares(total: int, units: Sequence[int], step_time: Callable[[int, int], float],
                   limits: Sequence[int], *, rel_tol: float = 1e-12) -> tuple[tuple[int, ...], float] | None:
    """Counts m_g in 0..limits[g] with sum units[g] * m_g == total minimizing max_g step_time(g, m_g).

    `step_time(g, m)` must be non-decreasing in m (math.inf when it does not fit) and step_time(g, 0) == 0 (the
    group sits idle). Returns (counts, max step time) or None when no combination makes exactly `total`.
    Exact up to `rel_tol`: bisection on the step time; at a threshold V each group takes at most
    cap_g(V) = max{m : step_time(g, m) <= V} (binary search, memoized), and a bounded subset sum decides whether
    the caps can make `total`. Ties: the later groups take as much as they can."""
    if not units or len(limits) != len(units) or any(u < 1 for u in units):
        raise ValueError("need one positive unit and one limit per group")
    shares = _SharesAtThreshold(total, tuple(units), tuple(limits), step_time)
    best = shares.first_feasible()
    if best is None:
        return None
    lo, hi = 0.0, shares.slowest(best)
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        found = shares.counts_at(mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, shares.slowest(found)
    return tuple(best), shares.slowest(best)


class _SharesAtThreshold:
    """`balance_shares`' feasibility test: which counts make `total` when no group may exceed a step time."""

    def __init__(self, total: int, units: tuple[int, ...], limits: tuple[int, ...],
                 step_time: Callable[[int, int], float]) -> None:
        self.total, self.units, self.limits = total, units, limits
        self._step_time = step_time
        self._memo: dict[tuple[int, int], float] = {}

    def time(self, g: int, m: int) -> float:
        if m == 0:
            return 0.0
        if (g, m) not in self._memo:
            self._memo[g, m] = self._step_time(g, m)
        return self._memo[g, m]

    def slowest(self, counts: Sequence[int]) -> float:
        return max(self.time(g, m) for g, m in enumerate(counts))

    def caps_at(self, v: float) -> list[int]:
        """Per group the most it can take within step time `v` (binary search: times grow with the count)."""
        caps = []
        for g, limit in enumerate(self.limits):
            lo, hi = 0, limit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.time(g, mid) <= v:
                    lo = mid
                else:
                    hi = mid - 1
            caps.append(lo)
        return caps

    def counts_at(self, v: float) -> list[int] | None:
        """Counts within the caps at `v` that make exactly `total` (later groups as much as they can), or None."""
        caps = self.caps_at(v)
        reach = _reachable(self.units, caps, self.total)
        if not (reach[-1] >> self.total) & 1:
            return None
        counts, left = [0] * len(self.units), self.total
        for g in range(len(self.units) - 1, -1, -1):
            u = self.units[g]
            for m in range(min(caps[g], left // u), -1, -1):
                if (reach[g] >> (left - u * m)) & 1:
                    counts[g], left = m, left - u * m
                    break
        return counts

    def first_feasible(self) -> list[int] | None:
        """Counts at the largest step time any group can have: every group at its limit, or, when some group
        cannot take its full limit, the largest finite time."""
        top = max(self.time(g, limit) for g, limit in enumerate(self.limits))
        best = self.counts_at(top) if math.isfinite(top) else None
        if best is None:
            finite = [self.time(g, m) for g, limit in enumerate(self.limits) for m in range(limit + 1)
                      if math.isfinite(self.time(g, m))]
            best = self.counts_at(max(finite, default=0.0))
        return best


# ---- group data parallelism ----------------------------------------------------------------------------------


def group_cluster(cluster: Cluster, group_index: int) -> Cluster:
    """Device group `group_index` alone, as a cluster: its own node link, then the outer tiers up to the first that
    spans the whole group (ranks renumbered from 0; a tier domain boundary that fell inside the group is
    approximated by one aligned at its first rank)."""
    g = cluster.groups[group_index]
    node = dataclasses.replace(cluster.node_tier_of(group_index), size=g.devices_per_node)
    tiers = [node]
    for tier in cluster.tiers[1:]:
        if tier.size <= tiers[-1].size:
            continue
        tiers.append(tier)
        if tier.size >= g.num_devices:
            break
    if tiers[-1].size < g.num_devices:
        tiers[-1] = dataclasses.replace(tiers[-1], size=g.num_devices)
    return Cluster(name=f"{cluster.name}/{g.name}", groups=(dataclasses.replace(g, node_tier=None),),
                   tiers=tuple(tiers), expert_imbalance=cluster.expert_imbalance)


@dataclass(frozen=True)
class GroupShare:
    """What one device group does in a group-data-parallel step."""

    group: str
    device: str
    num_devices: int
    """Devices of the group that the strategy uses."""
    samples: int
    """Samples per step on this group (dp * microbatch_size * num_microbatches of `strategy`; 0: idle)."""
    strategy: Strategy
    estimate: Estimate | None
    """`costmodel.estimate` of `strategy` on the group alone; None when the group is idle."""
    price_per_hour: float | None

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s if self.estimate is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "device": self.device, "num_devices": self.num_devices,
                "samples": self.samples, "step_time_s": self.step_time_s,
                "strategy": self.strategy.to_dict() if self.samples else None}


@dataclass(frozen=True)
class GroupDataParallelPlan:
    """Every device group trains replicas of the model on its share of the global batch; gradients are summed
    across groups at the end of the step."""

    shares: tuple[GroupShare, ...]
    sync_s: float
    """Cross-group gradient all-reduce (exposed)."""
    step_time_s: float
    global_batch: int
    seq_len: int | None
    model_flops_per_step: float
    peak_flops: float
    """Sum of the dense peaks of the devices in use."""

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_time_s

    @property
    def tokens_per_s(self) -> float | None:
        return self.samples_per_s * self.seq_len if self.seq_len else None

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.step_time_s * self.peak_flops)

    @property
    def num_devices(self) -> int:
        return sum(s.num_devices for s in self.shares if s.samples)

    @property
    def fits(self) -> bool:
        return all(s.estimate.fits for s in self.shares if s.estimate is not None)

    @property
    def price_per_hour(self) -> float | None:
        prices = [s.price_per_hour for s in self.shares if s.samples]
        return None if any(p is None for p in prices) else sum(prices)  # type: ignore[misc]

    def summary(self) -> str:
        parts = [f"{s.group}: {s.samples} samples on {s.num_devices}x {s.device} "
                 f"({strategy_label(s.strategy, Detail.DEGREES)} mbs={s.strategy.microbatch_size} "
                 f"m={s.strategy.num_microbatches}, {s.step_time_s:.4g} s)" if s.samples else f"{s.group}: idle"
                 for s in self.shares]
        return "group data parallel: " + "; ".join(parts) + f"; cross-group sync {self.sync_s:.3g} s"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "group_data_parallel", "step_time_s": self.step_time_s, "sync_s": self.sync_s,
                "global_batch": self.global_batch, "samples_per_s": self.samples_per_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "shares": [s.to_dict() for s in self.shares]}


SearchFn = Callable[[LayerChain, Cluster, int], tuple[Strategy, Mapping[tuple[int, str], LayerCost]]]
"""(chain, cluster, global batch) -> the best strategy there and its layer costs (for `costmodel.estimate`)."""


def searching(space: Any = None, *, dtype: str = "bfloat16", tables: dict[str, Any] | None = None,
              time_limit_s: float | None = None) -> SearchFn:
    """A `SearchFn` running `planner.search.branch_and_bound.search` (time objective) with one `LayerCostTable` per device type,
    kept in `tables` (device name -> table) so that later calls reuse the layer prices."""
    tables = {} if tables is None else tables

    def run(chain: LayerChain, cluster: Cluster, global_batch: int) -> tuple[Strategy, Mapping]:
        device = cluster.groups[0].device.name
        table = tables.get(device)
        if table is None:
            table = tables[device] = LayerCostTable(chain, cluster, dtype=dtype)
        options = SearchOptions.for_users(time_limit_s=time_limit_s)
        result = search(chain, cluster, global_batch=global_batch, space=space, options=options, dtype=dtype,
                        table=table)
        return result.best.strategy, result.best.layer_costs

    return run


def _quantum(cluster: Cluster, global_batch: int) -> int:
    """The largest power of two that divides the batch and is at most the smallest group: shares in multiples of
    it still split evenly over the data-parallel replicas of a group."""
    quantum = 1
    smallest = min(g.num_available for g in cluster.groups)
    while global_batch % (2 * quantum) == 0 and 2 * quantum <= smallest:
        quantum *= 2
    return quantum


def _shares(global_batch: int, weights: Sequence[float], quantum: int) -> tuple[int, ...]:
    """Samples per group proportional to `weights`, in whole multiples of `quantum`."""
    units = proportional_split(global_batch // quantum, weights)
    return tuple(u * quantum for u in units)


def _initial_weights(cluster: Cluster, dtype: str) -> list[float]:
    """Achievable FLOP/s of each group: peak x best matmul efficiency x the speeds of its devices."""
    return [sum(g.speed_of(i) for i in range(g.num_devices)) * g.device.flops(dtype) * g.device.matmul_efficiency
            for g in cluster.groups]


def _cross_group(cluster: Cluster, active: Sequence[int]) -> CommGroup:
    """One rank per active group (their first ranks), as a regular group: exact for two groups or equal sizes."""
    starts = [cluster.group_ranks(g).start for g in active]
    stride = min(b - a for a, b in zip(starts, starts[1:], strict=False))
    return CommGroup(len(starts), stride=stride, start=starts[0])


def plan_group_data_parallel(chain: LayerChain, cluster: Cluster, global_batch: int, search_fn: SearchFn, *,
                             dtype: str = "bfloat16", rounds: int = 3) -> GroupDataParallelPlan:
    """Group data parallelism on a cluster of several device groups (module docstring).

    Start from shares proportional to each group's achievable FLOP/s; plan every group on its share with
    `search_fn` and rebalance the shares exactly by changing each group's number of micro-batches
    (`balance_shares`); then plan again on shares proportional to the throughput each group showed, on a grid
    twice as fine, while they change (at most `rounds` plannings). The best plan seen is returned. Raises
    UserError for a one-group cluster."""
    if len(cluster.groups) < 2:
        raise UserError(f"group data parallelism needs a cluster of several device groups; {cluster.name!r} has one")
    if global_batch < len(cluster.groups):
        raise UserError(f"global batch {global_batch} is smaller than the {len(cluster.groups)} device groups")
    subs = [group_cluster(cluster, i) for i in range(len(cluster.groups))]
    searched: dict[tuple[int, int], tuple[Strategy, Mapping[tuple[int, str], LayerCost]]] = {}
    quantum = _quantum(cluster, global_batch)
    samples = _shares(global_batch, _initial_weights(cluster, dtype), quantum)
    best: GroupDataParallelPlan | None = None
    seen: set[tuple[int, ...]] = set()
    for _ in range(rounds):
        if samples in seen:
            break
        seen.add(samples)
        planned = []
        for g, n in enumerate(samples):
            if n and (g, n) not in searched:
                searched[g, n] = search_fn(chain, subs[g], n)
            planned.append(searched[g, n] if n else None)
        found = _balanced(chain, cluster, subs, global_batch, planned, dtype)
        if best is None or found.step_time_s < best.step_time_s:
            best = found
        # Next: shares proportional to the throughput each group showed, on a finer grid (the strategies found
        # may have split the batch in units too coarse to balance).
        rates = [s.samples / s.step_time_s if s.samples else 0.0 for s in found.shares]
        while quantum > 1 and samples in seen:
            quantum //= 2
            samples = _shares(global_batch, rates, quantum)
    assert best is not None
    return best


def _balanced(chain: LayerChain, cluster: Cluster, subs: Sequence[Cluster], global_batch: int,
              planned: Sequence[tuple[Strategy, Mapping[tuple[int, str], LayerCost]] | None],
              dtype: str) -> GroupDataParallelPlan:
    """Each planned group's strategy with the micro-batch counts that balance the step (`balance_shares`)."""
    estimates: dict[tuple[int, int], Estimate] = {}

    def est(g: int, m: int) -> Estimate:
        if (g, m) not in estimates:
            st, costs = planned[g]  # type: ignore[misc]
            estimates[g, m] = costmodel_estimate(chain, subs[g], dataclasses.replace(st, num_microbatches=m),
                                                 layer_costs=costs, dtype=dtype)
        return estimates[g, m]

    def step(g: int, m: int) -> float:
        st = planned[g][0]  # type: ignore[index]
        if schedule_problem(st.schedule, st.pp, m):
            return math.inf
        e = est(g, m)
        return e.step_time_s if e.fits else math.inf

    active = [g for g, p in enumerate(planned) if p is not None]
    units = [planned[g][0].dp * planned[g][0].microbatch_size for g in active]  # type: ignore[index]
    found = balance_shares(global_batch, units, lambda i, m: step(active[i], m), [global_batch // u for u in units])
    counts = dict.fromkeys(range(len(cluster.groups)), 0)
    for i, g in enumerate(active):  # without a balance, the searched shares make the batch exactly
        counts[g] = found[0][i] if found is not None else planned[g][0].num_microbatches  # type: ignore[index]
    return _assemble(chain, cluster, global_batch, planned, counts, est, dtype)


def _assemble(chain: LayerChain, cluster: Cluster, global_batch: int, planned: Sequence[Any],
              counts: Mapping[int, int], est: Callable[[int, int], Estimate], dtype: str) -> GroupDataParallelPlan:
    shares = []
    for g, group in enumerate(cluster.groups):
        m = counts[g]
        if m == 0 or planned[g] is None:
            strategy = planned[g][0] if planned[g] is not None else Strategy()
            shares.append(GroupShare(group.name, group.device.name, 0, 0, strategy, None, group.price_per_device_hour))
            continue
        e = est(g, m)
        st = dataclasses.replace(planned[g][0], num_microbatches=m)
        price = None if group.price_per_device_hour is None else group.price_per_device_hour * st.num_devices
        shares.append(GroupShare(group.name, group.device.name, st.num_devices, st.global_batch, st, e, price))
    active = [g for g, s in enumerate(shares) if s.samples]
    sync = 0.0
    if len(active) > 1:
        grad_bytes = max(max(s.memory.grads for s in shares[g].estimate.stages) for g in active)  # type: ignore[union-attr]
        concurrent = min(shares[g].num_devices for g in active)
        sync = collective_time(Collective.ALL_REDUCE, grad_bytes, _cross_group(cluster, active), cluster,
                               concurrent=concurrent)
    graph = chain.graph
    flops = model_flops(chain) * global_batch / graph.batch_size
    peak = sum(cluster.groups[g].device.flops(dtype) * shares[g].num_devices for g in active)
    step = max(shares[g].step_time_s for g in active) + sync
    return GroupDataParallelPlan(shares=tuple(shares), sync_s=sync, step_time_s=step, global_batch=global_batch,
                                 seq_len=graph.seq_len, model_flops_per_step=flops, peak_flops=peak)
