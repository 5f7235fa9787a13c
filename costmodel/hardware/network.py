"""Network tiers: the links a cluster's devices communicate over, one `NetworkTier` per level (node, rack,
building, datacenter), innermost first.

Bandwidths are per device and unidirectional: a tier's `bandwidth` is what each device gets when every device
under it sends through the tier at once (a rack uplink of 400 GB/s shared by 32 GPUs is 12.5 GB/s per device).
`efficiency` is the achievable fraction of it for collectives (calibrated in `costmodel/hardware/data/links.csv`).

One latency and one bandwidth per tier under-price some collectives: gloo on 2 CPU ranks measured 96 us per
all-reduce step but 170 us per reduce-scatter step, and reduce-scatter reached ~1/3 of all-reduce's bandwidth at
4 MB. `NetworkTier.per_collective` therefore holds optional per-kind `CollectiveLink` overrides (achieved
bandwidth and per-step latency) that `costmodel.hardware.collectives` uses for that kind instead of the tier's
defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from costmodel.hardware.collective_kind import Collective

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
