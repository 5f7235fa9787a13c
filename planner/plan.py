"""The `Plan`: a chosen strategy with its predictions, as a typed value and as versioned, strict JSON.

Loading is strict: unknown keys, missing keys, a newer `schema_version` or a truncated file raise `PlanLoadError`
with a one-line reason. `Plan.to_json()` is deterministic (sorted keys); only `search.time_s` varies between two
runs with the same inputs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.breakdown import Estimate
from costmodel.sharding.rules import Style
from costmodel.strategy import Strategy
from planner.errors import PlanLoadError

SCHEMA_VERSION = 2


@dataclass(frozen=True, slots=True)
class ModuleSharding:
    module: str
    """Module path pattern (fnmatch): "blocks.*.attn.qkv"."""
    style: Style
    """How its parameters and activations are laid out over the tensor-parallel axis: replicate; colwise (weight
    sharded on its output features, output sharded on the last dim); rowwise (weight sharded on its input
    features, output a partial sum); sequence (activations sharded on the sequence dim: norms, dropout under SP);
    vocab (embedding rows); heads (attention computed per head shard)."""

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "style": self.style.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModuleSharding:
        return cls(module=d["module"], style=Style(d["style"]))


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    fingerprint: str
    """Hex digest of the traced graph's structure (ops, shapes, parameters); a plan only applies to its model."""
    params: int
    settings: tuple[tuple[str, Any], ...] = ()
    """The `--set` overrides the model was built with, sorted."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "fingerprint": self.fingerprint, "params": self.params,
                "settings": {k: v for k, v in self.settings}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelInfo:
        return cls(name=d["name"], fingerprint=d["fingerprint"], params=d["params"],
                   settings=tuple(sorted(d["settings"].items())))


@dataclass(frozen=True, slots=True)
class TrainingConfig:
    global_batch: int
    seq_len: int | None
    dtype: str = "bfloat16"
    optimizer: str = "adam"

    def to_dict(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch, "seq_len": self.seq_len, "dtype": self.dtype,
                "optimizer": self.optimizer}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainingConfig:
        return cls(**{k: d[k] for k in ("global_batch", "seq_len", "dtype", "optimizer")})


@dataclass(frozen=True, slots=True)
class Alternative:
    """A strategy that lost, kept so that `explain` can say by how much and why."""

    summary: str
    step_time_s: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "step_time_s": self.step_time_s, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Alternative:
        return cls(summary=d["summary"], step_time_s=d["step_time_s"], reason=d["reason"])


@dataclass(frozen=True, slots=True)
class SearchInfo:
    time_s: float
    candidates: int
    """Strategies priced (after pruning)."""
    status: str
    """"optimal", "feasible" (cut short by the time limit) or "fixed" (estimate of a given strategy)."""
    optimality_gap: float
    """(plan step time - best lower bound) / plan step time; 0 when proven optimal."""
    lower_bound_s: float
    alternatives: tuple[Alternative, ...] = ()
    fastest_s: float | None = None
    """Step time of the fastest strategy found, in seconds of this plan's step (below it where the plan is the
    simplest of a tie); None in plans written before it was recorded."""

    def to_dict(self) -> dict[str, Any]:
        d = {"time_s": self.time_s, "candidates": self.candidates, "status": self.status,
             "optimality_gap": self.optimality_gap, "lower_bound_s": self.lower_bound_s,
             "alternatives": [a.to_dict() for a in self.alternatives]}
        if self.fastest_s is not None:
            d["fastest_s"] = self.fastest_s
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SearchInfo:
        return cls(time_s=d["time_s"], candidates=d["candidates"], status=d["status"],
                   optimality_gap=d["optimality_gap"], lower_bound_s=d["lower_bound_s"],
                   alternatives=tuple(Alternative.from_dict(a) for a in d["alternatives"]),
                   fastest_s=d.get("fastest_s"))


@dataclass(frozen=True, slots=True)
class Plan:
    model: ModelInfo
    cluster: Mapping[str, Any]
    """The normalized cluster spec (`Cluster.to_dict()`)."""
    training: TrainingConfig
    strategy: Strategy
    sharding: tuple[ModuleSharding, ...]
    predicted: Estimate
    search: SearchInfo
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        strategy = self.strategy.to_dict()
        strategy["sharding"] = [m.to_dict() for m in self.sharding]
        return {
            "schema_version": self.schema_version,
            "model": self.model.to_dict(),
            "cluster": dict(self.cluster),
            "training": self.training.to_dict(),
            "strategy": strategy,
            "predicted": self.predicted.to_dict(),
            "search": self.search.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        if not isinstance(d, Mapping):
            raise PlanLoadError("plan JSON must be an object")
        version = d.get("schema_version")
        if not isinstance(version, int):
            raise PlanLoadError("plan JSON has no integer schema_version")
        if version > SCHEMA_VERSION:
            raise PlanLoadError(f"plan schema_version {version} is newer than this Stratagem reads "
                                f"({SCHEMA_VERSION}); upgrade Stratagem")
        expected = {"schema_version", "model", "cluster", "training", "strategy", "predicted", "search"}
        _check_keys(d, expected, "plan")
        try:
            strategy = dict(d["strategy"])
            sharding = tuple(ModuleSharding.from_dict(m) for m in strategy.pop("sharding", []))
            # Schema 1 plans predate the runtime options: they were priced with the defaults.
            optional = {"runtime"} if version < 2 else set()
            _check_keys(strategy, set(Strategy().to_dict()), "strategy", optional=optional)
            _check_stages_tile(strategy["stages"])
            return cls(
                model=ModelInfo.from_dict(d["model"]),
                cluster=d["cluster"],
                training=TrainingConfig.from_dict(d["training"]),
                strategy=Strategy.from_dict(strategy),
                sharding=sharding,
                predicted=Estimate.from_dict(d["predicted"]),
                search=SearchInfo.from_dict(d["search"]),
                schema_version=version,
            )
        except PlanLoadError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PlanLoadError(f"plan JSON is malformed: {type(e).__name__}: {e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        """Read a plan file; every way it can be unreadable is a one-line `PlanLoadError`."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PlanLoadError(f"plan file {path} does not exist") from None
        except IsADirectoryError:
            raise PlanLoadError(f"plan file {path} is a directory") from None
        except UnicodeDecodeError:
            raise PlanLoadError(f"plan file {path} is not text (UTF-8 JSON expected)") from None
        except OSError as e:
            raise PlanLoadError(f"cannot read plan file {path}: {e.strerror or e}") from None
        try:
            return cls.from_json(text)
        except PlanLoadError as e:
            raise PlanLoadError(f"{path}: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write `to_json()` to `path`."""
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanLoadError(f"plan file is not valid JSON (truncated or corrupt?): {e}") from None
        return cls.from_dict(data)


def _check_stages_tile(stages: Any) -> None:
    """Stages must cover consecutive segment ranges from segment 0, in pipeline order (a hand-edited plan with a
    gap or an overlap would otherwise be explained or applied as if it were valid)."""
    if not isinstance(stages, list):
        raise PlanLoadError(f"strategy.stages must be a list, got {type(stages).__name__}")
    expected = 0
    for i, stage in enumerate(stages):
        start = stage.get("start") if isinstance(stage, Mapping) else None
        if start != expected:
            where = "segment 0" if i == 0 else f"segment {expected}, where stage {i - 1} stops"
            raise PlanLoadError(f"strategy.stages[{i}] starts at {start!r}; stages must cover consecutive segment "
                                f"ranges, so it must start at {where}")
        expected = stage.get("stop")


def _check_keys(d: Mapping[str, Any], expected: set[str], where: str, *, optional: set[str] = frozenset()) -> None:
    unknown = sorted(set(d) - expected)
    missing = sorted(expected - set(d) - optional)
    if unknown:
        raise PlanLoadError(f"unknown key(s) in {where}: {', '.join(unknown)}; valid: {', '.join(sorted(expected))}")
    if missing:
        raise PlanLoadError(f"missing key(s) in {where}: {', '.join(missing)}")
