"""Measured operator profiles: the format `stratagem profile` writes and the cost model reads.

A profile maps (device type, op signature) to measured forward and backward seconds. The analytical model in
`costmodel.operators` is used for every op the profile does not hold, so a partial profile is always valid.

The op signature is a stable text key built from what determines an op's run time: its target, input shapes and
dtypes, parameter shapes, and the scale factors the pricer applied (micro-batch scaling, 1/tp sharding), e.g.
``torch.nn.Linear|in=(8,1024,768):bfloat16|p=(3072,768):bfloat16,(3072,):bfloat16|s=1,1,1``.
Node names and module paths are not part of it, so the 96 identical blocks of GPT-3 share entries.

JSON layout (`schema_version` 1; unknown keys are an error)::

    {"schema_version": 1,
     "meta": {"torch": "2.13.0", "host": "...", ...},          # free-form strings, informational
     "entries": [{"device": "cpu", "signature": "...", "forward_s": 1.2e-4, "backward_s": 2.5e-4,
                  "samples": 20}, ...]}

Version 2 adds one optional top-level key, written only when collectives were measured (a profile without them
is still written as version 1, so older readers keep reading it); readers accept both versions::

     "collectives": {"samples": [...], "fits": [...]}           # costmodel.hardware.collective_fit.CollectiveProfile
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from costmodel.hardware.collective_fit import CollectiveProfile
from ir.graph import Node

PROFILE_SCHEMA_VERSION = 1
PROFILE_SCHEMA_VERSION_COLLECTIVES = 2
"""Version written when the profile holds a collectives section (see the module docstring)."""
_TOP_KEYS = frozenset({"schema_version", "meta", "entries"})
_TOP_KEYS_V2 = _TOP_KEYS | {"collectives"}
_ENTRY_KEYS = frozenset({"device", "signature", "forward_s", "backward_s", "samples"})


@dataclass(frozen=True, slots=True)
class OpTiming:
    """Measured seconds of one op signature on one device type."""

    forward_s: float
    backward_s: float
    samples: int = 1
    """How many timed repetitions the value is the median of."""

    def __post_init__(self) -> None:
        if not (self.forward_s >= 0 and self.backward_s >= 0):
            raise ValueError(f"op timings must be non-negative, got forward {self.forward_s}, "
                             f"backward {self.backward_s}")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")


@dataclass(frozen=True)
class OpProfile:
    """Measured op timings keyed by (device type, op signature)."""

    entries: Mapping[tuple[str, str], OpTiming] = field(default_factory=dict)
    meta: Mapping[str, str] = field(default_factory=dict)
    collectives: CollectiveProfile | None = None
    """Measured collectives and their alpha-beta fits (schema version 2), or None."""

    def lookup(self, device: str, signature: str) -> OpTiming | None:
        return self.entries.get((device, signature))

    def __len__(self) -> int:
        return len(self.entries)

    def merged(self, other: OpProfile) -> OpProfile:
        """A profile holding both; `other` wins where both measured the same op."""
        return OpProfile(entries={**self.entries, **other.entries}, meta={**self.meta, **other.meta},
                         collectives=other.collectives if other.collectives is not None else self.collectives)

    def to_dict(self) -> dict[str, Any]:
        rows = [{"device": d, "signature": s, "forward_s": t.forward_s, "backward_s": t.backward_s,
                 "samples": t.samples} for (d, s), t in sorted(self.entries.items())]
        out: dict[str, Any] = {"schema_version": PROFILE_SCHEMA_VERSION, "meta": dict(sorted(self.meta.items())),
                               "entries": rows}
        if self.collectives is not None:
            out["schema_version"] = PROFILE_SCHEMA_VERSION_COLLECTIVES
            out["collectives"] = self.collectives.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpProfile:
        if not isinstance(d, Mapping):
            raise ValueError("profile JSON must be an object")
        version = d.get("schema_version")
        if version not in (PROFILE_SCHEMA_VERSION, PROFILE_SCHEMA_VERSION_COLLECTIVES):
            raise ValueError(f"profile schema_version {version!r} is not supported (expected "
                             f"{PROFILE_SCHEMA_VERSION} or {PROFILE_SCHEMA_VERSION_COLLECTIVES})")
        keys = _TOP_KEYS_V2 if version == PROFILE_SCHEMA_VERSION_COLLECTIVES else _TOP_KEYS
        unknown = sorted(set(d) - keys)
        if unknown:
            raise ValueError(f"unknown key(s) in profile: {', '.join(unknown)}; valid: {', '.join(sorted(keys))}")
        entries: dict[tuple[str, str], OpTiming] = {}
        for i, row in enumerate(d.get("entries", [])):
            bad = sorted(set(row) - _ENTRY_KEYS)
            if bad:
                raise ValueError(f"unknown key(s) in profile entries[{i}]: {', '.join(bad)}; "
                                 f"valid: {', '.join(sorted(_ENTRY_KEYS))}")
            try:
                key = (str(row["device"]), str(row["signature"]))
                entries[key] = OpTiming(float(row["forward_s"]), float(row["backward_s"]),
                                        int(row.get("samples", 1)))
            except KeyError as e:
                raise ValueError(f"profile entries[{i}] lacks key {e.args[0]!r}") from None
        meta = {str(k): str(v) for k, v in dict(d.get("meta", {})).items()}
        collectives = CollectiveProfile.from_dict(d["collectives"]) if "collectives" in d else None
        return cls(entries=entries, meta=meta, collectives=collectives)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> OpProfile:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"profile file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile file {str(path)!r} is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def from_timings(cls, rows: Iterable[tuple[str, str, OpTiming]], meta: Mapping[str, str] | None = None
                     ) -> OpProfile:
        return cls(entries={(dev, sig): t for dev, sig, t in rows}, meta=dict(meta or {}))


def _spec_text(shape: tuple[int, ...], dtype: str) -> str:
    return f"({','.join(str(d) for d in shape)}):{dtype}"


def segment_signature(structural_hash: str, microbatch_size: int, dtype: str) -> str:
    """The profile key of a whole layer's glue: what running the layer's module costs beyond its ops' own
    profiled times (module calls, Python between the ops, autograd bookkeeping), per micro-batch size."""
    return f"segment|{structural_hash}|mbs={microbatch_size}|{dtype}"


def op_signature(node: Node, *, flops_scale: float = 1.0, bytes_scale: float = 1.0,
                 param_scale: float = 1.0) -> str:
    """The profile key of `node` priced at the given scales (see module docstring)."""
    ins = ",".join(_spec_text(s.shape, s.dtype) for s in node.input_specs)
    params = ",".join(_spec_text(s.shape, s.dtype) for s in node.param_specs)
    return f"{node.target}|in={ins}|p={params}|s={flops_scale:.6g},{bytes_scale:.6g},{param_scale:.6g}"
