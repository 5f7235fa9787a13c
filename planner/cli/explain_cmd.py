"""`stratagem explain PLAN.json [--json] [--timeline FILE.json] [--plot FILE.png]`: why this plan.

Reads only the plan file (never writes it): the breakdown of the predicted step, the bottleneck stage, memory
per stage against capacity, and the alternatives that lost. `--timeline` writes the simulated step as a
Chrome/Perfetto trace, `--plot` a Gantt chart of the schedule and memory per stage (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

from planner.errors import PlanLoadError, UserError
from planner.plan import Plan


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("explain", help="why this plan: breakdown, bottleneck, memory, alternatives",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("plan", metavar="PLAN.json", help="a plan written by `stratagem plan -o` or `estimate -o`")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.add_argument("--timeline", metavar="FILE.json", default=None,
                   help="write the simulated step as Chrome/Perfetto trace JSON (open in ui.perfetto.dev)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw the pipeline schedule and memory per stage (matplotlib)")
    p.add_argument("--alternatives", type=int, default=5, metavar="N",
                   help="how many losing alternatives to print (default 5; --json prints all)")
    p.set_defaults(func=run)


def load_plan(path: str) -> Plan:
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
        return Plan.from_json(text)
    except PlanLoadError as e:
        raise PlanLoadError(f"{path}: {e}") from None


def check_output(flag: str, path: str, inputs: Sequence[str]) -> Path:
    """An output path that is not an input, not a directory, and whose folder exists."""
    out = Path(path)
    for src in inputs:
        if out.exists() and Path(src).exists() and os.path.samefile(out, src):
            raise UserError(f"{flag} {path} is an input file of this command; refusing to overwrite it")
    if out.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    if not (out.parent if str(out.parent) else Path(".")).is_dir():
        raise UserError(f"{flag} {path}: folder {out.parent} does not exist")
    return out


def write_pictures(plan: Plan, *, timeline_path: Path | None, plot_path: Path | None) -> None:
    """The `--timeline` and `--plot` outputs shared by `explain` (and usable by `plan`)."""
    if timeline_path is not None:
        from planner.reports.timeline import write_timeline

        write_timeline(plan, timeline_path)
    if plot_path is not None:
        from planner.reports.plot import plot_plan

        plot_plan(plan, plot_path)


def run(args: argparse.Namespace) -> int:
    from planner.reports.explain import explain_plan, render_explanation
    from planner.reports.timeline import build_timeline

    if args.alternatives < 0:
        raise UserError(f"--alternatives must be >= 0, got {args.alternatives}")
    timeline_path = check_output("--timeline", args.timeline, [args.plan]) if args.timeline else None
    plot_path = check_output("--plot", args.plot, [args.plan]) if args.plot else None
    if timeline_path is not None and plot_path is not None and timeline_path.resolve() == plot_path.resolve():
        raise UserError(f"--timeline and --plot name the same file {args.plot}")
    plan = load_plan(args.plan)
    timeline = build_timeline(plan) if (timeline_path or plot_path) else None
    explanation = explain_plan(plan, timeline=timeline)
    write_pictures(plan, timeline_path=timeline_path, plot_path=plot_path)
    if args.json:
        print(json.dumps(explanation.to_dict(), sort_keys=True, indent=2))
    else:
        print(render_explanation(explanation, plan, max_alternatives=args.alternatives), end="")
    return 0
