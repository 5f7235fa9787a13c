"""The device and link catalogs: `costmodel/hardware/data/devices.csv` and `costmodel/hardware/data/links.csv`, as typed values.

Every number in those files has a source column (a datasheet, a public measurement, or a measurement on this
build machine for `cpu`); where a value is a documented default rather than a measurement, the source says why.
The measured rows used to derive efficiencies and link calibrations are copied beside them
(`measured_matmul.csv`, `measured_memory.csv`, `measured_collectives.csv`) so the package never reads files
outside itself and the tests can re-derive every calibrated number.

Units in the CSV are the ones datasheets use (TFLOP/s, GB, TB/s, GB/s, microseconds); the loaded values are SI
(FLOP/s, bytes, bytes/s, seconds). GB and TB are decimal (1e9, 1e12), as on the datasheets.

Device memory is what the driver reports where a public nvidia-smi figure exists (`reported_memory_mib`): a
datasheet's "80 GB" HBM is 80 GiB of stacks, of which the H100 exposes 81,559 MiB (79.6 GiB) and the A100 81,920
MiB -- 7% more than 80e9 bytes, the difference between a configuration that fits and one that must recompute.
Devices without such a figure keep the datasheet count in decimal GB (the lower, safe reading).
"""

from __future__ import annotations

import csv
import functools
import io
from dataclasses import dataclass
from importlib import resources

from costmodel.hardware.device import DeviceSpec

FP8_DTYPE = "float8_e4m3fn"
"""The FP8 format of forward GEMM operands (torchao's float8 training default; the catalog's FP8 peak column)."""

_PEAK_COLUMNS: tuple[tuple[str, str], ...] = (
    ("peak_bf16_tflops", "bfloat16"),
    ("peak_fp16_tflops", "float16"),
    ("peak_fp8_tflops", FP8_DTYPE),
    ("peak_fp32_tflops", "float32"),
    ("peak_tf32_tflops", "tf32"),
)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """Calibration of one link type for the collective model (`costmodel.hardware.collectives`)."""

    name: str
    description: str
    efficiency: float
    """Achievable fraction of the spec bandwidth for ring/tree traffic of large messages."""
    latency: float
    """Seconds per algorithm step (the alpha of alpha-beta)."""
    in_network_reduction_efficiency: float
    """Fraction of spec bandwidth reached by in-switch all-reduce (NVLink SHARP); 0 when the link has none."""
    in_network_reduction_latency: float
    """Fixed seconds of one in-switch all-reduce."""
    source: str


def _read_csv(name: str) -> list[dict[str, str]]:
    text = resources.files("costmodel.hardware").joinpath("data", name).read_text(encoding="utf-8")
    return list(csv.DictReader(io.StringIO(text)))


def _optional_float(text: str) -> float | None:
    text = text.strip()
    return float(text) if text else None


def _memory_bytes(row: dict[str, str]) -> int:
    """Device memory: the driver's figure where one is cited, else the datasheet's decimal GB (module docstring)."""
    reported = row["reported_memory_mib"].strip()
    return int(reported) * 2 ** 20 if reported else round(float(row["memory_gb"]) * 1e9)


def _device_from_row(row: dict[str, str]) -> DeviceSpec:
    peaks = {dtype: float(row[col]) * 1e12 for col, dtype in _PEAK_COLUMNS if row[col].strip()}
    return DeviceSpec(
        name=row["name"],
        display_name=row["display_name"],
        peak_flops=peaks,
        matmul_efficiency=float(row["matmul_efficiency"]),
        memory_bytes=_memory_bytes(row),
        memory_bandwidth=float(row["memory_bandwidth_tbps"]) * 1e12,
        memory_efficiency=float(row["memory_efficiency"]),
        intra_node_bandwidth=float(row["intra_node_gbps"]) * 1e9,
        inter_node_bandwidth=float(row["inter_node_gbps"]) * 1e9,
        sources={
            "peak_flops": row["source_peak"],
            "matmul_efficiency": row["source_matmul_efficiency"],
            "memory_bytes": row["source_reported_memory"] or row["source_memory"],
            "memory_bandwidth": row["source_memory_bandwidth"],
            "memory_efficiency": row["source_memory_efficiency"],
            "intra_node_bandwidth": row["source_intra_node"],
            "inter_node_bandwidth": row["source_inter_node"],
            "training_efficiency": row["source_training_efficiency"],
            "prediction_error": row["source_prediction_error"],
            "best_published_mfu": row["source_best_published_mfu"],
        },
        intra_node_link=row["intra_node_link"],
        inter_node_link=row["inter_node_link"],
        training_efficiency=float(row["training_efficiency"] or 1.0),
        prediction_error=_optional_float(row["prediction_error"]),
        best_published_mfu=_optional_float(row["best_published_mfu"]),
    )


@functools.cache
def _devices() -> tuple[tuple[DeviceSpec, ...], dict[str, str]]:
    """(devices in file order, lower-case name or alias -> catalog name). Read once; the result is immutable."""
    devices, names = [], {}
    for row in _read_csv("devices.csv"):
        device = _device_from_row(row)
        devices.append(device)
        for key in (device.name, *filter(None, (a.strip() for a in row["aliases"].split(";")))):
            names[key.lower()] = device.name
    return tuple(devices), names


@functools.cache
def _links() -> dict[str, LinkSpec]:
    out = {}
    for row in _read_csv("links.csv"):
        out[row["link"]] = LinkSpec(
            name=row["link"], description=row["description"], efficiency=float(row["efficiency"]),
            latency=float(row["latency_us"]) * 1e-6,
            in_network_reduction_efficiency=_optional_float(row["in_network_reduction_efficiency"]) or 0.0,
            in_network_reduction_latency=(_optional_float(row["in_network_reduction_latency_us"]) or 0.0) * 1e-6,
            source=row["source"])
    return out


def list_devices() -> tuple[DeviceSpec, ...]:
    """Every catalog device, in catalog order."""
    return _devices()[0]


def device_names() -> tuple[str, ...]:
    """Catalog keys (lower case), in catalog order; aliases such as "h100" are accepted by `get_device` too."""
    return tuple(d.name for d in list_devices())


def get_device(name: str) -> DeviceSpec:
    """The catalog device called `name` (case-insensitive; aliases allowed). Unknown names raise ValueError
    listing the valid ones."""
    devices, names = _devices()
    key = names.get(str(name).strip().lower())
    if key is None:
        raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(device_names())}")
    return next(d for d in devices if d.name == key)


@functools.cache
def _fp8_matmul() -> dict[str, float]:
    return {row["device"]: float(row["measured_fp8_tflops"]) / float(row["peak_fp8_tflops"])
            for row in _read_csv("fp8_matmul.csv")}


def fp8_matmul_efficiency(device: DeviceSpec) -> float:
    """Best achievable fraction of the FP8 peak for large FP8 GEMMs: the measured FP8 max-achievable matmul over
    the FP8 peak (`fp8_matmul.csv`, each row cited); a device without an FP8 measurement gets its BF16
    `matmul_efficiency` (on the measured devices the two are within 0.1: H100 0.709 vs 0.803, B200 0.763 vs
    0.776). Raises ValueError for a device without FP8 tensor cores."""
    if FP8_DTYPE not in device.peak_flops:
        raise ValueError(f"device {device.name} has no FP8 tensor cores (no {FP8_DTYPE} peak)")
    return _fp8_matmul().get(device.name, device.matmul_efficiency)


def list_links() -> tuple[LinkSpec, ...]:
    return tuple(_links().values())


def get_link(name: str) -> LinkSpec:
    """The link calibration called `name` ("nvlink4", "nic", ...); unknown names raise ValueError listing them."""
    links = _links()
    if name not in links:
        raise ValueError(f"unknown link type {name!r}; valid link types: {', '.join(links)}")
    return links[name]


# A device the catalog does not know (an inline device in a cluster YAML without link names) gets the
# conservative calibrations: PCIe inside the node, the measured NIC between nodes.
FALLBACK_INTRA_NODE_LINK = "pcie"
FALLBACK_INTER_NODE_LINK = "nic"


def intra_node_link_of(device: DeviceSpec) -> LinkSpec:
    return get_link(device.intra_node_link or FALLBACK_INTRA_NODE_LINK)


def inter_node_link_of(device: DeviceSpec) -> LinkSpec:
    return get_link(device.inter_node_link or FALLBACK_INTER_NODE_LINK)
