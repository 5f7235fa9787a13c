"""Reading cluster specs -- the `NODESxGPUSxDEVICE` shorthand, YAML files, and `Cluster.to_dict()` output -- into
the parts `Cluster.parse` and `Cluster.from_dict` assemble.

YAML format (every key but `groups` optional; see examples/clusters/README.md for worked examples):

    name: dgx-a100-128
    groups:                          # in global rank order
      - name: a100                   # default: the device name
        device: a100-80gb            # a catalog name, or a mapping of DeviceSpec fields for a custom device
        num_nodes: 128
        devices_per_node: 8
        price_per_device_hour: 4.10  # USD
        memory: 40GB                 # overrides the device's memory capacity
        slowdown: {3: 0.5}           # device index in the group (node * devices_per_node + local) -> speed
        unavailable: [7]             # device indices in the group that cannot be used
        node_tier: {link: nvlink2}   # this group's own link inside a node (keys as in `tiers`, no size)
        host_cores: 2                # cores a node's devices share (CPU ranks as processes); default: their own
    expert_imbalance: 1.1            # mixture-of-experts jobs: busiest expert-parallel rank's routed tokens / mean
    tiers:                           # innermost first; tiers[0] is the node tier
      - name: node
        size: 8                      # default: devices_per_node
        bandwidth: 300GB/s           # per device, unidirectional; default: the device catalog
        latency: 3us                 # per algorithm step; default: the link calibration
        efficiency: 0.77             # achievable fraction of bandwidth; default: the link calibration
        link: nvlink3                # a row of costmodel/hardware/data/links.csv to take the defaults from
        per_collective:              # optional per-kind figures replacing latency and bandwidth x efficiency
          reduce_scatter: {latency: 170us, bandwidth: 0.4GB/s}   # both keys required; bandwidth is achieved
      - name: rack
        size: 32
        aggregate_bandwidth: 1.6Tb/s # instead of bandwidth: one node's uplink, shared by its devices
      - name: cluster                # the last tier's size defaults to the whole cluster

`per_collective` keys are collective kinds (all_reduce, all_gather, reduce_scatter, all_to_all, send_recv,
broadcast); each gives the per-step `latency` and the *achieved* `bandwidth` per device of that kind (efficiency
already included, as `stratagem profile --collectives` measures it), used instead of the tier's `latency` and
`bandwidth` x `efficiency` for that kind only (in-network reduction figures are not overridden).
`Cluster.to_dict()` writes the same mapping (seconds and bytes/s), and only for tiers that have overrides.

Units (`costmodel.hardware.units`): bandwidth "400Gbps", "400Gb/s", "50GB/s", "1.5TB/s" (or a number in bytes/s); latency "5us", "1.5ms",
"200ns" (or seconds); memory "80GB", "80GiB" (or bytes). Unknown keys and bad values raise ValueError naming the
key path (`groups[1].devices_per_node`) and the valid keys or values.

Defaults: without `tiers`, a node tier (the device's intra-node bandwidth and link calibration) and a cluster tier
(its NIC). When the node tier gives no bandwidth and the groups have different devices, each group gets its own
node tier from its device and `tiers[0]` describes the slowest one. Outer tiers default to the slowest group's
NIC bandwidth and calibration.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.hardware.catalog import (
    LinkSpec,
    device_names,
    get_device,
    get_link,
    inter_node_link_of,
    intra_node_link_of,
    list_links,
)
from costmodel.hardware.device import DeviceSpec
from costmodel.hardware.device_group import DeviceGroup
from costmodel.hardware.network import COLLECTIVE_KINDS, CollectiveLink, NetworkTier
from costmodel.hardware.units import parse_bandwidth, parse_bytes, parse_duration

SHORTHAND_FORM = "NODESxGPUSxDEVICE (e.g. 128x8xa100-80gb or 1x4xcpu)"
_SHORTHAND = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*[xX]\s*([A-Za-z0-9._-]+)\s*$")

_TOP_KEYS = {"name": False, "groups": True, "tiers": False, "expert_imbalance": False}
_GROUP_KEYS = {"name": False, "device": True, "num_nodes": True, "devices_per_node": True,
               "price_per_device_hour": False, "memory": False, "slowdown": False, "unavailable": False,
               "node_tier": False, "host_cores": False}
_TIER_KEYS = {"name": False, "size": False, "bandwidth": False, "aggregate_bandwidth": False, "latency": False,
              "efficiency": False, "link": False, "in_network_reduction_efficiency": False,
              "in_network_reduction_latency": False, "source": False, "per_collective": False}
_COLLECTIVE_LINK_KEYS = {"latency": True, "bandwidth": True}
_DEVICE_KEYS = {"name": True, "display_name": False, "peak_flops": True, "matmul_efficiency": True,
                "memory_bytes": True, "memory_bandwidth": True, "memory_efficiency": True,
                "intra_node_bandwidth": True, "inter_node_bandwidth": True, "sources": False,
                "intra_node_link": False, "inter_node_link": False, "training_efficiency": False,
                "prediction_error": False, "best_published_mfu": False}

MAX_EXPERT_IMBALANCE = 100.0
"""Largest `expert_imbalance` a spec may give: a sanity bound (the busiest of ep ranks gets at most ep times the
mean), far above any measured routing."""


# ---- entry points -------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ClusterParts:
    """The validated pieces of a cluster spec; `Cluster` checks how they fit together (tier sizes, names)."""

    name: str
    groups: tuple[DeviceGroup, ...]
    tiers: tuple[NetworkTier, ...]
    error_context: str = ""
    """What to name in front of an error about how the parts fit ("cluster spec 'x'"); "" for the shorthand,
    whose errors name the cluster already."""
    expert_imbalance: float | None = None
    """The job's routed-token imbalance over expert-parallel ranks (`Cluster.expert_imbalance`)."""


def read_cluster_spec(spec: str) -> ClusterParts:
    """A shorthand `NODESxGPUSxDEVICE` or a path to a .yaml/.yml file."""
    text = str(spec).strip()
    if text.lower().endswith((".yaml", ".yml")) or Path(text).is_file():
        return read_cluster_yaml(text)
    m = _SHORTHAND.match(text)
    if not m:
        raise ValueError(f"bad cluster spec {text!r}: expected {SHORTHAND_FORM} or a path to a .yaml/.yml file; "
                         f"devices: {', '.join(device_names())}")
    nodes, gpus, device = int(m[1]), int(m[2]), m[3]
    if nodes < 1 or gpus < 1:
        raise ValueError(f"bad cluster spec {text!r}: NODES and GPUS must be at least 1 ({SHORTHAND_FORM})")
    try:
        spec_device = get_device(device)
    except ValueError:
        raise ValueError(f"bad cluster spec {text!r}: unknown device {device!r}; valid devices: "
                         f"{', '.join(device_names())}") from None
    return shorthand_parts(nodes, gpus, spec_device, name=f"{nodes}x{gpus}x{spec_device.name}")


def shorthand_parts(num_nodes: int, devices_per_node: int, device: DeviceSpec, *, name: str) -> ClusterParts:
    """`num_nodes` nodes of `devices_per_node` devices: a node tier and a cluster tier from the catalog."""
    group = DeviceGroup(name=device.name, device=device, num_nodes=num_nodes, devices_per_node=devices_per_node)
    tiers = (_node_tier_from_device(device, "node", devices_per_node),
             _outer_tier_from_devices([device], "cluster", num_nodes * devices_per_node))
    return ClusterParts(name=name, groups=(group,), tiers=tiers)


def read_cluster_yaml(path: str | Path) -> ClusterParts:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"cluster spec file {str(path)!r} not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"cluster spec {p.name}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    return read_cluster_dict(data, default_name=p.stem)


def read_cluster_dict(d: Any, *, default_name: str = "cluster") -> ClusterParts:
    """Validate a spec mapping (YAML form or `Cluster.to_dict()` form) into a cluster's parts."""
    _check_keys(d, "cluster spec", _TOP_KEYS)
    name = _string(d.get("name", default_name), "name")
    raw_groups = d["groups"]
    if not isinstance(raw_groups, list) or not raw_groups:
        raise ValueError("groups: expected a non-empty list of device groups")
    groups = [_group(g, f"groups[{i}]") for i, g in enumerate(raw_groups)]
    _name_groups(groups, raw_groups)
    raw_tiers = d.get("tiers")
    if raw_tiers is None:
        groups, tiers = _default_tiers(groups)
    else:
        if not isinstance(raw_tiers, list) or not raw_tiers:
            raise ValueError("tiers: expected a non-empty list of network tiers, innermost (node) first")
        groups, tiers = _tiers(raw_tiers, groups)
    imbalance = d.get("expert_imbalance")
    if imbalance is not None:
        imbalance = _number(imbalance, "expert_imbalance", 1.0, MAX_EXPERT_IMBALANCE, lo_open=False)
    return ClusterParts(name=name, groups=tuple(groups), tiers=tuple(tiers), error_context=f"cluster spec {name!r}",
                        expert_imbalance=imbalance)


# ---- validation helpers ---------------------------------------------------------------------------------------

def _check_keys(d: Any, path: str, keys: Mapping[str, bool]) -> None:
    valid = ", ".join(keys)
    if not isinstance(d, Mapping):
        raise ValueError(f"{path}: expected a mapping with keys {valid}, got {type(d).__name__} {d!r}")
    unknown = sorted(str(k) for k in d if k not in keys)
    if unknown:
        raise ValueError(f"{path}: unknown key {unknown[0]!r}; valid keys: {valid}")
    missing = [k for k, required in keys.items() if required and k not in d]
    if missing:
        raise ValueError(f"{path}: missing required key {missing[0]!r}; valid keys: {valid}")


def _string(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{path}: expected a non-empty string, got {v!r}")
    return v.strip()


def _positive_int(v: Any, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{path}: expected a positive integer, got {v!r}")
    return v


def _number(v: Any, path: str, lo: float, hi: float, *, lo_open: bool) -> float:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if ok and (v > lo if lo_open else v >= lo) and v <= hi:
        return float(v)
    interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    raise ValueError(f"{path}: expected a number in {interval}, got {v!r}")


def _index(v: Any, path: str, n: int) -> int:
    if isinstance(v, str) and v.strip().isdigit():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n:
        raise ValueError(f"{path}: expected a device index in 0..{n - 1} of this group, got {v!r}")
    return v


# ---- devices and groups ---------------------------------------------------------------------------------------

def _device(v: Any, path: str) -> DeviceSpec:
    if isinstance(v, str):
        try:
            return get_device(v)
        except ValueError:
            raise ValueError(f"{path}: unknown device {v!r}; valid devices: {', '.join(device_names())} "
                             f"(or a mapping of device fields: {', '.join(_DEVICE_KEYS)})") from None
    _check_keys(v, path, _DEVICE_KEYS)
    peaks = v["peak_flops"]
    if not isinstance(peaks, Mapping) or not peaks:
        raise ValueError(f"{path}.peak_flops: expected a mapping dtype -> FLOP/s, e.g. {{bfloat16: 312.0e12}}")
    for link_key in ("intra_node_link", "inter_node_link"):
        if v.get(link_key):
            _link(v[link_key], f"{path}.{link_key}")
    sources = v.get("sources") or {}
    if not isinstance(sources, Mapping):
        raise ValueError(f"{path}.sources: expected a mapping field -> source text")
    try:
        return DeviceSpec(
            name=_string(v["name"], f"{path}.name"),
            display_name=str(v.get("display_name") or v["name"]),
            peak_flops={str(k): _flops(x, f"{path}.peak_flops.{k}") for k, x in peaks.items()},
            matmul_efficiency=_number(v["matmul_efficiency"], f"{path}.matmul_efficiency", 0, 1, lo_open=True),
            memory_bytes=parse_bytes(v["memory_bytes"], f"{path}.memory_bytes"),
            memory_bandwidth=parse_bandwidth(v["memory_bandwidth"], f"{path}.memory_bandwidth"),
            memory_efficiency=_number(v["memory_efficiency"], f"{path}.memory_efficiency", 0, 1, lo_open=True),
            intra_node_bandwidth=parse_bandwidth(v["intra_node_bandwidth"], f"{path}.intra_node_bandwidth"),
            inter_node_bandwidth=parse_bandwidth(v["inter_node_bandwidth"], f"{path}.inter_node_bandwidth"),
            sources={str(k): str(s) for k, s in sources.items()},
            intra_node_link=str(v.get("intra_node_link") or ""),
            inter_node_link=str(v.get("inter_node_link") or ""),
            training_efficiency=_number(v.get("training_efficiency", 1.0), f"{path}.training_efficiency", 0, 1,
                                        lo_open=True),
            prediction_error=_optional_fraction(v.get("prediction_error"), f"{path}.prediction_error"),
            best_published_mfu=_optional_fraction(v.get("best_published_mfu"), f"{path}.best_published_mfu"),
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _optional_fraction(v: Any, path: str) -> float | None:
    return None if v is None else _number(v, path, 0, 1, lo_open=True)


def _flops(v: Any, path: str) -> float:
    try:
        x = float(v) if not isinstance(v, bool) else math.nan
    except (TypeError, ValueError):
        x = math.nan
    if not (x > 0 and math.isfinite(x)):
        raise ValueError(f"{path}: expected a positive FLOP/s number such as 312.0e12, got {v!r}")
    return x


def _group(g: Any, path: str) -> DeviceGroup:
    _check_keys(g, path, _GROUP_KEYS)
    device = _device(g["device"], f"{path}.device")
    num_nodes = _positive_int(g["num_nodes"], f"{path}.num_nodes")
    per_node = _positive_int(g["devices_per_node"], f"{path}.devices_per_node")
    n = num_nodes * per_node
    if g.get("memory") is not None:
        memory = parse_bytes(g["memory"], f"{path}.memory")
        device = dataclasses.replace(device, memory_bytes=memory,
                                     sources={**device.sources, "memory_bytes": f"cluster spec {path}.memory = "
                                              f"{g['memory']}"})
    unavailable = g.get("unavailable") or []
    if not isinstance(unavailable, list):
        raise ValueError(f"{path}.unavailable: expected a list of device indices in 0..{n - 1}")
    off = [_index(i, f"{path}.unavailable[{k}]", n) for k, i in enumerate(unavailable)]
    if len(set(off)) != len(off):
        raise ValueError(f"{path}.unavailable: device indices must be distinct, got {unavailable}")
    slowdown_raw = g.get("slowdown") or {}
    if not isinstance(slowdown_raw, Mapping):
        raise ValueError(f"{path}.slowdown: expected a mapping device index -> speed factor in (0, 1], e.g. {{3: 0.5}}")
    slowdown = {}
    for k, s in slowdown_raw.items():
        i = _index(k, f"{path}.slowdown[{k!r}]", n)
        if i in off:
            raise ValueError(f"{path}.slowdown[{k!r}]: device {i} is also listed as unavailable")
        slowdown[i] = _number(s, f"{path}.slowdown[{k!r}]", 0, 1, lo_open=True)
    price = g.get("price_per_device_hour")
    if price is not None:
        price = _number(price, f"{path}.price_per_device_hour", 0, math.inf, lo_open=False)
    node_tier = None
    if g.get("node_tier") is not None:
        node_tier = _tier(g["node_tier"], f"{path}.node_tier", index=0, default_name="node", size=per_node,
                          devices=[device], lower_size=1)
        if node_tier.size != per_node:
            raise ValueError(f"{path}.node_tier.size: must equal devices_per_node {per_node}, got {node_tier.size}")
    cores = g.get("host_cores")
    if cores is not None:
        cores = _positive_int(cores, f"{path}.host_cores")
    return DeviceGroup(name=str(g.get("name") or ""), device=device, num_nodes=num_nodes, devices_per_node=per_node,
                       slowdown=dict(sorted(slowdown.items())), unavailable=frozenset(off),
                       price_per_device_hour=price, node_tier=node_tier, host_cores=cores)


def _name_groups(groups: list[DeviceGroup], raw: Sequence[Mapping[str, Any]]) -> None:
    """Unnamed groups take their device's name, with the group index appended when that name repeats."""
    explicit = [str(r["name"]) if r.get("name") else None for r in raw]
    seen: dict[str, int] = {}
    for i, n in enumerate(explicit):
        if n is not None and n in seen:
            raise ValueError(f"groups[{i}].name: duplicate group name {n!r} (also groups[{seen[n]}]); "
                             f"give each group a distinct name")
        if n is not None:
            seen[n] = i
    device_counts: dict[str, int] = {}
    for g in groups:
        device_counts[g.device.name] = device_counts.get(g.device.name, 0) + 1
    for i, g in enumerate(groups):
        if explicit[i] is None:
            name = g.device.name if device_counts[g.device.name] == 1 else f"{g.device.name}-{i}"
            if name in seen:
                raise ValueError(f"groups[{i}].name: the default name {name!r} is taken; give this group a name")
            seen[name] = i
            groups[i] = dataclasses.replace(g, name=name)


# ---- tiers ----------------------------------------------------------------------------------------------------

def _link(v: Any, path: str) -> LinkSpec:
    try:
        return get_link(str(v))
    except ValueError:
        raise ValueError(f"{path}: unknown link type {v!r}; valid link types: "
                         f"{', '.join(link.name for link in list_links())}") from None


def _node_tier_from_device(device: DeviceSpec, name: str, size: int) -> NetworkTier:
    link = intra_node_link_of(device)
    return NetworkTier(
        name=name, size=size, bandwidth=device.intra_node_bandwidth, latency=link.latency,
        efficiency=link.efficiency, in_network_reduction_efficiency=link.in_network_reduction_efficiency,
        in_network_reduction_latency=link.in_network_reduction_latency, link=link.name,
        source=f"device catalog {device.name} intra_node_bandwidth; link calibration {link.name} "
               f"(costmodel/hardware/data/links.csv)")


def _outer_tier_from_devices(devices: Sequence[DeviceSpec], name: str, size: int) -> NetworkTier:
    slowest = min(devices, key=lambda d: d.inter_node_bandwidth * inter_node_link_of(d).efficiency)
    link = inter_node_link_of(slowest)
    return NetworkTier(
        name=name, size=size, bandwidth=slowest.inter_node_bandwidth, latency=link.latency,
        efficiency=link.efficiency, link=link.name,
        source=f"device catalog {slowest.name} inter_node_bandwidth (per-device NIC); link calibration "
               f"{link.name} (costmodel/hardware/data/links.csv)")


def _default_tiers(groups: list[DeviceGroup]) -> tuple[list[DeviceGroup], list[NetworkTier]]:
    total = sum(g.num_devices for g in groups)
    groups, node = _per_group_node_tiers(groups, "node", None)
    return groups, [node, _outer_tier_from_devices([g.device for g in groups], "cluster", total)]


def _per_group_node_tiers(groups: list[DeviceGroup], name: str, size: int | None,
                          edit: Callable[[NetworkTier], NetworkTier] = lambda t: t,
                          ) -> tuple[list[DeviceGroup], NetworkTier]:
    """Node tier(s) derived from the devices (then `edit`ed): one shared tier when all groups would get the same
    one, else a `node_tier` on each group (unless it has its own) and the slowest as the cluster's `tiers[0]`."""
    per_group = [g.node_tier or edit(_node_tier_from_device(g.device, name, g.devices_per_node)) for g in groups]
    distinct = {dataclasses.replace(t, source="").to_dict().__repr__() for t in per_group}
    sizes = {g.devices_per_node for g in groups}
    if size is None:
        size = max(sizes)
    if len(distinct) == 1 and all(g.node_tier is None for g in groups) and sizes == {size}:
        return groups, per_group[0]
    slowest = min(per_group, key=lambda t: (t.effective_bandwidth, -t.latency))
    out = [g if g.node_tier is not None else dataclasses.replace(g, node_tier=t) for g, t in zip(groups, per_group,
                                                                                                 strict=True)]
    return out, dataclasses.replace(slowest, name=name, size=size)


def _tiers(raw: list[Any], groups: list[DeviceGroup]) -> tuple[list[DeviceGroup], list[NetworkTier]]:
    total = sum(g.num_devices for g in groups)
    tiers: list[NetworkTier] = []
    for i, t in enumerate(raw):
        path = f"tiers[{i}]"
        _check_keys(t, path, _TIER_KEYS)
        last = i == len(raw) - 1
        if i == 0:
            sizes = {g.devices_per_node for g in groups if g.node_tier is None}
            default_size = sizes.pop() if len(sizes) == 1 else max(g.devices_per_node for g in groups)
            if "size" in t:
                size = _positive_int(t["size"], f"{path}.size")
                bad = [g for g in groups if g.node_tier is None and g.devices_per_node != size]
                if bad:
                    raise ValueError(f"{path}.size: the node tier has size {size} but group {bad[0].name!r} has "
                                     f"{bad[0].devices_per_node} devices per node (tiers[0] is the node tier)")
            else:
                size = default_size
            if not any(k in t for k in ("bandwidth", "aggregate_bandwidth", "link")):
                name = _string(t.get("name", "node"), f"{path}.name")
                groups, node = _per_group_node_tiers(groups, name, size,
                                                     lambda tier, t=t, path=path: _apply_overrides(tier, t, path))
                tiers.append(node)
                continue
            tiers.append(_tier(t, path, index=0, default_name="node", size=size,
                               devices=[g.device for g in groups], lower_size=1))
            continue
        if "size" in t:
            size = _positive_int(t["size"], f"{path}.size")
        elif last:
            size = total
        else:
            raise ValueError(f"{path}: missing required key 'size' (only the last tier may omit it); "
                             f"valid keys: {', '.join(_TIER_KEYS)}")
        uniform = len({g.devices_per_node for g in groups}) == 1
        tiers.append(_tier(t, path, index=i, default_name=f"tier{i}", size=size,
                           devices=[g.device for g in groups],
                           lower_size=tiers[-1].size if i > 1 or uniform else None))
    return groups, tiers


def _apply_overrides(tier: NetworkTier, t: Mapping[str, Any], path: str) -> NetworkTier:
    """Explicit latency / efficiency / in-network keys of a node tier whose bandwidth comes from the devices."""
    changes: dict[str, Any] = {}
    if "latency" in t:
        changes["latency"] = parse_duration(t["latency"], f"{path}.latency")
    if "efficiency" in t:
        changes["efficiency"] = _number(t["efficiency"], f"{path}.efficiency", 0, 1, lo_open=True)
    if "in_network_reduction_efficiency" in t:
        changes["in_network_reduction_efficiency"] = _number(
            t["in_network_reduction_efficiency"], f"{path}.in_network_reduction_efficiency", 0, 1, lo_open=False)
    if "in_network_reduction_latency" in t:
        changes["in_network_reduction_latency"] = parse_duration(t["in_network_reduction_latency"],
                                                                 f"{path}.in_network_reduction_latency")
    if "source" in t:
        changes["source"] = str(t["source"])
    if t.get("per_collective") is not None:
        changes["per_collective"] = _per_collective(t["per_collective"], f"{path}.per_collective")
    return dataclasses.replace(tier, **changes) if changes else tier


def _per_collective(v: Any, path: str) -> tuple[CollectiveLink, ...]:
    """`{kind: {latency: .., bandwidth: ..}}` -> links; kinds are mapping keys, so they are distinct."""
    if not isinstance(v, Mapping):
        raise ValueError(f"{path}: expected a mapping collective kind -> {{latency, bandwidth}}, e.g. "
                         f"{{reduce_scatter: {{latency: 170us, bandwidth: 0.4GB/s}}}}; got {v!r}")
    links = []
    for kind, figures in v.items():
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"{path}: unknown collective kind {kind!r}; valid kinds: {', '.join(COLLECTIVE_KINDS)}")
        where = f"{path}.{kind}"
        _check_keys(figures, where, _COLLECTIVE_LINK_KEYS)
        links.append(CollectiveLink(kind, latency=parse_duration(figures["latency"], f"{where}.latency"),
                                    bandwidth=parse_bandwidth(figures["bandwidth"], f"{where}.bandwidth")))
    return tuple(links)


def _tier(t: Any, path: str, *, index: int, default_name: str, size: int, devices: Sequence[DeviceSpec],
          lower_size: int | None) -> NetworkTier:
    """One tier from its mapping; missing values come from `link` (or the devices' links) and the catalog."""
    _check_keys(t, path, _TIER_KEYS)
    name = _string(t.get("name", default_name), f"{path}.name")
    if "size" in t and _positive_int(t["size"], f"{path}.size") != size:
        raise ValueError(f"{path}.size: expected {size}, got {t['size']!r}")
    if index == 0:
        base = _node_tier_from_device(min(devices, key=lambda d: d.intra_node_bandwidth), name, size)
    else:
        base = _outer_tier_from_devices(devices, name, size)
    if t.get("link") == "":  # an explicit tier with no link calibration (as `to_dict` writes it)
        base = dataclasses.replace(base, link="")
    elif "link" in t:
        link = _link(t["link"], f"{path}.link")
        base = dataclasses.replace(base, latency=link.latency, efficiency=link.efficiency, link=link.name,
                                   in_network_reduction_efficiency=link.in_network_reduction_efficiency,
                                   in_network_reduction_latency=link.in_network_reduction_latency,
                                   source=f"link calibration {link.name} (costmodel/hardware/data/links.csv)")
    if "bandwidth" in t and "aggregate_bandwidth" in t:
        raise ValueError(f"{path}: give either 'bandwidth' (per device) or 'aggregate_bandwidth' (per domain "
                         f"below), not both")
    bandwidth = base.bandwidth
    if "bandwidth" in t:
        bandwidth = parse_bandwidth(t["bandwidth"], f"{path}.bandwidth")
    elif "aggregate_bandwidth" in t:
        if lower_size is None:
            raise ValueError(f"{path}.aggregate_bandwidth: the groups have different devices_per_node, so a "
                             f"node's share is ambiguous; give 'bandwidth' per device instead")
        # One tier-(i-1) domain (a node for tier 1) sends through this tier's uplink; its devices share it.
        bandwidth = parse_bandwidth(t["aggregate_bandwidth"], f"{path}.aggregate_bandwidth") / lower_size
    explicit_source = "bandwidth" in t or "aggregate_bandwidth" in t
    tier = dataclasses.replace(base, name=name, size=size, bandwidth=bandwidth,
                               source=base.source if not explicit_source else f"cluster spec {path}")
    try:
        return _apply_overrides(tier, t, path)
    except ValueError as e:
        raise ValueError(str(e)) from None
