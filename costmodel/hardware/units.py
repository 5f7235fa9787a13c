"""Quantities with units in cluster specs: bandwidths ("400Gbps", "50GB/s"), durations ("5us") and sizes ("80GB",
"80GiB"), or plain numbers in bytes/s, seconds and bytes. A bad value raises ValueError naming the key path."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

# Multipliers to bytes/s. Lower-case "b" is bits, upper-case "B" bytes; prefixes are decimal (as link specs are)
# except the binary "Gi"-style ones.
_BANDWIDTH_UNITS: dict[str, float] = {}
for _prefix, _scale in (("", 1.0), ("K", 1e3), ("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)):
    for _suffix in ("bps", "b/s", "bit/s"):
        _BANDWIDTH_UNITS[_prefix + _suffix] = _scale / 8
    for _suffix in ("Bps", "B/s"):
        _BANDWIDTH_UNITS[_prefix + _suffix] = _scale
for _prefix, _scale in (("Ki", 2.0**10), ("Mi", 2.0**20), ("Gi", 2.0**30), ("Ti", 2.0**40)):
    _BANDWIDTH_UNITS[_prefix + "B/s"] = _scale
_DURATION_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}
_BYTE_UNITS = {"B": 1.0, "KB": 1e3, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
               "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([^\s0-9][^\s]*)?\s*$")


def _quantity(value: Any, path: str, units: Mapping[str, float], what: str, default_unit: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{path}: expected {what}, got {value!r}")
    if isinstance(value, int | float):
        number, scale = float(value), 1.0
    elif isinstance(value, str) and (m := _QUANTITY.match(value)):
        unit = m[2] or default_unit
        if unit not in units:
            raise ValueError(f"{path}: unknown unit {unit!r} in {value!r}; valid units: {', '.join(units)}")
        number, scale = float(m[1]), units[unit]
    else:
        raise ValueError(f"{path}: expected {what} such as {_EXAMPLES[what]}, got {value!r}")
    if not math.isfinite(number):
        raise ValueError(f"{path}: expected a finite {what}, got {value!r}")
    return number * scale


_EXAMPLES = {"a bandwidth": "'400Gbps', '50GB/s' or bytes/s", "a duration": "'5us', '1.5ms' or seconds",
             "a size": "'80GB', '80GiB' or bytes"}


def parse_bandwidth(value: Any, path: str = "bandwidth") -> float:
    """Bytes/s from "400Gbps", "400 Gb/s", "50GB/s", "1.5TB/s" or a plain number (bytes/s); must be > 0."""
    out = _quantity(value, path, _BANDWIDTH_UNITS, "a bandwidth", "B/s")
    if out <= 0:
        raise ValueError(f"{path}: bandwidth must be positive, got {value!r}")
    return out


def parse_duration(value: Any, path: str = "latency") -> float:
    """Seconds from "5us", "1.5ms", "200ns" or a plain number (seconds); must be >= 0."""
    out = _quantity(value, path, _DURATION_UNITS, "a duration", "s")
    if out < 0:
        raise ValueError(f"{path}: duration must be >= 0, got {value!r}")
    return out


def parse_bytes(value: Any, path: str = "memory") -> int:
    """Bytes from "80GB" (decimal), "80GiB" or a plain number; must be > 0."""
    out = _quantity(value, path, _BYTE_UNITS, "a size", "B")
    if out <= 0:
        raise ValueError(f"{path}: size must be positive, got {value!r}")
    return round(out)
