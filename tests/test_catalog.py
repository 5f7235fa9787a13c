"""The device and link catalogs: every value sourced, datasheet spot checks, and every calibrated number
re-derived from the measured rows copied into costmodel/data."""

from __future__ import annotations

import csv
import statistics
from importlib import resources

import pytest

from costmodel.hardware.catalog import device_names, get_device, get_link, list_devices, list_links
from costmodel.hardware.device import DeviceSpec

REQUIRED = ("v100-32gb", "a100-40gb", "a100-80gb", "h100-sxm", "h200", "h800", "b200", "mi250x", "mi300x", "l4", "a10g",
            "t4", "tpu-v4", "tpu-v5e", "cpu")
SOURCED_FIELDS = ("peak_flops", "matmul_efficiency", "memory_bytes", "memory_bandwidth", "memory_efficiency",
                  "intra_node_bandwidth", "inter_node_bandwidth")


def _rows(name: str) -> list[dict[str, str]]:
    text = resources.files("costmodel.hardware").joinpath("data", name).read_text(encoding="utf-8")
    return list(csv.DictReader(text.splitlines()))


def test_catalog_has_exactly_the_required_devices_in_order():
    assert device_names() == REQUIRED


@pytest.mark.parametrize("name", REQUIRED)
def test_every_value_has_a_source(name):
    d = get_device(name)
    for f in SOURCED_FIELDS:
        assert len(d.sources.get(f, "").strip()) > 10, f"{name}.{f} has no source"
    assert d.intra_node_link and d.inter_node_link
    get_link(d.intra_node_link), get_link(d.inter_node_link)  # both calibrations exist


def test_every_csv_value_column_has_a_filled_source_column():
    value_to_source = {"peak_bf16_tflops": "source_peak", "matmul_efficiency": "source_matmul_efficiency",
                       "memory_gb": "source_memory", "reported_memory_mib": "source_reported_memory",
                       "memory_bandwidth_tbps": "source_memory_bandwidth",
                       "memory_efficiency": "source_memory_efficiency", "intra_node_gbps": "source_intra_node",
                       "inter_node_gbps": "source_inter_node"}
    for row in _rows("devices.csv"):
        for value, source in value_to_source.items():
            if row[value].strip():
                assert row[source].strip(), (row["name"], value)
    for row in _rows("links.csv"):
        assert len(row["source"]) > 20, row["link"]


@pytest.mark.parametrize(("name", "dtype", "tflops"), [
    ("h100-sxm", "bfloat16", 989), ("h100-sxm", "float8_e4m3fn", 1979), ("a100-80gb", "bfloat16", 312),
    ("a100-40gb", "tf32", 156), ("b200", "bfloat16", 2250), ("mi300x", "bfloat16", 1307), ("v100-32gb", "float16", 125),
    ("t4", "float16", 65), ("tpu-v4", "bfloat16", 275), ("tpu-v5e", "bfloat16", 197), ("h200", "float32", 67),
    ("h800", "bfloat16", 989), ("h800", "float8_e4m3fn", 1979)])
def test_datasheet_peaks(name, dtype, tflops):
    assert get_device(name).flops(dtype) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize(("name", "mem_gb", "bw_tbps", "intra_gbps", "inter_gbps"), [
    ("a100-80gb", 80, 2.039, 300, 25), ("a100-40gb", 40, 1.555, 300, 25), ("h100-sxm", 80, 3.35, 450, 50),
    ("h200", 141, 4.8, 450, 50), ("h800", 80, 3.35, 200, 50), ("b200", 180, 8.0, 900, 50), ("v100-32gb", 32, 0.9, 150, 6.25),
    ("mi300x", 192, 5.3, 448, 50), ("l4", 24, 0.3, 31, 1.5625), ("tpu-v4", 32, 1.2, 90, 6.25)])
def test_datasheet_memory_and_links(name, mem_gb, bw_tbps, intra_gbps, inter_gbps):
    d = get_device(name)
    # the driver's figure (a little under mem_gb GiB) where one is cited, else the decimal datasheet figure
    assert mem_gb * 10**9 <= d.memory_bytes <= mem_gb * 2**30
    assert d.memory_bandwidth == pytest.approx(bw_tbps * 1e12)
    assert d.intra_node_bandwidth == pytest.approx(intra_gbps * 1e9)
    assert d.inter_node_bandwidth == pytest.approx(inter_gbps * 1e9)


def test_devices_without_bf16_fall_back_to_fp16_and_missing_dtypes_list_known_ones():
    assert get_device("t4").flops("bfloat16") == 65e12
    assert get_device("v100-32gb").flops("bfloat16") == 125e12
    with pytest.raises(ValueError, match=r"tpu-v4 has no float32 peak; known: bfloat16"):
        get_device("tpu-v4").flops("float32")


def test_lookup_is_case_insensitive_with_aliases_and_errors_list_valid_names():
    assert get_device("H100").name == "h100-sxm"
    assert get_device(" A100-80GB ").name == "a100-80gb"
    with pytest.raises(ValueError) as e:
        get_device("a100")
    msg = str(e.value)
    assert "unknown device 'a100'" in msg and all(n in msg for n in REQUIRED)
    with pytest.raises(ValueError, match="valid link types: nvlink2, nvlink3"):
        get_link("nvlink9")


def test_device_round_trips_through_dict():
    for d in list_devices():
        assert DeviceSpec.from_dict(d.to_dict()) == d


def _mamf() -> dict[str, tuple[float, float, str]]:
    return {r["accelerator"]: (float(r["measured_tflops"]), float(r["peak_tflops"]), r["vendor"])
            for r in _rows("measured_matmul.csv")}


def test_matmul_efficiency_is_measured_over_catalog_peak():
    m = _mamf()
    measured = {"a100-80gb": "NVIDIA A100 SXM", "a100-40gb": "NVIDIA A100 SXM", "h100-sxm": "NVIDIA H100 SXM",
                "h200": "NVIDIA H100 SXM", "h800": "NVIDIA H100 SXM", "b200": "NVIDIA B200 SXM", "mi300x": "AMD MI300X"}
    for name, row in measured.items():
        d = get_device(name)
        assert d.matmul_efficiency == pytest.approx(m[row][0] * 1e12 / d.flops("bfloat16"), abs=1e-4), name


def test_unmeasured_matmul_efficiency_is_the_documented_median():
    m = _mamf()
    nvidia = statistics.median(v / p for v, p, vendor in m.values() if vendor == "nvidia")
    amd = statistics.median(v / p for v, p, vendor in m.values() if vendor == "amd")
    everyone = statistics.median(v / p for v, p, _ in m.values())
    for name in ("v100-32gb", "l4", "a10g", "t4"):
        assert get_device(name).matmul_efficiency == pytest.approx(nvidia, abs=1e-4)
    assert get_device("mi250x").matmul_efficiency == pytest.approx(amd, abs=1e-4)
    for name in ("tpu-v4", "tpu-v5e"):
        assert get_device(name).matmul_efficiency == pytest.approx(everyone, abs=1e-3)


def test_memory_efficiency_is_stream_copy_over_spec_or_their_mean():
    rows = {r["device"]: float(r["copy_tbps"]) / float(r["spec_tbps"]) for r in _rows("measured_memory.csv")}
    for name, frac in rows.items():
        assert get_device(name).memory_efficiency == pytest.approx(frac, abs=1e-3)
    mean = statistics.mean(rows.values())
    for name in ("v100-32gb", "b200", "mi250x", "mi300x", "l4", "a10g", "t4", "tpu-v4", "tpu-v5e"):
        assert get_device(name).memory_efficiency == pytest.approx(mean, abs=1e-3)


def _busbw(system_prefix: str, label: str, ranks: int = 8, algorithm: str | None = None) -> tuple[float, int]:
    for r in _rows("measured_collectives.csv"):
        if (r["system"].startswith(system_prefix) and r["message_label"] == label and int(r["ranks"]) == ranks
                and (algorithm is None or r["algorithm"] == algorithm)):
            return float(r["busbw_gbps"]) * 1e9, int(r["message_bytes"])
    raise AssertionError(f"no row {system_prefix} {label} {ranks}")


def _ring_alpha(busbw: float, nbytes: int, n: int, ring_bw: float) -> float:
    """Per-step latency that makes the ring all-reduce model reproduce a measured bus bandwidth."""
    t = 2 * (n - 1) / n * nbytes / busbw
    return (t - 2 * (n - 1) / n * nbytes / ring_bw) / (2 * (n - 1))


def test_link_calibrations_rederive_from_the_measured_rows():
    nv3, nv4, nv5, nic = (get_link(n) for n in ("nvlink3", "nvlink4", "nvlink5", "nic"))
    bw, _ = _busbw("Azure ND A100", "8G")
    assert nv3.efficiency == pytest.approx(bw / 300e9, abs=1e-4)
    assert nv3.latency == pytest.approx(_ring_alpha(*_busbw("Azure ND A100", "1M"), 8, bw), rel=1e-3)

    ring, _ = _busbw("8x H200 HGX", "8GiB", algorithm="ring")
    assert nv4.efficiency == pytest.approx(ring / 450e9, abs=1e-4)
    alphas = [_ring_alpha(*_busbw(s, "1M"), 8, ring) for s in ("Azure ND H100", "Azure ND H200")]
    assert nv4.latency == pytest.approx(statistics.mean(alphas), rel=1e-3)
    nvls = statistics.mean(_busbw(s, "8G")[0] for s in ("Azure ND H100", "Azure ND H200")) / 1.75
    assert nv4.in_network_reduction_efficiency == pytest.approx(nvls / 450e9, abs=1e-4)
    lat = []
    for s in ("Azure ND H100", "Azure ND H200"):
        b, n = _busbw(s, "134M")
        lat.append(1.75 * n / b - n / nvls)
        assert b > ring  # above the ring's ceiling: NCCL must be running NVLS at this size
    assert nv4.in_network_reduction_latency == pytest.approx(statistics.mean(lat), rel=1e-3)

    ring5, _ = _busbw("AWS p6-b200", "8GiB", algorithm="ring")
    assert nv5.efficiency == pytest.approx(ring5 / 900e9, abs=1e-4)
    assert nv5.latency == pytest.approx(_ring_alpha(*_busbw("Azure ND GB200", "1M", ranks=4), 4, ring5), rel=1e-3)
    assert nv5.in_network_reduction_efficiency == pytest.approx(
        _busbw("AWS p6-b200", "8GiB", algorithm="nvls")[0] / 1.75 / 900e9, abs=1e-4)

    b, n = _busbw("AWS P6-B200", "16GiB", ranks=32)
    t = 2 * 31 / 32 * n / b
    assert nic.efficiency == pytest.approx(2 * 3 / 4 * n / 8 / (50e9 * t), abs=1e-3)
    b, n = _busbw("AWS P6-B200", "16MiB", ranks=32)
    t = 2 * 31 / 32 * n / b  # tree: chain of 7 NVLink 5 steps in the node, log2(4) = 2 steps across, up and down
    tree_bw = max(2 * n / (ring5), 2 * n / 8 / (nic.efficiency * 50e9))
    assert nic.latency == pytest.approx((t - tree_bw - 2 * 7 * nv5.latency) / 4, rel=1e-3)

    gloo = get_link("gloo")
    b, n = _busbw("this build machine", "1KiB", ranks=4)
    assert gloo.latency == pytest.approx(2 * 3 / 4 * n / b / 6, rel=1e-2)
    assert get_device("cpu").intra_node_bandwidth == _busbw("this build machine", "64MiB", ranks=4)[0]


def test_link_table_is_complete_and_plausible():
    names = {link.name for link in list_links()}
    assert {d.intra_node_link for d in list_devices()} | {d.inter_node_link for d in list_devices()} <= names
    for link in list_links():
        assert 0.5 <= link.efficiency <= 1.0 and 0 < link.latency < 1e-3, link.name
        assert (link.in_network_reduction_efficiency > 0) == (link.in_network_reduction_latency > 0)


def test_device_memory_is_the_drivers_figure_where_cited_else_the_datasheets_decimal_gb():
    assert get_device("h100-sxm").memory_bytes == 81559 * 2 ** 20
    assert get_device("a100-80gb").memory_bytes == 80 * 2 ** 30
    assert get_device("mi300x").memory_bytes == 192 * 10 ** 9  # no driver figure cited: the datasheet's 192 GB
    for row in _rows("devices.csv"):
        if row["reported_memory_mib"].strip():
            # the driver never reports more than the stacks' binary capacity, nor less than the decimal figure
            assert float(row["memory_gb"]) * 1e9 <= int(row["reported_memory_mib"]) * 2 ** 20 <= float(row["memory_gb"]) * 2 ** 30
