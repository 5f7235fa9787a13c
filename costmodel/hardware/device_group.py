"""A device group: nodes of one device type, with the devices that are slow, failed or share host cores."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from costmodel.hardware.device import DeviceSpec
from costmodel.hardware.network import NetworkTier


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
