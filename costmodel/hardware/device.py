"""Device specifications: what one accelerator can compute, hold and move. Values come from the catalog
(`costmodel/hardware/data/devices.csv`), each with its source; `cpu` is filled from a profile of this machine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator type. Bandwidths are bytes/s, unidirectional, per device; FLOP/s are dense."""

    name: str
    """Catalog key, lower case: "a100-80gb", "h100-sxm", "cpu"."""
    display_name: str
    peak_flops: Mapping[str, float]
    """Dense peak FLOP/s per compute dtype ("bfloat16", "float16", "float32", "float8_e4m3fn", "tf32")."""
    matmul_efficiency: float
    """Best achievable fraction of peak for large GEMMs (measured max-achievable-matmul / peak)."""
    memory_bytes: int
    memory_bandwidth: float
    memory_efficiency: float
    """Achievable fraction of `memory_bandwidth` (STREAM-like measurement / spec)."""
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    sources: Mapping[str, str] = field(default_factory=dict)
    """Field name -> where its value comes from."""
    intra_node_link: str = ""
    """Link type inside a node ("nvlink4", "pcie", ...): a row of `costmodel/hardware/data/links.csv` that calibrates the
    achievable fraction and per-hop latency of collectives; empty for a device the catalog does not know."""
    inter_node_link: str = ""
    """Link type of the per-device NIC between nodes ("nic"); see `intra_node_link`."""
    training_efficiency: float = 1.0
    """Fraction of the per-kernel roofline (`costmodel.operators`) a sustained training step reaches: clocks under
    the power limit, gaps and tails between kernels, GEMM shapes below the best measured one. Fitted per device
    class to published runs, leave-one-out (`bench/published_runs.py --fit`; the catalog's source column has the
    value, the data and the error); 1 where the times are measured (`cpu`, a profile)."""

    prediction_error: float | None = None
    """Mean relative step-time error of the model on published runs of this device type (leave-one-out), or
    None where none were checked (`costmodel.validation`)."""
    best_published_mfu: float | None = None
    """The highest MFU a published training run reached on this device type: no prediction should exceed it."""

    def __post_init__(self) -> None:
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError(f"device {self.name}: peak_flops must be positive")
        for f in ("matmul_efficiency", "memory_efficiency", "training_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"device {self.name}: {f} must be in (0, 1]")
        for f in ("prediction_error", "best_published_mfu"):
            v = getattr(self, f)
            if v is not None and not 0 < v < 1:
                raise ValueError(f"device {self.name}: {f} must be in (0, 1) or unset, got {v!r}")
        for f in ("memory_bytes", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            if getattr(self, f) <= 0:
                raise ValueError(f"device {self.name}: {f} must be positive")

    def flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a dtype; float32 matmuls use TF32 tensor cores where the device has them."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "bfloat16" and "float16" in self.peak_flops:
            return self.peak_flops["float16"]
        raise ValueError(f"device {self.name} has no {dtype} peak; known: {', '.join(sorted(self.peak_flops))}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "display_name": self.display_name, "peak_flops": dict(sorted(self.peak_flops.items())),
            "matmul_efficiency": self.matmul_efficiency, "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth, "memory_efficiency": self.memory_efficiency,
            "intra_node_bandwidth": self.intra_node_bandwidth, "inter_node_bandwidth": self.inter_node_bandwidth,
            "sources": dict(sorted(self.sources.items())),
            "intra_node_link": self.intra_node_link, "inter_node_link": self.inter_node_link,
            "training_efficiency": self.training_efficiency, "prediction_error": self.prediction_error,
            "best_published_mfu": self.best_published_mfu,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
