"""Cost model: devices, clusters, operator and collective prices, memory, and step-time estimates.

The package exports the value types; `costmodel.estimate` is the module whose `estimate` prices a strategy (no
submodule name is rebound to a function)."""

from costmodel.breakdown import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.device import DeviceSpec
from costmodel.hardware.device_group import DeviceGroup
from costmodel.hardware.network import NetworkTier
from costmodel.layer_cost import LayerCost
from costmodel.strategy import MeshAxis, Recompute, RuntimeOptions, Schedule, StageSpec, Strategy

__all__ = [
    "Cluster", "DeviceGroup", "DeviceSpec", "Estimate", "LayerCost", "MemoryBreakdown", "MeshAxis",
    "NetworkTier", "Recompute", "RuntimeOptions", "Schedule", "StageEstimate", "StageSpec", "Strategy", "TimeBreakdown",
]
