"""What changed between two plans: strategy, stages, sharding, predictions, model, cluster and training.

`diff_plans(old, new)` compares every value of the two plans' JSON except `search.time_s` (the one value that
differs between two runs with the same inputs), so an empty diff means the plans are the same. The values people
read first are named rows, in this order: model and cluster fingerprints, training, strategy, stages, sharding,
predictions (each numeric one with its % change), search; every other changed JSON value is a "details" row
with its path.

A regression, for `--fail-on-regression PCT`, is a predicted step time or a peak memory (the largest over the
stages) that grows by more than PCT percent, or a plan that fit and no longer does.

Three renderings: plain text (nothing at all for identical plans, like `diff`), GitHub-flavoured markdown (a
table for a pull-request comment or a CI job summary) and JSON.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan
from planner.reports.timeline import segment_range

GIB = 1 << 30


class DiffFormat(enum.StrEnum):
    TEXT = "text"
    MD = "md"
    JSON = "json"


_QUANTITY_SECTIONS = frozenset({"predicted", "details", ""})
"""Sections whose numbers get a % change ("" for the internal step-time/memory comparisons)."""


class Unit(enum.StrEnum):
    """How a value is printed."""

    NONE = ""
    SECONDS = "s"
    BYTES = "bytes"
    RATIO = "ratio"      # printed as a percentage (MFU)
    RATE = "rate"        # tokens/s, samples/s
    TFLOPS = "TFLOP/s"


@dataclass(frozen=True, slots=True)
class Change:
    section: str
    """model, cluster, training, strategy, stages, sharding, predicted, search or details."""
    field: str
    old: Any
    """A JSON value; None when the field is absent from the old plan (e.g. a stage that did not exist)."""
    new: Any
    unit: Unit = Unit.NONE

    @property
    def pct(self) -> float | None:
        """Relative change in percent of a predicted quantity (None for settings such as degrees, which are
        choices rather than quantities, for non-numbers and for a zero old value)."""
        if self.section not in _QUANTITY_SECTIONS:
            return None
        if _is_number(self.old) and _is_number(self.new) and self.old != 0:
            return (self.new - self.old) / abs(self.old) * 100.0
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"section": self.section, "field": self.field, "old": self.old, "new": self.new,
                "pct": self.pct}


@dataclass(frozen=True, slots=True)
class Regression:
    metric: str
    """"step_time_s", "peak_memory_bytes" or "fits"."""
    old: Any
    new: Any
    pct: float | None
    threshold_pct: float

    def describe(self) -> str:
        if self.metric == "fits":
            return "the new plan no longer fits in device memory"
        what = "predicted step time" if self.metric == "step_time_s" else "peak memory per device"
        return f"{what} {_signed_pct(self.pct)} exceeds the {self.threshold_pct:g}% threshold"

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "old": self.old, "new": self.new, "pct": self.pct,
                "threshold_pct": self.threshold_pct}


@dataclass(frozen=True, slots=True)
class PlanDiff:
    old_label: str
    new_label: str
    changes: tuple[Change, ...]
    old_step_time_s: float
    new_step_time_s: float
    old_peak_memory_bytes: int
    new_peak_memory_bytes: int
    old_fits: bool
    new_fits: bool

    @property
    def is_empty(self) -> bool:
        return not self.changes

    @property
    def named(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.section != "details")

    @property
    def details(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.section == "details")

    def regressions(self, threshold_pct: float) -> tuple[Regression, ...]:
        """Step time or peak memory grown by more than `threshold_pct` percent, or a plan that stopped fitting."""
        if threshold_pct < 0:
            raise ValueError(f"regression threshold must be >= 0 percent, got {threshold_pct}")
        found: list[Regression] = []
        for metric, old, new in (("step_time_s", self.old_step_time_s, self.new_step_time_s),
                                 ("peak_memory_bytes", self.old_peak_memory_bytes, self.new_peak_memory_bytes)):
            pct = Change("", metric, old, new).pct
            if new > old and (pct is None or pct > threshold_pct):
                found.append(Regression(metric, old, new, pct, threshold_pct))
        if self.old_fits and not self.new_fits:
            found.append(Regression("fits", True, False, None, threshold_pct))
        return tuple(found)


def cluster_fingerprint(cluster: Mapping[str, Any]) -> str:
    """Short hex digest of the normalized cluster spec (canonical JSON), to tell two clusters apart at a glance."""
    text = json.dumps(cluster, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def diff_plans(old: Plan, new: Plan, *, old_label: str = "old", new_label: str = "new") -> PlanDiff:
    named = list(_named_changes(old, new))
    old_d, new_d = old.to_dict(), new.to_dict()
    for d in (old_d, new_d):
        d["search"].pop("time_s", None)
    details = [Change("details", path, a, b) for path, a, b in _leaf_changes(old_d, new_d, "")
               if path not in _NAMED_PATHS and not _covered(path)]
    return PlanDiff(
        old_label=old_label, new_label=new_label, changes=tuple(named + details),
        old_step_time_s=old.predicted.step_time_s, new_step_time_s=new.predicted.step_time_s,
        old_peak_memory_bytes=max(old.predicted.peak_memory_bytes, default=0),
        new_peak_memory_bytes=max(new.predicted.peak_memory_bytes, default=0),
        old_fits=old.predicted.fits, new_fits=new.predicted.fits)


# JSON paths shown as named rows; "details" lists every other changed leaf.
_NAMED_PATHS: frozenset[str] = frozenset(
    [f"model.{k}" for k in ("name", "fingerprint", "params")]
    + [f"training.{k}" for k in ("global_batch", "seq_len", "dtype", "optimizer")]
    + [f"strategy.{k}" for k in ("dp", "tp", "pp", "cp", "ep", "microbatch_size", "num_microbatches", "schedule",
                                 "virtual_stages", "zero_stage", "sequence_parallel", "recompute")]
    + [f"predicted.{k}" for k in ("step_time_s", "tokens_per_s", "samples_per_s", "tflops_per_device",
                                  "hardware_tflops_per_device", "mfu", "hfu", "fits")]
    + [f"predicted.breakdown.{k}" for k in ("compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s",
                                            "bubble_s", "optimizer_s", "framework_s", "offload_s")]
    + ["strategy.runtime.offload"]
    + [f"search.{k}" for k in ("status", "candidates", "optimality_gap")])

_NAMED_PREFIXES: tuple[str, ...] = (
    "model.settings", "cluster", "strategy.mesh_order", "strategy.stages", "strategy.sharding",
    "predicted.peak_memory_bytes", "predicted.problems")


def _covered(path: str) -> bool:
    return any(path == p or path.startswith(p + ".") or path.startswith(p + "[") for p in _NAMED_PREFIXES)


def _named_changes(old: Plan, new: Plan) -> Iterator[Change]:
    o, n = old.to_dict(), new.to_dict()

    def rows(section: str, pairs: Sequence[tuple[str, Any, Any, Unit]]) -> Iterator[Change]:
        for name, a, b, unit in pairs:
            if a != b:
                yield Change(section, name, a, b, unit)

    yield from rows("model", [
        ("name", o["model"]["name"], n["model"]["name"], Unit.NONE),
        ("fingerprint", o["model"]["fingerprint"], n["model"]["fingerprint"], Unit.NONE),
        ("params", o["model"]["params"], n["model"]["params"], Unit.NONE),
        ("settings", _settings(old), _settings(new), Unit.NONE)])
    yield from rows("cluster", [
        ("name", o["cluster"].get("name"), n["cluster"].get("name"), Unit.NONE),
        ("devices", _devices(o["cluster"]), _devices(n["cluster"]), Unit.NONE),
        ("fingerprint", cluster_fingerprint(o["cluster"]), cluster_fingerprint(n["cluster"]), Unit.NONE)])
    yield from rows("training", [(k, o["training"][k], n["training"][k], Unit.NONE)
                                 for k in ("global_batch", "seq_len", "dtype", "optimizer")])
    strategy_keys = ("dp", "tp", "pp", "cp", "ep", "microbatch_size", "num_microbatches", "schedule",
                     "virtual_stages", "zero_stage", "sequence_parallel", "recompute")
    yield from rows("strategy", [(k, o["strategy"][k], n["strategy"][k], Unit.NONE) for k in strategy_keys]
                    + [("mesh_order", ",".join(o["strategy"]["mesh_order"]),
                        ",".join(n["strategy"]["mesh_order"]), Unit.NONE),
                       # absent from the JSON of a plan that offloads nothing
                       ("offload", o["strategy"]["runtime"].get("offload", "none"),
                        n["strategy"]["runtime"].get("offload", "none"), Unit.NONE)])
    yield from rows("stages", list(_stage_pairs(old, new)))
    yield from rows("sharding", list(_sharding_pairs(old, new)))
    yield from rows("predicted", list(_prediction_pairs(o["predicted"], n["predicted"])))
    yield from rows("search", [(k, o["search"][k], n["search"][k], Unit.NONE)
                               for k in ("status", "candidates", "optimality_gap")])


def _devices(cluster: Mapping[str, Any]) -> str:
    """"4x8 a100-80gb + 4x8 v100-32gb": nodes x devices per node and device type of each group."""
    parts = []
    for g in cluster.get("groups", []):
        device = g.get("device")
        name = device.get("name") if isinstance(device, Mapping) else device
        parts.append(f"{g.get('num_nodes')}x{g.get('devices_per_node')} {name}")
    return " + ".join(parts)


def _settings(plan: Plan) -> str:
    return ", ".join(f"{k}={v}" for k, v in plan.model.settings)


def _stage_pairs(old: Plan, new: Plan) -> Iterator[tuple[str, Any, Any, Unit]]:
    """Stage boundaries and recomputation, per (virtual) stage; from the strategy, or from the estimate's even
    split when the strategy leaves the stages to the estimator."""
    def table(plan: Plan) -> list[dict[str, Any]]:
        if plan.strategy.stages:
            return [{"segments": segment_range(s.start, s.stop), "recompute": s.recompute_label,
                     "device_group": s.device_group} for s in plan.strategy.stages]
        return [{"segments": segment_range(s.start, s.stop), "recompute": plan.strategy.recompute.value,
                 "device_group": None} for s in plan.predicted.stages]

    a, b = table(old), table(new)
    source = {True: "strategy", False: "even split"}
    yield "boundaries from", source[bool(old.strategy.stages)], source[bool(new.strategy.stages)], Unit.NONE
    if len(a) != len(b):
        yield "count", len(a), len(b), Unit.NONE
    for i in range(max(len(a), len(b))):
        for key in ("segments", "recompute", "device_group"):
            yield (f"stage {i} {key}", a[i][key] if i < len(a) else None, b[i][key] if i < len(b) else None,
                   Unit.NONE)


def _sharding_pairs(old: Plan, new: Plan) -> Iterator[tuple[str, Any, Any, Unit]]:
    a = {m.module: m.style.value for m in old.sharding}
    b = {m.module: m.style.value for m in new.sharding}
    for module in sorted(set(a) | set(b)):
        yield module, a.get(module), b.get(module), Unit.NONE


def _prediction_pairs(o: Mapping[str, Any], n: Mapping[str, Any]) -> Iterator[tuple[str, Any, Any, Unit]]:
    units = {"step_time_s": Unit.SECONDS, "tokens_per_s": Unit.RATE, "samples_per_s": Unit.RATE,
             "tflops_per_device": Unit.TFLOPS, "hardware_tflops_per_device": Unit.TFLOPS, "mfu": Unit.RATIO,
             "hfu": Unit.RATIO}
    for key, unit in units.items():
        yield key, o[key], n[key], unit
    yield ("peak_memory_bytes (max)", max(o["peak_memory_bytes"], default=0),
           max(n["peak_memory_bytes"], default=0), Unit.BYTES)
    a, b = o["peak_memory_bytes"], n["peak_memory_bytes"]
    for i in range(max(len(a), len(b))):
        yield (f"peak_memory_bytes stage {i}", a[i] if i < len(a) else None, b[i] if i < len(b) else None,
               Unit.BYTES)
    yield "fits", o["fits"], n["fits"], Unit.NONE
    yield "problems", "; ".join(o["problems"]), "; ".join(n["problems"]), Unit.NONE
    for key in ("compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s", "optimizer_s",
                "framework_s", "offload_s"):
        # framework_s is absent from plans written before it existed, offload_s from plans offloading nothing
        yield f"breakdown.{key}", o["breakdown"].get(key, 0.0), n["breakdown"].get(key, 0.0), Unit.SECONDS


def _leaf_changes(a: Any, b: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    """Changed leaves of two JSON values, in key order (sorted, so the order never depends on insertion)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                yield sub, a.get(key), b.get(key)
            else:
                yield from _leaf_changes(a[key], b[key], sub)
    elif isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            yield from _leaf_changes(a[i] if i < len(a) else None, b[i] if i < len(b) else None, f"{path}[{i}]")
    elif a != b or type(a) is not type(b) and not (_is_number(a) and _is_number(b)):
        yield path, a, b


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


# ---------------------------------------------------------------------------------------------- rendering


def format_value(value: Any, unit: Unit) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if _is_number(value):
        if unit is Unit.SECONDS:
            return f"{value * 1e3:.4g} ms" if abs(value) < 1 else f"{value:.4g} s"
        if unit is Unit.BYTES:
            return f"{value / GIB:.2f} GiB"
        if unit is Unit.RATIO:
            return f"{value * 100:.2f}%"
        if unit is Unit.RATE:
            return f"{value:,.1f}/s"
        if unit is Unit.TFLOPS:
            return f"{value:.1f} TFLOP/s"
        return f"{value:,}" if isinstance(value, int) else f"{value:.6g}"
    if value == "":
        return "—"
    if isinstance(value, list | dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _signed_pct(pct: float | None) -> str:
    return "" if pct is None else f"{pct:+.2f}%"


def render_text(diff: PlanDiff, *, threshold_pct: float | None = None) -> str:
    """One line per change, grouped by section; empty for identical plans."""
    if diff.is_empty:
        return ""
    lines = [f"--- {diff.old_label}", f"+++ {diff.new_label}"]
    section = None
    for c in diff.changes:
        if c.section != section:
            section = c.section
            lines.append(f"{section}:")
        pct = f" ({_signed_pct(c.pct)})" if c.pct is not None else ""
        lines.append(f"  {c.field}: {format_value(c.old, c.unit)} -> {format_value(c.new, c.unit)}{pct}")
    if threshold_pct is not None:
        for r in diff.regressions(threshold_pct):
            lines.append(f"REGRESSION: {r.describe()}")
    return "\n".join(lines) + "\n"


def _md_cell(text: str) -> str:
    """A table cell: pipes escaped, no line breaks (both would break the table)."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(changes: Sequence[Change]) -> list[str]:
    lines = ["| section | field | old | new | change |", "| --- | --- | --- | --- | ---: |"]
    for c in changes:
        cells = [c.section, c.field, format_value(c.old, c.unit), format_value(c.new, c.unit), _signed_pct(c.pct)]
        lines.append("| " + " | ".join(_md_cell(x) for x in cells) + " |")
    return lines


def render_markdown(diff: PlanDiff, *, threshold_pct: float | None = None) -> str:
    """GitHub-flavoured markdown: a summary line, a table of the named changes, the rest folded away."""
    title = f"### Stratagem plan diff: `{diff.old_label}` → `{diff.new_label}`"
    if diff.is_empty:
        return f"{title}\n\nNo changes.\n"
    step = Change("", "", diff.old_step_time_s, diff.new_step_time_s).pct
    memory = Change("", "", diff.old_peak_memory_bytes, diff.new_peak_memory_bytes).pct
    summary = (f"Step time {format_value(diff.old_step_time_s, Unit.SECONDS)} → "
               f"{format_value(diff.new_step_time_s, Unit.SECONDS)} ({_signed_pct(step) or 'n/a'}), "
               f"peak memory {format_value(diff.old_peak_memory_bytes, Unit.BYTES)} → "
               f"{format_value(diff.new_peak_memory_bytes, Unit.BYTES)} ({_signed_pct(memory) or 'n/a'}).")
    lines = [title, "", summary, ""]
    if threshold_pct is not None:
        regressions = diff.regressions(threshold_pct)
        for r in regressions:
            lines.append(f"> **Regression:** {r.describe()}.")
        if regressions:
            lines.append("")
    if diff.named:
        lines += _md_table(diff.named) + [""]
    if diff.details:
        lines += [f"<details><summary>{len(diff.details)} more changed value(s)</summary>", ""]
        lines += _md_table(diff.details) + ["", "</details>", ""]
    return "\n".join(lines)


def diff_to_dict(diff: PlanDiff, *, threshold_pct: float | None = None) -> dict[str, Any]:
    return {
        "old": diff.old_label, "new": diff.new_label, "identical": diff.is_empty,
        "changes": [c.to_dict() for c in diff.changes],
        "threshold_pct": threshold_pct,
        "regressions": [r.to_dict() for r in diff.regressions(threshold_pct)] if threshold_pct is not None else [],
    }


def render(diff: PlanDiff, fmt: DiffFormat, *, threshold_pct: float | None = None) -> str:
    if fmt is DiffFormat.TEXT:
        return render_text(diff, threshold_pct=threshold_pct)
    if fmt is DiffFormat.MD:
        return render_markdown(diff, threshold_pct=threshold_pct)
    return json.dumps(diff_to_dict(diff, threshold_pct=threshold_pct), sort_keys=True, indent=2) + "\n"
