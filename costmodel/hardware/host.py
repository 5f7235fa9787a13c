"""What a device's host offers for offloading model state (`costmodel.offload`): the host-device link, the host
memory per device and the CPU's Adam throughput per device. Read from `costmodel/hardware/data/host.csv`, each
value with its source; a device the file does not know (an inline device of a cluster YAML, a TPU) has no
`HostSpec`, and plans for it cannot offload.

Per device means the device's share of its node: a node's host memory and CPU cores are split evenly among its
devices, as each rank's process binds its share of them (DeepSpeed `--bind_cores_to_rank`, torchrun's one process
per device). Units in the CSV are GB/s, GB and 1e9 parameters/s; the loaded values are SI.
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources


@dataclass(frozen=True, slots=True)
class HostSpec:
    """The host side of one device type, per device."""

    device: str
    host_to_device_bandwidth: float
    """Bytes/s of a pinned host-to-device copy (the measured achievable rate, not the link's spec)."""
    device_to_host_bandwidth: float
    host_memory_bytes: int
    """The device's share of its node's host memory; 0 where no source gives it (offloading is then refused)."""
    adam_params_per_s: float
    """Parameters per second the device's share of the host CPU updates with Adam (fp32 master, m, v)."""
    host_is_device: bool = False
    """The device is the host's CPU itself (`cpu`): offloading frees no memory, so the search does not try it
    unless pinned (the runtime still runs it, as FSDP2 does on CPU)."""
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("host_to_device_bandwidth", "device_to_host_bandwidth", "adam_params_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"host of {self.device}: {name} must be positive")
        if self.host_memory_bytes < 0:
            raise ValueError(f"host of {self.device}: host_memory_bytes must be >= 0")


def _row_spec(row: dict[str, str]) -> HostSpec | None:
    if not row["host_to_device_gbps"].strip() or not row["cpu_adam_gparams"].strip():
        return None
    memory = row["host_memory_gb"].strip()
    return HostSpec(
        device=row["name"],
        host_to_device_bandwidth=float(row["host_to_device_gbps"]) * 1e9,
        device_to_host_bandwidth=float(row["device_to_host_gbps"]) * 1e9,
        host_memory_bytes=round(float(memory) * 1e9) if memory else 0,
        adam_params_per_s=float(row["cpu_adam_gparams"]) * 1e9,
        host_is_device=row["host_is_device"].strip() == "1",
        sources={"host_link": row["source_host_link"], "host_memory": row["source_host_memory"],
                 "cpu_adam": row["source_cpu_adam"]})


@functools.cache
def _hosts() -> dict[str, HostSpec | None]:
    text = resources.files("costmodel.hardware").joinpath("data", "host.csv").read_text(encoding="utf-8")
    return {row["name"]: _row_spec(row) for row in csv.DictReader(io.StringIO(text))}


def host_of(device_name: str) -> HostSpec | None:
    """The host side of catalog device `device_name`, or None where the catalog has no host data for it."""
    return _hosts().get(device_name)
