"""Cluster specs: device groups and the network tiers that connect them.

A cluster is one or more `DeviceGroup`s (same device type, `num_nodes` x `devices_per_node`) and a list of
`NetworkTier`s ordered innermost first: tier 0 is inside a node (NVLink), then e.g. rack, building,
datacenter. A tier of `size` k means groups of k consecutive devices (global rank order) share that tier's
links; the last tier spans the whole cluster. A communication group's bandwidth is that of the slowest
(outermost) tier it spans.

`Cluster.parse(spec)` takes the shorthand `NODESxGPUSxDEVICE` (`128x8xa100-80gb`, `1x4xcpu`) or a YAML path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from costmodel.device import DeviceSpec


@dataclass(frozen=True)
class NetworkTier:
    name: str
    """"node", "rack", "building", "datacenter", ... (free text, unique within a cluster)."""
    size: int
    """Devices inside one domain of this tier (8 for a DGX node)."""
    bandwidth: float
    """Bytes/s per device, unidirectional, for traffic that crosses into this tier."""
    latency: float
    """Seconds per message hop (the alpha of alpha-beta)."""
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "bandwidth": self.bandwidth, "latency": self.latency,
                "source": self.source}


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

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def num_available(self) -> int:
        return self.num_devices - len(self.unavailable)


@dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[DeviceGroup, ...]
    tiers: tuple[NetworkTier, ...]

    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @property
    def is_homogeneous(self) -> bool:
        return len({g.device.name for g in self.groups}) == 1
