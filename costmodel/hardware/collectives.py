r"""Collective communication time on a cluster: alpha-beta costs of ring, tree and in-network algorithms over the
network tiers a group spans, taking the fastest, as NCCL's tuner does (NVIDIA/nccl src/graph/tuning.cc).

Notation. A group of n ranks (`CommGroup`: start, start+stride, ...) sends S bytes, the *full logical buffer per
device* (all-reduce: the buffer; all-gather: the gathered output; reduce-scatter: the input; all-to-all: what one
device sends in total; send/recv and broadcast: the message). For tier t (t = 0 is the node), c_t is the number of
tier-t domains the group touches (c_{-1} = n; the outermost tier has c = 1). The group *spans* tier t when
c_{t-1} > c_t; then D_t = c_{t-1} / c_t tier-(t-1) domains talk through tier t, each holding P_t = n / c_{t-1} of
the group's ranks (P_0 = 1). B_t is the tier's effective bandwidth per device (spec x calibrated efficiency, see
`costmodel/hardware/data/links.csv`) and a_t its per-step latency -- or, when the tier has a `per_collective` override for
the collective's kind (`costmodel.hardware.network.CollectiveLink`, e.g. measured by `stratagem profile --collectives`),
that kind's achieved bandwidth and step latency. The node tier of a group touching several device groups takes,
per kind, the smallest bandwidth and largest latency of their node links.

Per-device bytes through tier t, by collective (hierarchical forms: reduce-scatter inside each domain first, so
the slower tier carries only 1/P_t of the buffer -- e.g. reduce-scatter in the node, all-reduce across nodes,
all-gather in the node; for a single tier they reduce to the textbook volumes):

    all-reduce, ring          V_t = 2 (D_t - 1) / D_t * S / P_t      (one tier: 2(n-1)/n * S)
    all-reduce, tree          V_t = 2 S / P_t                        (reduce up, broadcast down)
    all-reduce, in-network    V_t = S / P_t on tiers with in-switch reduction (NVLink SHARP), tree elsewhere
    all-gather/reduce-scatter V_t = (D_t - 1) / D_t * S / P_t        (one tier: (n-1)/n * S)
    all-to-all                V_t = (D_t - 1) * P_t / n * S          (one tier: (n-1)/n * S)
    broadcast, ring (chain)   V_t = S / P_t;  tree: 2 S / P_t        (each internal node feeds two children)
    send/recv                 V = S over the slowest tier the pair spans

Time = sum of latencies + max_t V_t / B_t: NCCL pipelines chunks over all channels, so the tiers work at once and
the slowest one bounds the bandwidth term (the measured 4-node B200 all-reduce is only reproducible this way: the
sum of the per-tier times would need a NIC faster than its spec). The slowest tier a group spans therefore sets
its bandwidth. Steps (latency): a ring makes n-1 steps per pass (all-reduce: two passes), of which
c_{t-1} - c_t cross tier t, as in NCCL's `nsteps`/`nInterSteps`; a tree makes a chain of D_0 - 1 steps inside a
node and ceil(log2 D_t) steps up (and down) at each outer tier, as NCCL's trees do; an in-network reduction costs
its tier's fixed `in_network_reduction_latency`. All-to-all is priced as n-1 pairwise-exchange steps.

Sharing: bandwidths are per device, already assuming every device under a tier uses it at once, so disjoint
groups do not slow each other. `concurrent` translates of the group that together hold more rank slots than the
cluster has devices (one device serving several collectives at once) share its links: the bandwidth term is
multiplied by max(1, concurrent * n / N).

Calibration and accuracy (see `bench/collectives.py`, which prints the table): predicted bus bandwidth of 8-GPU
all-reduce is within 3% of the measured nccl-tests rows of A100, H100 and H200 at 1G and 8G; the model
overestimates mid-size messages (16M-128M) by up to ~60% because NCCL ramps up channels and protocols there, which
an alpha-beta model does not capture.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collective_kind import Collective
from costmodel.hardware.network import CollectiveLink, NetworkTier


class Algorithm(enum.StrEnum):
    RING = "ring"
    TREE = "tree"
    IN_NETWORK = "in_network"
    """In-switch reduction (NVLink SHARP / NVLS) on the tiers that have it, tree elsewhere (NCCL's NVLS-Tree)."""
    DIRECT = "direct"
    """Point-to-point sends (send/recv, all-to-all)."""


@dataclass(frozen=True, slots=True)
class CommGroup:
    """Ranks start, start + stride, ..., start + (size - 1) * stride in global rank order."""

    size: int
    stride: int = 1
    start: int = 0

    def __post_init__(self) -> None:
        for name in ("size", "stride"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"CommGroup {name} must be a positive integer, got {v!r}")
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise ValueError(f"CommGroup start must be a rank >= 0, got {self.start!r}")

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.size * self.stride, self.stride)


@dataclass(frozen=True, slots=True)
class TierSpan:
    """One tier a group spans, with the link figures its collectives use."""

    index: int
    name: str
    peers: float
    """D_t: tier-(t-1) domains that talk through this tier (per tier-t domain)."""
    ranks_per_domain: float
    """P_t: group ranks inside one tier-(t-1) domain."""
    steps: int
    """c_{t-1} - c_t: ring steps (per pass) whose hop crosses this tier."""
    bandwidth: float
    """Effective bytes/s per device (spec x efficiency)."""
    latency: float
    in_network_bandwidth: float
    """Effective bytes/s of in-switch all-reduce; 0 when the tier has none."""
    in_network_latency: float
    overrides: tuple[CollectiveLink, ...] = ()
    """Per-kind `bandwidth` / `latency` replacing the two fields above for that kind (`for_kind`)."""

    def for_kind(self, kind: Collective) -> TierSpan:
        """This span with the link figures a `kind` collective gets (itself when the tier has no override)."""
        for link in self.overrides:
            if link.kind == kind:
                return dataclasses.replace(self, bandwidth=link.bandwidth, latency=link.latency, overrides=())
        return self


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    kind: Collective
    algorithm: Algorithm
    time_s: float
    latency_s: float
    bandwidth_s: float
    """Time of the bottleneck tier's transfer (after sharing)."""
    bottleneck_tier: str
    """Name of the tier whose transfer bounds the bandwidth term ("" for a no-op)."""
    slowest_tier: str
    """Name of the outermost tier the group spans ("" for a single rank)."""


def spans(group: CommGroup, cluster: Cluster) -> tuple[TierSpan, ...]:
    """The tiers `group` spans, innermost first (empty for a single rank); computed once per group and cluster
    (`Cluster.derived`)."""
    key = ("spans", group.size, group.stride, group.start)
    hit = cluster.derived.get(key)
    if hit is None:
        hit = cluster.derived[key] = _spans(group, cluster)
    return hit


def _spans(group: CommGroup, cluster: Cluster) -> tuple[TierSpan, ...]:
    counts = (group.size, *cluster.domain_counts(group.size, group.stride, group.start))
    out = []
    for t in range(len(cluster.tiers)):
        if counts[t] <= counts[t + 1]:
            continue
        if t == 0:
            bw, lat, inb, inl, overrides = _node_link(group, cluster)
        else:
            tier = cluster.tiers[t]
            bw, lat = tier.effective_bandwidth, tier.latency
            inb = tier.bandwidth * tier.in_network_reduction_efficiency
            inl = tier.in_network_reduction_latency
            overrides = tier.per_collective
        out.append(TierSpan(index=t, name=cluster.tiers[t].name, peers=counts[t] / counts[t + 1],
                            ranks_per_domain=group.size / counts[t], steps=counts[t] - counts[t + 1],
                            bandwidth=bw, latency=lat, in_network_bandwidth=inb, in_network_latency=inl,
                            overrides=overrides))
    return tuple(out)


def _node_link(group: CommGroup, cluster: Cluster,
               ) -> tuple[float, float, float, float, tuple[CollectiveLink, ...]]:
    """Node-tier figures for the device groups this communication group touches: the slowest of their nodes'
    links bounds a pipelined collective; in-switch reduction only if every touched node has it. Per-kind
    overrides likewise take, for each kind any touched node overrides, the slowest of the touched nodes' figures
    for that kind (a node without an override for it contributes its defaults)."""
    tiers = [cluster.node_tier_of(g) for g in range(len(cluster.groups)) if _touches(group, cluster.group_ranks(g))]
    in_network = min(t.bandwidth * t.in_network_reduction_efficiency for t in tiers)
    return (min(t.effective_bandwidth for t in tiers), max(t.latency for t in tiers), in_network,
            max(t.in_network_reduction_latency for t in tiers), _slowest_overrides(tiers))


def _slowest_overrides(tiers: Sequence[NetworkTier]) -> tuple[CollectiveLink, ...]:
    """Per kind overridden on any of `tiers`: the largest latency and smallest bandwidth over all of them (the
    common single-tier and no-override cases return without building anything; spans are computed often)."""
    if len(tiers) == 1 or not any(t.per_collective for t in tiers):
        return tiers[0].per_collective
    kinds = sorted({link.kind for t in tiers for link in t.per_collective})
    out = []
    for kind in kinds:
        figures = [t.link_for(kind) for t in tiers]
        out.append(CollectiveLink(kind, latency=max(lat for _, lat in figures),
                                  bandwidth=min(bw for bw, _ in figures)))
    return tuple(out)


def _touches(group: CommGroup, ranks: range) -> bool:
    """Whether one of the group's ranks lies in `ranks` (a device group's contiguous range)."""
    first = group.start + max(0, -(-(ranks.start - group.start) // group.stride)) * group.stride
    return first < ranks.stop and first <= group.ranks[-1]


def _tree_steps(span: TierSpan) -> int:
    # NCCL's tree is a chain inside the node and a (double) binary tree across nodes.
    return round(span.peers) - 1 if span.index == 0 else math.ceil(math.log2(span.peers))


def _price(parts: Sequence[tuple[TierSpan, float, float, float]], share: float) -> tuple[float, float, str]:
    """(latency, bandwidth term, bottleneck tier) of per-tier (span, bytes per device, bytes/s, latency s)."""
    latency = sum(lat for _, _, _, lat in parts)
    times = [(volume / bandwidth * share, span.name) for span, volume, bandwidth, _ in parts]
    bw_time, bottleneck = max(times)
    return latency, bw_time, bottleneck


def _candidates(kind: Collective, nbytes: float, tiers: Sequence[TierSpan], n: int,
                ) -> list[tuple[Algorithm, list[tuple[TierSpan, float, float, float]]]]:
    """Per algorithm: for each spanned tier (span, bytes per device through it, bandwidth, latency)."""
    S = nbytes
    if kind is Collective.ALL_REDUCE:
        ring = [(s, 2 * (s.peers - 1) / s.peers * S / s.ranks_per_domain, s.bandwidth, 2 * s.steps * s.latency)
                for s in tiers]
        tree = [(s, 2 * S / s.ranks_per_domain, s.bandwidth, 2 * _tree_steps(s) * s.latency) for s in tiers]
        out = [(Algorithm.RING, ring), (Algorithm.TREE, tree)]
        if any(s.in_network_bandwidth > 0 for s in tiers):
            out.append((Algorithm.IN_NETWORK, [
                (s, S / s.ranks_per_domain, s.in_network_bandwidth, s.in_network_latency)
                if s.in_network_bandwidth > 0 else t for s, t in zip(tiers, tree, strict=True)]))
        return out
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return [(Algorithm.RING, [(s, (s.peers - 1) / s.peers * S / s.ranks_per_domain, s.bandwidth,
                                   s.steps * s.latency) for s in tiers])]
    if kind is Collective.BROADCAST:
        return [(Algorithm.RING, [(s, S / s.ranks_per_domain, s.bandwidth, s.steps * s.latency) for s in tiers]),
                (Algorithm.TREE, [(s, 2 * S / s.ranks_per_domain, s.bandwidth, _tree_steps(s) * s.latency)
                                  for s in tiers])]
    if kind is Collective.ALL_TO_ALL:
        return [(Algorithm.DIRECT, [(s, (s.peers - 1) * s.ranks_per_domain / n * S, s.bandwidth,
                                     s.steps * s.latency) for s in tiers])]
    slowest = tiers[-1]  # SEND_RECV: each rank sends S to its successor, across the outermost tier spanned
    return [(Algorithm.DIRECT, [(slowest, S, slowest.bandwidth, slowest.latency)])]


def collective_cost(kind: Collective | str, nbytes: float, group: CommGroup, cluster: Cluster, *,
                    concurrent: int = 1, algorithms: Collection[Algorithm] | None = None,
                    tier_scale: Sequence[float] = ()) -> CollectiveCost:
    """The fastest algorithm's time for `kind` over `group`, with its latency / bandwidth split (module docstring).
    `algorithms` restricts the choice (e.g. {RING} to compare with a measurement taken with NVLS disabled).
    `tier_scale[t]` multiplies the bytes through tier t (a tier past its end keeps its bytes): a dispatch that
    moves other volumes than the collective's textbook ones (`costmodel.expert_parallel`, deduplicated
    all-to-all)."""
    try:
        kind = Collective(kind)
    except ValueError:
        raise ValueError(f"unknown collective {kind!r}; valid: {', '.join(c.value for c in Collective)}") from None
    if not (nbytes >= 0 and math.isfinite(nbytes)):
        raise ValueError(f"collective nbytes must be a finite number >= 0, got {nbytes!r}")
    if not isinstance(concurrent, int) or isinstance(concurrent, bool) or concurrent < 1:
        raise ValueError(f"concurrent must be a positive integer, got {concurrent!r}")
    tiers = spans(group, cluster)
    if any(s.overrides for s in tiers):
        tiers = tuple(s.for_kind(kind) for s in tiers)
    if not tiers or nbytes == 0:
        return CollectiveCost(kind, Algorithm.DIRECT if kind is Collective.SEND_RECV else Algorithm.RING,
                              0.0, 0.0, 0.0, "", tiers[-1].name if tiers else "")
    share = max(1.0, concurrent * group.size / cluster.num_devices)
    best = None
    candidates = [(a, p) for a, p in _candidates(kind, nbytes, tiers, group.size)
                  if algorithms is None or a in algorithms]
    if not candidates:
        raise ValueError(f"none of the algorithms {sorted(a.value for a in algorithms or ())} applies to {kind.value} "
                         f"over tiers {[t.name for t in tiers]}")
    for algorithm, parts in candidates:
        if tier_scale:
            parts = [(span, volume * (tier_scale[span.index] if span.index < len(tier_scale) else 1.0), bw, lat)
                     for span, volume, bw, lat in parts]
        latency, bw_time, bottleneck = _price(parts, share)
        cost = CollectiveCost(kind, algorithm, latency + bw_time, latency, bw_time, bottleneck, tiers[-1].name)
        if best is None or cost.time_s < best.time_s:
            best = cost
    assert best is not None
    return best


def collective_time(kind: Collective | str, nbytes: float, group: CommGroup, cluster: Cluster, *,
                    concurrent: int = 1, tier_scale: Sequence[float] = ()) -> float:
    """Seconds for one `kind` collective of `nbytes` (full logical buffer per device) over `group`
    (`tier_scale`: see `collective_cost`)."""
    return collective_cost(kind, nbytes, group, cluster, concurrent=concurrent, tier_scale=tier_scale).time_s


def bus_bandwidth(kind: Collective | str, nbytes: float, n: int, seconds: float) -> float:
    """nccl-tests "busbw" (bytes/s) of a measured or predicted time: algbw = nbytes / seconds times the factor
    that makes it comparable to a link's bandwidth (all-reduce 2(n-1)/n; all-gather, reduce-scatter and
    all-to-all (n-1)/n; broadcast and send/recv 1) -- nccl-tests doc/PERFORMANCE.md."""
    kind = Collective(kind)
    factor = {Collective.ALL_REDUCE: 2 * (n - 1) / n, Collective.ALL_GATHER: (n - 1) / n,
              Collective.REDUCE_SCATTER: (n - 1) / n, Collective.ALL_TO_ALL: (n - 1) / n}.get(kind, 1.0)
    return nbytes / seconds * factor
