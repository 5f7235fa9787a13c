"""Scenarios for what-if sweeps: each `--vary` value applied to the cluster spec or the training settings.

`--vary KEY=V1,V2,...` keys (several `--vary` make the cartesian product, first key slowest):

| key | values | what changes |
|---|---|---|
| `tier.NAME.bandwidth` | `50GB/s`, `400Gbps`, ... | per-device bandwidth of network tier NAME |
| `tier.NAME.aggregate_bandwidth` | as above | a tier's shared uplink (divided by the tier below) |
| `tier.NAME.latency` / `tier.NAME.efficiency` | `5us` / `0.8` | the tier's per-hop latency / achievable fraction |
| `device` | `a100-80gb`, `h100-sxm@9.80` | every group's device type (catalog name), optionally `@price` per device-hour |
| `nodes` | `4`, `8` | nodes of a one-group cluster |
| `group.NAME.KEY` | KEY one of device, num_nodes, price_per_device_hour, memory | one device group |
| `speed.RANK` | `0.5`, `1`, `0` | speed factor of one device (0: failed) |
| `batch` / `seq` | integers | global batch / sequence length |
| `cluster` | cluster files or shorthands | the whole cluster ("which cluster is cheapest for this deadline") |

Edits apply to the spec *as written* (the YAML mapping, or the mapping the shorthand stands for) and the spec is
validated again, so defaults follow: a new device type brings its own NVLink and NIC figures.
"""

from __future__ import annotations

import copy
import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.hardware.cluster import Cluster
from planner.errors import UserError

TIER_FIELDS = ("bandwidth", "aggregate_bandwidth", "latency", "efficiency")
GROUP_FIELDS = ("device", "num_nodes", "price_per_device_hour", "memory")
SIMPLE_KEYS = ("device", "nodes", "batch", "seq", "cluster")
KEY_FORMS = ("tier.NAME." + "|".join(TIER_FIELDS), "device", "nodes", "group.NAME." + "|".join(GROUP_FIELDS),
             "speed.RANK", "batch", "seq", "cluster")


class VaryKind(enum.StrEnum):
    TIER = "tier"
    DEVICE = "device"
    NODES = "nodes"
    GROUP = "group"
    SPEED = "speed"
    BATCH = "batch"
    SEQ = "seq"
    CLUSTER = "cluster"


@dataclass(frozen=True, slots=True)
class Variation:
    """One `--vary KEY=V1,V2,...`."""

    key: str
    kind: VaryKind
    target: str
    """Tier or group name, or rank (TIER, GROUP, SPEED); '' otherwise."""
    field: str
    """Tier or group field (TIER, GROUP); '' otherwise."""
    values: tuple[str, ...]


def parse_vary(text: str) -> Variation:
    """Parse `KEY=V1,V2,...` (module docstring); ValueError names the bad part and lists the valid keys."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    values = tuple(v.strip() for v in raw.split(",") if v.strip())
    if not sep or not key or not values:
        raise ValueError(f"--vary {text!r}: expected KEY=V1,V2,...; keys: {', '.join(KEY_FORMS)}")
    if len(set(values)) != len(values):
        raise ValueError(f"--vary {text!r}: a value is repeated")
    parts = key.split(".")
    head = parts[0].lower()
    if head in SIMPLE_KEYS and len(parts) == 1:
        kind = VaryKind(head)
        if kind in (VaryKind.BATCH, VaryKind.SEQ, VaryKind.NODES):
            for v in values:
                if not v.isdigit() or int(v) < 1:
                    raise ValueError(f"--vary {key}: {v!r} is not a positive integer")
        return Variation(key, kind, "", "", values)
    if head == "tier" and len(parts) == 3 and parts[2] in TIER_FIELDS:
        return Variation(key, VaryKind.TIER, parts[1], parts[2], values)
    if head == "group" and len(parts) == 3 and parts[2] in GROUP_FIELDS:
        return Variation(key, VaryKind.GROUP, parts[1], parts[2], values)
    if head == "speed" and len(parts) == 2 and parts[1].isdigit():
        for v in values:
            try:
                ok = 0 <= float(v) <= 1
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--vary {key}: speed {v!r} must be a number in [0, 1] (0: unavailable)")
        return Variation(key, VaryKind.SPEED, parts[1], "", values)
    raise ValueError(f"--vary {text!r}: unknown key {key!r}; keys: {', '.join(KEY_FORMS)}")


# ---- scenarios ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    values: tuple[tuple[str, str], ...]
    """(key, value) of every variation, in `--vary` order."""
    cluster: Cluster
    global_batch: int
    seq: int | None


def spec_mapping(spec: str) -> dict[str, Any]:
    """The spec as a mutable mapping in YAML form: a YAML file's contents, or what a shorthand stands for."""
    path = Path(spec)
    if spec.lower().endswith((".yaml", ".yml")) or path.is_file():
        import yaml

        if not path.is_file():
            raise ValueError(f"cluster spec file {spec!r} not found")
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"cluster spec {path.name}: expected a mapping with 'groups'")
        data.setdefault("name", path.stem)
        return data
    cluster = Cluster.parse(spec)
    g = cluster.groups[0]
    return {"name": cluster.name,
            "groups": [{"device": g.device.name, "num_nodes": g.num_nodes, "devices_per_node": g.devices_per_node}]}


def _tiers_of(spec: dict[str, Any]) -> list[dict[str, Any]]:
    if "tiers" not in spec:  # the defaults a spec without tiers gets (costmodel.hardware.cluster_yaml)
        spec["tiers"] = [{"name": "node"}, {"name": "cluster"}]
    return spec["tiers"]


def _named(items: list[dict[str, Any]], name: str, what: str, default: Callable[[dict[str, Any], int], str]
           ) -> dict[str, Any]:
    names = [str(item.get("name", default(item, i))) for i, item in enumerate(items)]
    if name not in names:
        raise ValueError(f"no {what} {name!r}; {what}s: {', '.join(names)}")
    return items[names.index(name)]


def _group_default_name(group: dict[str, Any], _: int) -> str:
    device = group.get("device")
    return str(device.get("name") if isinstance(device, dict) else device)


def _set_device(group: dict[str, Any], value: str) -> None:
    name, at, price = value.partition("@")
    group["device"] = name
    if at:
        try:
            group["price_per_device_hour"] = float(price)
        except ValueError:
            raise ValueError(f"device {value!r}: the price after '@' must be a number") from None


def _resize_last_tier(spec: dict[str, Any], old_total: int) -> None:
    """A last tier sized to the whole old cluster keeps spanning the whole (resized) cluster."""
    tiers = spec.get("tiers")
    if tiers and len(tiers) > 1 and tiers[-1].get("size") == old_total:
        del tiers[-1]["size"]


def _total_devices(spec: Mapping[str, Any]) -> int:
    return sum(int(g["num_nodes"]) * int(g["devices_per_node"]) for g in spec["groups"])


def apply_variation(spec: dict[str, Any], variation: Variation, value: str) -> None:
    """Edit `spec` (YAML form) in place for one value of a cluster variation."""
    kind = variation.kind
    if kind is VaryKind.TIER:
        tier = _named(_tiers_of(spec), variation.target, "tier", lambda t, i: "node" if i == 0 else f"tier{i}")
        other = {"bandwidth": "aggregate_bandwidth", "aggregate_bandwidth": "bandwidth"}.get(variation.field)
        if other:
            tier.pop(other, None)
        tier[variation.field] = float(value) if variation.field == "efficiency" else value
    elif kind is VaryKind.DEVICE:
        for group in spec["groups"]:
            _set_device(group, value)
    elif kind is VaryKind.NODES:
        if len(spec["groups"]) != 1:
            names = ", ".join(_group_default_name(g, i) if "name" not in g else g["name"]
                              for i, g in enumerate(spec["groups"]))
            raise ValueError(f"nodes applies to a one-group cluster; use group.NAME.num_nodes (groups: {names})")
        total = _total_devices(spec)
        spec["groups"][0]["num_nodes"] = int(value)
        _resize_last_tier(spec, total)
    elif kind is VaryKind.GROUP:
        group = _named(spec["groups"], variation.target, "group", _group_default_name)
        if variation.field == "device":
            _set_device(group, value)
        elif variation.field == "num_nodes":
            total = _total_devices(spec)
            group["num_nodes"] = int(value)
            _resize_last_tier(spec, total)
        elif variation.field == "price_per_device_hour":
            group["price_per_device_hour"] = float(value)
        else:
            group[variation.field] = value


def scenarios(base_spec: str | None, global_batch: int | None, seq: int | None, variations: Sequence[Variation]
              ) -> list[Scenario]:
    """Every combination of the variations' values (first variation slowest), each a validated cluster.

    `global_batch` may be None only when a variation sets the batch. Raises UserError naming the variation and
    value that make an invalid cluster."""
    keys = [v.key for v in variations]
    if len(set(keys)) != len(keys):
        raise UserError(f"--vary: a key is given twice ({', '.join(keys)})")
    if global_batch is None and not any(v.kind is VaryKind.BATCH for v in variations):
        raise UserError("give --batch B, or --vary batch=B1,B2,...")
    if base_spec is None and not any(v.kind is VaryKind.CLUSTER for v in variations):
        raise UserError("give --cluster SPEC, or --vary cluster=SPEC1,SPEC2,...")
    if base_spec is not None and any(v.kind is VaryKind.CLUSTER for v in variations):
        raise UserError("--vary cluster=... replaces --cluster; give one of them")
    out = []
    for combo in itertools.product(*(v.values for v in variations)):
        chosen = list(zip(variations, combo, strict=True))
        spec = base_spec
        for v, value in chosen:
            if v.kind is VaryKind.CLUSTER:
                spec = value
        assert spec is not None
        batch, length = global_batch, seq
        where = ", ".join(f"{v.key}={value}" for v, value in chosen)
        try:
            mapping = spec_mapping(spec)
            for v, value in chosen:
                if v.kind in (VaryKind.TIER, VaryKind.DEVICE, VaryKind.NODES, VaryKind.GROUP):
                    apply_variation(mapping, v, value)
            cluster = Cluster.from_dict(copy.deepcopy(mapping))
            for v, value in chosen:
                if v.kind is VaryKind.SPEED:
                    cluster = cluster.with_speed(int(v.target), float(value))
                elif v.kind is VaryKind.BATCH:
                    batch = int(value)
                elif v.kind is VaryKind.SEQ:
                    length = int(value)
        except (ValueError, KeyError, TypeError, OSError) as e:
            text = " ".join(str(e).split()) or type(e).__name__
            raise UserError(f"--vary {where}: {text}") from None
        assert batch is not None
        out.append(Scenario(tuple((v.key, value) for v, value in chosen), cluster, batch, length))
    return out
