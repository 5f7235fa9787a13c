"""The golden plans: plans/golden.yaml's entries, each planned by `stratagem plan` itself (the CLI in-process), and
the check that a committed plan is still what a user gets. Used by tests/test_golden_plans.py and
scripts/regen_golden_plans.py.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
"""The repository root."""
PLANS_DIR = ROOT / "plans"
MANIFEST = PLANS_DIR / "golden.yaml"

_KEYS = {"name", "model", "cluster", "batch", "seq", "set", "fix"}
_REQUIRED = {"name", "model", "cluster", "batch"}


@dataclass(frozen=True, slots=True)
class GoldenEntry:
    name: str
    model: str
    cluster: str
    batch: int
    seq: int | None = None
    sets: tuple[str, ...] = ()
    fixes: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return PLANS_DIR / f"{self.name}.json"

    def plan_argv(self, output: Path) -> list[str]:
        """`stratagem plan` arguments; a cluster YAML path is taken relative to the repository root."""
        cluster = str(ROOT / self.cluster) if self.cluster.endswith((".yaml", ".yml")) else self.cluster
        argv = ["plan", self.model, "--cluster", cluster, "--batch", str(self.batch)]
        if self.seq is not None:
            argv += ["--seq", str(self.seq)]
        for s in self.sets:
            argv += ["--set", s]
        for f in self.fixes:
            argv += ["--fix", f]
        return argv + ["-o", str(output)]


def load_manifest(path: Path = MANIFEST) -> tuple[GoldenEntry, ...]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, Mapping) or set(data) != {"plans"} or not isinstance(data["plans"], list):
        raise ValueError(f"{path}: expected a mapping with one key 'plans' holding a list")
    entries = tuple(_entry(e, path) for e in data["plans"])
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate plan names {sorted({n for n in names if names.count(n) > 1})}")
    return entries


def _entry(e: Any, path: Path) -> GoldenEntry:
    if not isinstance(e, Mapping):
        raise ValueError(f"{path}: each plan must be a mapping, got {e!r}")
    unknown, missing = sorted(set(e) - _KEYS), sorted(_REQUIRED - set(e))
    if unknown or missing:
        raise ValueError(f"{path}: plan {e.get('name')!r}: unknown keys {unknown}, missing {missing}; "
                         f"valid: {sorted(_KEYS)}")
    return GoldenEntry(name=str(e["name"]), model=str(e["model"]), cluster=str(e["cluster"]), batch=int(e["batch"]),
                       seq=int(e["seq"]) if e.get("seq") is not None else None,
                       sets=tuple(str(s) for s in e.get("set", ())), fixes=tuple(str(f) for f in e.get("fix", ())))


def make_plan_json(entry: GoldenEntry, folder: Path) -> str:
    """Plan one entry with the `stratagem plan` CLI; the plan file's text."""
    from planner.cli.main import main

    out = folder / f"{entry.name}.json"
    with contextlib.redirect_stdout(io.StringIO()):  # the plan's report; only the file matters here
        code = main(entry.plan_argv(out))
    if code != 0:
        raise RuntimeError(f"stratagem {' '.join(entry.plan_argv(out))} exited {code}")
    return out.read_text()


def stale_report(entry: GoldenEntry, fresh_json: str) -> str | None:
    """None when the committed plan equals the fresh one except search.time_s; else `stratagem diff`'s text."""
    from planner.plan import Plan
    from planner.reports.diff import diff_plans, render_text

    if not entry.path.is_file():
        return f"{entry.path} is missing"
    old, new = Plan.from_json(entry.path.read_text()), Plan.from_json(fresh_json)
    diff = diff_plans(old, new, old_label=str(entry.path.relative_to(ROOT)), new_label=f"re-planned {entry.name}")
    return None if diff.is_empty else render_text(diff)
