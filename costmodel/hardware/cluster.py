"""Cluster specs: device groups and the network tiers that connect them.

A cluster is one or more `DeviceGroup`s (same device type, `num_nodes` x `devices_per_node`) and a list of
`NetworkTier`s ordered innermost first: tier 0 is inside a node (NVLink), then e.g. rack, building,
datacenter. A tier of `size` k means groups of k consecutive devices (global rank order) share that tier's
links; the last tier spans the whole cluster. A communication group's bandwidth is that of the slowest
(outermost) tier it spans.

Global rank order: groups in spec order, nodes in order, devices in order. Ranks are device slots: an unavailable
device keeps its rank (so a spec edit does not renumber the others); `speed_of` is 0 for it and
`available_ranks()` leaves it out.

Bandwidths are per device and unidirectional: a tier's `bandwidth` is what each device gets when every device
under it sends through the tier at once (a rack uplink of 400 GB/s shared by 32 GPUs is 12.5 GB/s per device).
`efficiency` is the achievable fraction of it for collectives (calibrated in `costmodel/hardware/data/links.csv`).

One latency and one bandwidth per tier under-price some collectives: gloo on 2 CPU ranks measured 96 us per
all-reduce step but 170 us per reduce-scatter step, and reduce-scatter reached ~1/3 of all-reduce's bandwidth at
4 MB. `NetworkTier.per_collective` therefore holds optional per-kind `CollectiveLink` overrides (achieved
bandwidth and per-step latency) that `costmodel.hardware.collectives` uses for that kind instead of the tier's defaults.

The node tier can differ per device group (an A100 node has NVLink 3, a V100 node NVLink 2):
`DeviceGroup.node_tier` overrides `tiers[0]` for that group's nodes; `node_tier_of(group_index)` resolves it.

Devices that share a host's cores (CPU ranks as processes: `1x4xcpu` on a 2-core machine) name the cores per
node in `DeviceGroup.host_cores`; `compute_speeds` turns that into a speed per device for a job whose devices are
busy a given fraction of the step (pipeline bubbles free cores for the busy stages).

`Cluster.parse(spec)` takes the shorthand `NODESxGPUSxDEVICE` (`128x8xa100-80gb`, `1x4xcpu`) or a YAML path; the
format and its validation live in `costmodel.hardware.cluster_yaml`.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from costmodel.hardware.collective_kind import Collective
from costmodel.hardware.device import DeviceSpec

MAX_DEVICES = 1 << 20
"""Most devices a cluster spec may have: about ten times the largest announced training cluster (xAI Colossus,
100,000 H100 GPUs, announced September 2024). A bigger count is a typo, and rank tables of that size would
exhaust memory before any error could be reported."""


COLLECTIVE_KINDS: tuple[str, ...] = tuple(k.value for k in Collective)
"""Values of `costmodel.hardware.collective_kind.Collective`, the kinds a tier may override."""


@dataclass(frozen=True)
class CollectiveLink:
    """A tier's figures for one collective kind, overriding the tier's latency and effective bandwidth for it
    (measured collectives differ by kind: a gloo reduce-scatter step costs ~2x an all-reduce step)."""

    kind: str
    """A `COLLECTIVE_KINDS` value (a `Collective` member is accepted and stored as its value)."""
    latency: float
    """Seconds per algorithm step of this kind (alpha)."""
    bandwidth: float
    """Achieved bytes/s per device for this kind: efficiency already included (unlike `NetworkTier.bandwidth`)."""

    def __post_init__(self) -> None:
        kind = str(self.kind)
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"unknown collective kind {self.kind!r} in a per-collective link; valid: "
                             f"{', '.join(COLLECTIVE_KINDS)}")
        object.__setattr__(self, "kind", kind)
        if not (isinstance(self.latency, int | float) and self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"{kind} link: latency must be a finite number >= 0 seconds, got {self.latency!r}")
        if not (isinstance(self.bandwidth, int | float) and self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"{kind} link: bandwidth must be a finite positive bytes/s, got {self.bandwidth!r}")

    def to_dict(self) -> dict[str, float]:
        return {"latency": self.latency, "bandwidth": self.bandwidth}


@dataclass(frozen=True)
class NetworkTier:
    name: str
    """"node", "rack", "building", "datacenter", ... (free text, unique within a cluster)."""
    size: int
    """Devices inside one domain of this tier (8 for a DGX node)."""
    bandwidth: float
    """Bytes/s per device, unidirectional, for traffic that crosses into this tier (spec value)."""
    latency: float
    """Seconds per message hop (the alpha of alpha-beta)."""
    source: str = ""
    efficiency: float = 1.0
    """Achievable fraction of `bandwidth` for large collectives (NCCL bus bandwidth / spec)."""
    in_network_reduction_efficiency: float = 0.0
    """Fraction of `bandwidth` an in-switch all-reduce reaches (NVLink SHARP, InfiniBand SHARP); 0 = none."""
    in_network_reduction_latency: float = 0.0
    """Fixed seconds of one in-switch all-reduce."""
    link: str = ""
    """Link type of `costmodel/hardware/data/links.csv` the defaults came from ("" when given explicitly)."""
    per_collective: tuple[CollectiveLink, ...] = ()
    """Per-kind overrides of `latency` and `effective_bandwidth` (sorted by kind, kinds distinct); the in-network
    reduction fields are not overridden. Edits of `latency`, `bandwidth` or `efficiency` leave them as they are."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("network tier needs a non-empty name")
        self._check_per_collective()
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"tier {self.name!r}: size must be a positive integer, got {self.size!r}")
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"tier {self.name!r}: bandwidth must be positive bytes/s, got {self.bandwidth!r}")
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"tier {self.name!r}: latency must be >= 0 seconds, got {self.latency!r}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"tier {self.name!r}: efficiency must be in (0, 1], got {self.efficiency!r}")
        if not 0 <= self.in_network_reduction_efficiency <= 1:
            raise ValueError(f"tier {self.name!r}: in_network_reduction_efficiency must be in [0, 1], "
                             f"got {self.in_network_reduction_efficiency!r}")
        if not (self.in_network_reduction_latency >= 0 and math.isfinite(self.in_network_reduction_latency)):
            raise ValueError(f"tier {self.name!r}: in_network_reduction_latency must be >= 0 seconds")

    def _check_per_collective(self) -> None:
        links = tuple(self.per_collective)
        bad = [x for x in links if not isinstance(x, CollectiveLink)]
        if bad:
            raise ValueError(f"tier {self.name!r}: per_collective must hold CollectiveLink values, got {bad[0]!r}")
        kinds = [x.kind for x in links]
        dup = sorted({k for k in kinds if kinds.count(k) > 1})
        if dup:
            raise ValueError(f"tier {self.name!r}: per_collective lists kind {dup[0]!r} more than once; give each "
                             f"kind at most one link")
        # Sorted so that equal overrides compare (and serialize) equal whatever order they were given in.
        object.__setattr__(self, "per_collective", tuple(sorted(links, key=lambda x: x.kind)))

    def link_for(self, kind: str) -> tuple[float, float]:
        """(effective bandwidth bytes/s, latency s) a `kind` collective gets on this tier."""
        for x in self.per_collective:
            if x.kind == kind:
                return x.bandwidth, x.latency
        return self.effective_bandwidth, self.latency

    @property
    def effective_bandwidth(self) -> float:
        """Bytes/s per device that collectives reach on large messages."""
        return self.bandwidth * self.efficiency

    @property
    def has_in_network_reduction(self) -> bool:
        return self.in_network_reduction_efficiency > 0

    def to_dict(self) -> dict[str, Any]:
        """`per_collective` appears only when non-empty, so specs (and golden plans) without it are unchanged."""
        out: dict[str, Any] = {
            "name": self.name, "size": self.size, "bandwidth": self.bandwidth, "latency": self.latency,
            "efficiency": self.efficiency, "in_network_reduction_efficiency": self.in_network_reduction_efficiency,
            "in_network_reduction_latency": self.in_network_reduction_latency, "link": self.link,
            "source": self.source}
        if self.per_collective:
            out["per_collective"] = {x.kind: x.to_dict() for x in self.per_collective}
        return out


@dataclass(frozen=True)
class DeviceGroup:
    name: str
    device: DeviceSpec
    num_nodes: int
    devices_per_node: int
    slowdown: Mapping[int, float] = field(default_factory=dict)
    """Device index within the group -> speed factor (0.5 = runs at half speed)."""
    unavailable: frozenset[int] = frozenset()
    """Device indices within the group that cannot be used."""
    price_per_device_hour: float | None = None
    node_tier: NetworkTier | None = None
    """This group's link inside a node when it differs from the cluster's `tiers[0]` (mixed device types)."""
    host_cores: int | None = None
    """Cores the devices of one node compute on when they share them -- CPU "devices" are processes on the
    host's cores, e.g. four ranks on two cores -- else None (each device computes on its own)."""

    def __post_init__(self) -> None:
        for f in ("num_nodes", "devices_per_node"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"group {self.name!r}: {f} must be a positive integer, got {v!r}")
        n = self.num_devices
        for i, s in self.slowdown.items():
            if not 0 <= i < n:
                raise ValueError(f"group {self.name!r}: slowdown device index {i} is outside 0..{n - 1}")
            if not 0 < s <= 1:
                raise ValueError(f"group {self.name!r}: slowdown factor of device {i} must be in (0, 1], got {s!r}")
        for i in self.unavailable:
            if not 0 <= i < n:
                raise ValueError(f"group {self.name!r}: unavailable device index {i} is outside 0..{n - 1}")
        if self.price_per_device_hour is not None and not self.price_per_device_hour >= 0:
            raise ValueError(f"group {self.name!r}: price_per_device_hour must be >= 0, "
                             f"got {self.price_per_device_hour!r}")
        if self.host_cores is not None and (not isinstance(self.host_cores, int) or isinstance(self.host_cores, bool)
                                            or self.host_cores < 1):
            raise ValueError(f"group {self.name!r}: host_cores must be a positive integer, got {self.host_cores!r}")
        if self.node_tier is not None and self.node_tier.size != self.devices_per_node:
            raise ValueError(f"group {self.name!r}: node_tier size {self.node_tier.size} must equal "
                             f"devices_per_node {self.devices_per_node}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def num_available(self) -> int:
        return self.num_devices - len(self.unavailable)

    def speed_of(self, index: int) -> float:
        """Speed factor of device `index` of this group: 0 when unavailable, else its slowdown (1 = nominal)."""
        return 0.0 if index in self.unavailable else float(self.slowdown.get(index, 1.0))

    def to_dict(self) -> dict[str, Any]:
        """`host_cores` appears only when set, so specs (and golden plans) without it are unchanged."""
        out: dict[str, Any] = {
            "name": self.name, "device": self.device.to_dict(), "num_nodes": self.num_nodes,
            "devices_per_node": self.devices_per_node, "price_per_device_hour": self.price_per_device_hour,
            "slowdown": {str(i): float(self.slowdown[i]) for i in sorted(self.slowdown)},
            "unavailable": sorted(self.unavailable),
            "node_tier": self.node_tier.to_dict() if self.node_tier is not None else None}
        if self.host_cores is not None:
            out["host_cores"] = self.host_cores
        return out


@dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[DeviceGroup, ...]
    tiers: tuple[NetworkTier, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "tiers", tuple(self.tiers))
        if not self.groups:
            raise ValueError(f"cluster {self.name!r} has no device groups")
        if not self.tiers:
            raise ValueError(f"cluster {self.name!r} has no network tiers (at least the node tier)")
        if self.num_devices > MAX_DEVICES:
            raise ValueError(f"cluster {self.name!r} has {self.num_devices:,} devices; at most {MAX_DEVICES:,} "
                             f"are supported (a typo in num_nodes or devices_per_node?)")
        _check_unique("group", [g.name for g in self.groups])
        _check_unique("tier", [t.name for t in self.tiers])
        self._check_tier_sizes()

    def _check_tier_sizes(self) -> None:
        node = self.tiers[0]
        for g in self.groups:
            if g.node_tier is None and g.devices_per_node != node.size:
                raise ValueError(f"group {g.name!r} has {g.devices_per_node} devices per node but tier "
                                 f"{node.name!r} has size {node.size}; give the group its own node_tier")
        node_starts = set(self._node_starts())
        for prev, tier in zip(self.tiers, self.tiers[1:], strict=False):
            if tier.size < prev.size:
                raise ValueError(f"tier {tier.name!r} (size {tier.size}) must not be smaller than the tier "
                                 f"inside it, {prev.name!r} (size {prev.size})")
            if prev is not node and tier.size % prev.size:
                raise ValueError(f"tier {tier.name!r} size {tier.size} must be a multiple of tier "
                                 f"{prev.name!r} size {prev.size}")
            bad = [b for b in range(tier.size, self.num_devices, tier.size) if b not in node_starts]
            if bad:
                raise ValueError(f"tier {tier.name!r} (size {tier.size}) would split a node at rank {bad[0]}")
        if self.tiers[-1].size < self.num_devices:
            raise ValueError(f"the outermost tier {self.tiers[-1].name!r} has size {self.tiers[-1].size} but must "
                             f"span all {self.num_devices} devices")

    # ---- construction and serialization --------------------------------------------------------------------

    @classmethod
    def parse(cls, spec: str) -> Cluster:
        """`NODESxGPUSxDEVICE` shorthand or a path to a .yaml/.yml spec (see `costmodel.hardware.cluster_yaml`)."""
        from costmodel.hardware.cluster_yaml import parse_cluster_spec
        return parse_cluster_spec(spec)

    def to_dict(self) -> dict[str, Any]:
        """Normalized, deterministic and complete: `Cluster.from_dict(c.to_dict()) == c`."""
        return {"name": self.name, "groups": [g.to_dict() for g in self.groups],
                "tiers": [t.to_dict() for t in self.tiers]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        """Inverse of `to_dict`; also accepts the (less explicit) YAML spec form."""
        from costmodel.hardware.cluster_yaml import cluster_from_dict
        return cluster_from_dict(d)

    # ---- sizes ------------------------------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        """Device slots, unavailable ones included (see the module docstring)."""
        return self._num_device_slots

    @property
    def num_available(self) -> int:
        return sum(g.num_available for g in self.groups)

    @property
    def num_nodes(self) -> int:
        return sum(g.num_nodes for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        return len({g.device.name for g in self.groups}) == 1

    @property
    def price_per_hour(self) -> float | None:
        """Price of the available devices per hour; None when a group has no price."""
        if any(g.price_per_device_hour is None for g in self.groups):
            return None
        return sum(g.price_per_device_hour * g.num_available for g in self.groups)  # type: ignore[operator]

    # ---- ranks ------------------------------------------------------------------------------------------------

    # Derived lookup tables, computed once per (immutable) instance; they are not fields.
    @functools.cached_property
    def _group_start_list(self) -> tuple[int, ...]:
        starts, total = [], 0
        for g in self.groups:
            starts.append(total)
            total += g.num_devices
        return tuple(starts)

    @functools.cached_property
    def _num_device_slots(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @functools.cached_property
    def _speed_list(self) -> tuple[float, ...]:
        return tuple(g.speed_of(i) for g in self.groups for i in range(g.num_devices))

    @functools.cached_property
    def _available_rank_list(self) -> tuple[int, ...]:
        return tuple(r for r, speed in enumerate(self._speed_list) if speed > 0)

    @functools.cached_property
    def _node_start_list(self) -> tuple[int, ...]:
        starts: list[int] = []
        for g, g0 in zip(self.groups, self._group_start_list, strict=True):
            starts.extend(range(g0, g0 + g.num_devices, g.devices_per_node))
        return tuple(starts)

    @functools.cached_property
    def _uniform_node_size(self) -> int | None:
        sizes = {g.devices_per_node for g in self.groups}
        return sizes.pop() if len(sizes) == 1 else None

    def _group_starts(self) -> tuple[int, ...]:
        return self._group_start_list

    def _node_starts(self) -> tuple[int, ...]:
        return self._node_start_list

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.num_devices:
            raise ValueError(f"rank {rank!r} is outside 0..{self.num_devices - 1} of cluster {self.name!r}")

    def group_index_of(self, rank: int) -> int:
        self._check_rank(rank)
        return bisect.bisect_right(self._group_starts(), rank) - 1

    def group_of(self, rank: int) -> DeviceGroup:
        return self.groups[self.group_index_of(rank)]

    def local_index(self, rank: int) -> int:
        """Index of `rank` within its device group (what `slowdown` and `unavailable` are keyed by)."""
        return rank - self._group_starts()[self.group_index_of(rank)]

    def group_ranks(self, group_index: int) -> range:
        """Global ranks of device group `group_index`."""
        start = self._group_starts()[group_index]
        return range(start, start + self.groups[group_index].num_devices)

    def device_of(self, rank: int) -> DeviceSpec:
        return self.group_of(rank).device

    def speed_of(self, rank: int) -> float:
        """Speed factor of `rank`: 1 nominal, 0.5 half speed, 0 unavailable."""
        self._check_rank(rank)
        return self._speed_list[rank]

    @functools.cached_property
    def shares_host_cores(self) -> bool:
        """Whether some group's devices share host cores (then speeds depend on how many are busy at once)."""
        return any(g.host_cores is not None for g in self.groups)

    def compute_speeds(self, ranks: Sequence[int], busy_fraction: float = 1.0) -> tuple[float, ...]:
        """Speed of each of the distinct devices `ranks` when they run one job: `speed_of`, times, on a node of a
        group with `host_cores` C, min(1, C / (busy_fraction * n)) where n of the node's devices are in `ranks`.
        On average busy_fraction * n of them compute at once (the others wait in a pipeline bubble), and the
        scheduler shares the cores evenly among them. Sharing changes speed, not work: busy_fraction * n <= C
        leaves every device at its own speed."""
        if not 0 < busy_fraction <= 1:
            raise ValueError(f"busy_fraction must be in (0, 1], got {busy_fraction!r}")
        speeds = [self.speed_of(r) for r in ranks]
        if not self.shares_host_cores:
            return tuple(speeds)
        per_node = Counter(self.node_of(r) for r in ranks)
        out = []
        for r, s in zip(ranks, speeds, strict=True):
            cores = self.group_of(r).host_cores
            if cores is not None:
                s *= min(1.0, cores / (busy_fraction * per_node[self.node_of(r)]))
            out.append(s)
        return tuple(out)

    def is_available(self, rank: int) -> bool:
        return self.speed_of(rank) > 0

    def available_ranks(self) -> tuple[int, ...]:
        return self._available_rank_list

    def node_of(self, rank: int) -> int:
        """Global node index of `rank` (nodes numbered across groups in rank order)."""
        self._check_rank(rank)
        return bisect.bisect_right(self._node_starts(), rank) - 1

    # ---- network ----------------------------------------------------------------------------------------------

    def node_tier_of(self, group_index: int) -> NetworkTier:
        """The link inside the nodes of device group `group_index`."""
        return self.groups[group_index].node_tier or self.tiers[0]

    def tier_index(self, name: str) -> int:
        for i, t in enumerate(self.tiers):
            if t.name == name:
                return i
        raise ValueError(f"cluster {self.name!r} has no tier {name!r}; tiers: {', '.join(t.name for t in self.tiers)}")

    def domain_counts(self, size: int, stride: int = 1, start: int = 0) -> tuple[int, ...]:
        """For the ranks start, start+stride, ... (`size` of them): how many distinct domains of each tier they
        touch (tier 0: nodes). The last entry is 1 because the outermost tier spans the cluster."""
        ranks = _group_ranks(self, size, stride, start)
        node_size = self._uniform_node_size
        if node_size is not None:
            counts = [_blocks_touched(ranks, node_size)]
        else:
            node_starts = self._node_starts()
            counts = [len({bisect.bisect_right(node_starts, r) for r in ranks})]
        counts += [_blocks_touched(ranks, t.size) for t in self.tiers[1:]]
        return tuple(counts)

    def tier_index_spanned(self, size: int, stride: int = 1, start: int = 0) -> int | None:
        """Index of the slowest (outermost) tier that the group of `size` ranks `start, start+stride, ...` crosses;
        None for a single rank. A group spans tier t when it has ranks in several tier-(t-1) domains of one
        tier-t domain (for tier 0: several ranks in one node)."""
        counts = (size, *self.domain_counts(size, stride, start))
        spanned = [t for t in range(len(self.tiers)) if counts[t] > counts[t + 1]]
        return spanned[-1] if spanned else None

    def tier_spanned(self, size: int, stride: int = 1, start: int = 0) -> NetworkTier | None:
        t = self.tier_index_spanned(size, stride, start)
        return None if t is None else self.tiers[t]

    # ---- what-if edits (each returns a new, validated cluster) ------------------------------------------------

    def with_tier(self, name: str, **changes: Any) -> Cluster:
        """A copy with fields of tier `name` replaced, e.g. `with_tier("datacenter", bandwidth=2 * bw)`."""
        i = self.tier_index(name)
        tiers = list(self.tiers)
        tiers[i] = dataclasses.replace(tiers[i], **changes)
        groups = self.groups
        if i == 0:  # a node-tier edit applies to the groups' own node tiers too
            groups = tuple(g if g.node_tier is None else
                           dataclasses.replace(g, node_tier=dataclasses.replace(g.node_tier, **changes))
                           for g in self.groups)
        return dataclasses.replace(self, tiers=tuple(tiers), groups=groups)

    def with_speed(self, rank: int, factor: float) -> Cluster:
        """A copy where device `rank` runs at `factor` (0 marks it unavailable)."""
        gi, local = self.group_index_of(rank), self.local_index(rank)
        g = self.groups[gi]
        slowdown = {i: s for i, s in g.slowdown.items() if i != local}
        unavailable = set(g.unavailable) - {local}
        if factor == 0:
            unavailable.add(local)
        elif factor != 1:
            slowdown[local] = factor
        new = dataclasses.replace(g, slowdown=dict(sorted(slowdown.items())), unavailable=frozenset(unavailable))
        return dataclasses.replace(self, groups=self.groups[:gi] + (new,) + self.groups[gi + 1:])


def _check_unique(kind: str, names: list[str]) -> None:
    seen = set()
    for n in names:
        if n in seen:
            raise ValueError(f"duplicate {kind} name {n!r}; {kind} names must be distinct")
        seen.add(n)


def _blocks_touched(ranks: range, block: int) -> int:
    """Distinct values of r // block over an arithmetic progression of ranks. The values never decrease; a stride
    below the block size never skips a block, a stride of at least the block size never repeats one."""
    if ranks.step >= block:
        return len(ranks)
    return ranks[-1] // block - ranks[0] // block + 1


def _group_ranks(cluster: Cluster, size: int, stride: int, start: int) -> range:
    for name, v in (("size", size), ("stride", stride)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"communication group {name} must be a positive integer, got {v!r}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"communication group start must be a rank >= 0, got {start!r}")
    last = start + (size - 1) * stride
    if last >= cluster.num_devices:
        raise ValueError(f"communication group of {size} ranks with stride {stride} from rank {start} reaches rank "
                         f"{last}, but cluster {cluster.name!r} has {cluster.num_devices} devices")
    return range(start, last + 1, stride)
