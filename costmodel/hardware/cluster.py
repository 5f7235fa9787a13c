"""Cluster specs: device groups and the network tiers that connect them.

A cluster is one or more `DeviceGroup`s (same device type, `num_nodes` x `devices_per_node`) and a list of
`NetworkTier`s ordered innermost first: tier 0 is inside a node (NVLink), then e.g. rack, building,
datacenter. A tier of `size` k means groups of k consecutive devices (global rank order) share that tier's
links; the last tier spans the whole cluster. A communication group's bandwidth is that of the slowest
(outermost) tier it spans.

Global rank order: groups in spec order, nodes in order, devices in order. Ranks are device slots: an unavailable
device keeps its rank (so a spec edit does not renumber the others); `speed_of` is 0 for it and
`available_ranks()` leaves it out.

Bandwidths, efficiencies and per-collective overrides are the tiers' (`costmodel.hardware.network`).

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
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from costmodel.hardware.cluster_yaml import ClusterParts, read_cluster_dict, read_cluster_spec
from costmodel.hardware.device import DeviceSpec
from costmodel.hardware.device_group import DeviceGroup
from costmodel.hardware.network import NetworkTier

MAX_DEVICES = 1 << 20
"""Most devices a cluster spec may have: about ten times the largest announced training cluster (xAI Colossus,
100,000 H100 GPUs, announced September 2024). A bigger count is a typo, and rank tables of that size would
exhaust memory before any error could be reported."""


@dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[DeviceGroup, ...]
    tiers: tuple[NetworkTier, ...]
    expert_imbalance: float | None = None
    """Routed tokens of the busiest expert-parallel rank over the mean in this job (the straggler that routing
    makes, `costmodel.expert_parallel`); None: the cost model's cited default."""

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
        if self.expert_imbalance is not None and not self.expert_imbalance >= 1:
            raise ValueError(f"cluster {self.name!r}: expert_imbalance must be >= 1 (busiest rank / mean), got "
                             f"{self.expert_imbalance!r}")
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
        return cls._assemble(read_cluster_spec(spec))

    def to_dict(self) -> dict[str, Any]:
        """Normalized, deterministic and complete: `Cluster.from_dict(c.to_dict()) == c`."""
        d: dict[str, Any] = {"name": self.name, "groups": [g.to_dict() for g in self.groups],
                             "tiers": [t.to_dict() for t in self.tiers]}
        if self.expert_imbalance is not None:
            d["expert_imbalance"] = self.expert_imbalance
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        """Inverse of `to_dict`; also accepts the (less explicit) YAML spec form."""
        return cls._assemble(read_cluster_dict(d))

    @classmethod
    def _assemble(cls, parts: ClusterParts) -> Cluster:
        """The cluster of parts read from a spec; how they fit together is checked here."""
        try:
            return cls(name=parts.name, groups=parts.groups, tiers=parts.tiers,
                       expert_imbalance=parts.expert_imbalance)
        except ValueError as e:
            if not parts.error_context:
                raise
            raise ValueError(f"{parts.error_context}: {e}") from None

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
    def uniform_speed(self) -> float | None:
        """The speed every device runs at when they all run at one (no straggler, none unavailable), else None."""
        speeds = set(self._speed_list)
        return speeds.pop() if len(speeds) == 1 else None

    @functools.cached_property
    def _node_start_list(self) -> tuple[int, ...]:
        starts: list[int] = []
        for g, g0 in zip(self.groups, self._group_start_list, strict=True):
            starts.extend(range(g0, g0 + g.num_devices, g.devices_per_node))
        return tuple(starts)

    @functools.cached_property
    def derived(self) -> dict[tuple, Any]:
        """A memo of what its users derive from this (immutable) cluster alone, keyed by what they derive it from
        (`collectives.spans` of a rank group): the search prices the same groups tens of thousands of times."""
        return {}

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

    def group_indices_of(self, ranks: Sequence[int], *, ascending: bool = False) -> list[int]:
        """Sorted indices of the device groups that hold `ranks` (one pass of bisection, no per-rank checks beyond
        the range: a pipeline rank of a large mesh holds thousands of ranks); `ascending`: `ranks` are sorted, so
        their range is their ends."""
        if not ranks:
            return []
        lo, hi = (ranks[0], ranks[-1]) if ascending else (min(ranks), max(ranks))
        self._check_rank(lo)
        self._check_rank(hi)
        starts = self._group_start_list
        first, last = bisect.bisect_right(starts, lo) - 1, bisect.bisect_right(starts, hi) - 1
        if first == last:
            return [first]
        return sorted({bisect.bisect_right(starts, r) - 1 for r in ranks})

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
        if ranks:  # validate the range once; the lookups below index directly
            self._check_rank(min(ranks))
            self._check_rank(max(ranks))
        table = self._speed_list
        speeds = [table[r] for r in ranks]
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
