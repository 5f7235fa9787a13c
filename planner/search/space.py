"""What the planner may choose: the dimensions of the search, which of them `--fix` pins, and the objective.

`SearchSpace.from_fixes(["tp=8", "pp=8", "recompute=full"])` is how the CLI's `--fix key=value` enters; every key
and value is validated here, with errors that list the valid keys or values.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from costmodel.float8 import FP8_RECIPES, parse_recipe
from costmodel.strategy import (
    CROSS_ENTROPY_CHOICES,
    MAX_METRIC_PASSES,
    OFFLOAD_CHOICES,
    RUNTIME_FLAGS,
    CrossEntropy,
    Offload,
    Recompute,
    RuntimeOptions,
    Schedule,
    parse_schedule,
)

RUNTIME_FIELDS = frozenset({*RUNTIME_FLAGS, "fp8", "cross_entropy", "metric_passes"})
"""`--fix` keys that set a `RuntimeOptions` field (how the trainer runs the strategy) rather than a dimension."""


class Objective(enum.StrEnum):
    """What the search minimizes."""

    TIME = "time"    # step time for the fixed global batch
    COST = "cost"    # step time x devices used x price per device-second (prices come from the cluster spec)


FIX_KEYS: Mapping[str, str] = {
    "dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep",
    "mbs": "microbatch_size", "microbatch_size": "microbatch_size",
    "microbatches": "num_microbatches", "num_microbatches": "num_microbatches",
    "schedule": "schedule", "schedules": "schedules",
    "virtual_stages": "virtual_stages", "v": "virtual_stages",
    "zero": "zero_stage", "zero_stage": "zero_stage",
    "sp": "sequence_parallel", "sequence_parallel": "sequence_parallel",
    "recompute": "recompute", "offload": "offload",
    **{name: name for name in RUNTIME_FLAGS}, "fp8": "fp8", "cross_entropy": "cross_entropy",
    "metric_passes": "metric_passes",
}
"""`--fix` key (and its aliases) -> SearchSpace field."""

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """Pinned dimensions (None = searched) and the ranges of the free ones."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    """Context-parallel degree (searched over the degrees the sequence allows when free)."""
    ep: int | None = None
    """Expert-parallel degree (searched over divisors of dp and of the experts when free)."""
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    schedule: Schedule | None = None
    schedules: frozenset[Schedule] | None = None
    """The schedule families the search may use when `schedule` is free: those the target trainer runs
    (Megatron-LM: 1F1B and interleaved; `--fix schedules=1f1b,interleaved`). None: every family the planner
    prices (GPipe only when pinned: 1F1B is never slower)."""
    virtual_stages: int | None = None
    zero_stage: int | None = None
    sequence_parallel: bool | None = None
    recompute: Recompute | None = None
    """Pins every stage's recomputation; None lets the stage partition choose per stage."""
    offload: Offload | None = None
    """Model state offloaded to host memory (`costmodel.strategy.Offload`); None searches it where the cluster's
    devices have host data (`costmodel.hardware.host`): always slower, it wins only where memory binds."""
    max_microbatch_size: int = 16
    """Largest micro-batch tried when it is free: past a few samples GEMMs are already large, and bigger
    micro-batches only lengthen the pipeline bubble and the activation memory. Without pipelining, the whole
    per-replica batch as one micro-batch is tried too (the simplest way to run it)."""
    max_virtual_stages: int = 8
    """Largest interleaving degree tried (Megatron-LM reports gains up to a handful of chunks per device)."""
    tp_across_nodes: bool = False
    """Allow tensor parallelism to span nodes (off by default: TP communicates on every layer)."""
    whole_nodes_only: bool = True
    """Use every device of the cluster (time objective); False also tries smaller device counts."""
    runtime: RuntimeOptions = RuntimeOptions()
    """How the trainer runs every candidate (not searched: the defaults are what `planner.parallelize` runs)."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep", "microbatch_size", "num_microbatches", "virtual_stages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.recompute is not None:
            object.__setattr__(self, "recompute", Recompute(self.recompute))
        self._validate_offload()
        if self.virtual_stages is not None and self.virtual_stages > 1:
            if self.schedule is not None and not self.schedule.chunked:
                raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule=interleaved (or another "
                                 f"schedule with model chunks), not {self.schedule.value}")
            if self.schedule is None:
                object.__setattr__(self, "schedule", Schedule.INTERLEAVED)
        if self.schedule is not None and self.schedule.v_shape and self.virtual_stages not in (None, 2):
            raise ValueError(f"schedule={self.schedule.value} runs exactly 2 chunks per rank, not "
                             f"virtual_stages={self.virtual_stages}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sp=true needs tp > 1 (sequence parallelism shards over the tensor-parallel axis)")
        if self.schedule is not None and self.schedule.chunked and self.pp == 1:
            raise ValueError(f"schedule={self.schedule.value} needs pp > 1")
        if self.max_microbatch_size < 1 or self.max_virtual_stages < 1:
            raise ValueError("max_microbatch_size and max_virtual_stages must be >= 1")
        self._validate_schedules()  # after virtual_stages > 1 has implied interleaved

    def _validate_schedules(self) -> None:
        if self.schedules is None:
            return
        allowed = frozenset(Schedule(x) for x in self.schedules)
        if not allowed:
            raise ValueError("schedules must name at least one schedule family")
        if self.schedule is not None and self.schedule not in allowed:
            raise ValueError(f"schedule={self.schedule.value} is not one of schedules="
                             f"{','.join(sorted(x.value for x in allowed))}")
        object.__setattr__(self, "schedules", allowed)

    def _validate_offload(self) -> None:
        if self.runtime.offload is not Offload.NONE:  # an offload given as a runtime option pins the dimension
            if self.offload not in (None, self.runtime.offload):
                raise ValueError(f"offload={self.offload.value} contradicts runtime offload="
                                 f"{self.runtime.offload.value}")
            object.__setattr__(self, "offload", self.runtime.offload)
            object.__setattr__(self, "runtime", replace(self.runtime, offload=Offload.NONE))
        if self.offload is None:
            return
        try:
            object.__setattr__(self, "offload", Offload(self.offload))
        except ValueError:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {self.offload!r}") from None
        if self.offload is Offload.PARAMS and self.zero_stage not in (None, 3):
            raise ValueError(f"offload=params (FSDP2 CPUOffloadPolicy) needs zero=3, not zero={self.zero_stage}; "
                             f"use offload=optimizer with ZeRO-{self.zero_stage}")

    @classmethod
    def from_fixes(cls, fixes: Sequence[str], **ranges: Any) -> SearchSpace:
        """Parse `key=value` pins (the CLI's --fix); `ranges` sets the non-pinned fields (max_microbatch_size...)."""
        pinned: dict[str, Any] = {}
        runtime: dict[str, Any] = {}
        for item in fixes:
            key, sep, value = item.partition("=")
            key, value = key.strip().lower(), value.strip()
            if not sep or not key or not value:
                raise ValueError(f"--fix {item!r}: expected KEY=VALUE, e.g. tp=8; keys: {', '.join(FIX_KEYS)}")
            if key not in FIX_KEYS:
                raise ValueError(f"--fix {item!r}: unknown key {key!r}; valid: {', '.join(FIX_KEYS)}")
            field = FIX_KEYS[key]
            if field in RUNTIME_FIELDS:
                runtime[field] = _runtime_value(field, key, value)
                continue
            for name, parsed in _parse_fix(field, key, value).items():
                if name in pinned and pinned[name] != parsed:
                    raise ValueError(f"--fix {item!r} contradicts an earlier --fix of {name}")
                pinned[name] = parsed
        if runtime:
            pinned["runtime"] = RuntimeOptions(**runtime)
        return cls(**pinned, **ranges)

    def pinned(self) -> dict[str, Any]:
        """The pinned dimensions, by field name (for messages)."""
        skip = {"max_microbatch_size", "max_virtual_stages", "tp_across_nodes", "whole_nodes_only", "runtime"}
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in skip and getattr(self, f.name) is not None}
        if self.schedules is not None:  # as --fix writes it
            out["schedules"] = ",".join(sorted(x.value for x in self.schedules))
        return out

    def with_changes(self, **changes: Any) -> SearchSpace:
        return replace(self, **changes)


def _parse_fix(field: str, key: str, value: str) -> dict[str, Any]:
    low = value.lower()
    if field == "schedules":
        try:
            return {field: frozenset(Schedule(x.strip()) for x in low.split(",") if x.strip())}
        except ValueError:
            raise ValueError(f"--fix {key}={value}: expected a comma-separated list of schedule families; valid: "
                             f"{', '.join(x.value for x in Schedule)}") from None
    if field == "schedule":
        try:
            schedule, v = parse_schedule(value)
        except ValueError as e:
            raise ValueError(f"--fix {key}={value}: {e}") from None
        out: dict[str, Any] = {"schedule": schedule}
        if v is not None:
            out["virtual_stages"] = v
        return out
    if field == "recompute":
        try:
            return {field: Recompute(low)}
        except ValueError:
            raise ValueError(f"--fix {key}={value}: valid: {', '.join(r.value for r in Recompute)}") from None
    if field == "sequence_parallel":
        return {field: _boolean(key, value)}
    if field == "offload":
        try:
            return {field: Offload(low)}
        except ValueError:
            raise ValueError(f"--fix {key}={value}: valid: {OFFLOAD_CHOICES}") from None
    if field == "zero_stage":
        if low not in ("0", "1", "2", "3"):
            raise ValueError(f"--fix {key}={value}: valid: 0, 1, 2, 3")
        return {field: int(low)}
    return {field: _positive(key, value)}


def _fp8(key: str, value: str) -> Any:
    """A recipe name, or off / false / none for no FP8."""
    if value.lower() in _FALSE | {"none"}:
        return None
    try:
        return parse_recipe(value)
    except ValueError:
        raise ValueError(f"--fix {key}={value}: valid: {FP8_RECIPES}, off") from None


def _runtime_value(field: str, key: str, value: str) -> Any:
    if field == "fp8":
        return _fp8(key, value)
    if field == "cross_entropy":
        return _cross_entropy(key, value)
    if field == "metric_passes":
        if not value.isdigit() or int(value) > MAX_METRIC_PASSES:
            raise ValueError(f"--fix {key}={value}: expected an integer from 0 to {MAX_METRIC_PASSES}")
        return int(value)
    return _boolean(key, value)


def _cross_entropy(key: str, value: str) -> CrossEntropy:
    try:
        return CrossEntropy(value.lower())
    except ValueError:
        raise ValueError(f"--fix {key}={value}: valid: {CROSS_ENTROPY_CHOICES}") from None


def _boolean(key: str, value: str) -> bool:
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"--fix {key}={value}: expected true or false")


def _positive(key: str, value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--fix {key}={value}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"--fix {key}={value}: expected a positive integer")
    return n
