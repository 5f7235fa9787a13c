"""Regenerate the golden plans in plans/ from plans/golden.yaml (run from anywhere):

    python scripts/regen_golden_plans.py            # rewrite every plans/<name>.json
    python scripts/regen_golden_plans.py NAME ...   # only these
    python scripts/regen_golden_plans.py --check    # compare, write nothing; exit 1 and print the diff if stale

Each plan is made by `stratagem plan` itself (the CLI in-process), so a golden plan is exactly what a user gets.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="plans to regenerate (default: all in plans/golden.yaml)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a plan is stale")
    args = parser.parse_args(argv)
    entries = load_manifest()
    unknown = sorted(set(args.names) - {e.name for e in entries})
    if unknown:
        parser.error(f"unknown plan(s) {unknown}; known: {[e.name for e in entries]}")
    chosen = [e for e in entries if not args.names or e.name in args.names]
    stale = 0
    with tempfile.TemporaryDirectory() as tmp:
        for entry in chosen:
            fresh = make_plan_json(entry, Path(tmp))
            report = stale_report(entry, fresh)
            if args.check:
                if report:
                    stale += 1
                    print(report)
                continue
            if report or not entry.path.is_file():
                entry.path.write_text(fresh)
            print(f"{entry.path.relative_to(ROOT)}: {'updated' if report else 'unchanged'}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
