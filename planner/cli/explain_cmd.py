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

from planner.errors import UserError
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


def run(args: argparse.Namespace) -> int:
    from planner.reports.explain import explain_plan, render_explanation
    from planner.reports.plot import write_pictures
    from planner.reports.timeline import build_timeline

    if args.alternatives < 0:
        raise UserError(f"--alternatives must be >= 0, got {args.alternatives}")
    timeline_path = check_output("--timeline", args.timeline, [args.plan]) if args.timeline else None
    plot_path = check_output("--plot", args.plot, [args.plan]) if args.plot else None
    if timeline_path is not None and plot_path is not None and timeline_path.resolve() == plot_path.resolve():
        raise UserError(f"--timeline and --plot name the same file {args.plot}")
    plan = Plan.load(args.plan)
    timeline = build_timeline(plan) if (timeline_path or plot_path) else None
    explanation = explain_plan(plan, timeline=timeline)
    write_pictures(plan, timeline_path=timeline_path, plot_path=plot_path)
    if args.json:
        print(json.dumps(explanation.to_dict(), sort_keys=True, indent=2))
    else:
        print(render_explanation(explanation, plan, max_alternatives=args.alternatives), end="")
    return 0
