"""`stratagem report PLAN.json [--compare OLD.json] -o plan.html`: the plan as one self-contained HTML page.

Summary, device mesh, stage table, memory per stage against capacity, step-time breakdown, simulated pipeline
timeline and runner-ups; `--compare` adds what changed from OLD. No script and no network at view time. Without -o
the page goes to stdout; -o never overwrites an existing file unless --force is given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.cli.common import write_text
from planner.cli.export_cmd import output_path
from planner.errors import UserError
from planner.plan import Plan


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="a self-contained HTML report of a plan (optionally against another)",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--compare", default=None, metavar="OLD.json", help="show what changed from this plan")
    p.add_argument("-o", "--output", default=None, metavar="FILE.html", help="write the page to FILE.html")
    p.add_argument("--force", action="store_true", help="overwrite FILE.html if it exists")
    p.add_argument("--title", default=None, help="page title (default: the plan's model and cluster)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.reports.html import render_html

    inputs = tuple(Path(p) for p in (args.plan, args.compare) if p)
    out = output_path(args.output, inputs, args.force) if args.output else None
    if out is not None and out.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"-o {args.output}: give the page an .html name")
    plan = Plan.load(args.plan)
    old = Plan.load(args.compare) if args.compare else None
    page = render_html(plan, compare=old, title=args.title, plan_label=Path(args.plan).name,
                       compare_label=Path(args.compare).name if args.compare else "old")
    if out is None:
        print(page, end="")
    else:
        write_text(out, page)
        print(f"wrote {out} ({len(page.encode()) / 1024:.0f} KiB)")
    return 0
