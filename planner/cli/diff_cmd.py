"""`stratagem diff OLD.json NEW.json [--format text|md|json] [--fail-on-regression PCT]`: what changed.

Compares two plan files (never writes them): strategy, stage boundaries, recomputation, schedule, micro-batching,
sharding, predictions with their % change, and the model and cluster fingerprints. Identical plans (only
search.time_s may differ) print nothing in text form. Exit status: 0, or 1 when `--fail-on-regression PCT` is
given and the predicted step time or peak memory per device grew by more than PCT percent, or the new plan no
longer fits; 2 on a user error.
"""

from __future__ import annotations

import argparse

from planner.cli.common import percent
from planner.errors import UserError
from planner.plan import Plan

EXIT_REGRESSION = 1
"""Exit status when `--fail-on-regression` trips (DESIGN.md: non-zero; 2 stays reserved for user errors)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    from planner.reports.diff import DiffFormat

    p = subparsers.add_parser("diff", help="what changed between two plans (text, markdown or JSON)",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("old", metavar="OLD.json")
    p.add_argument("new", metavar="NEW.json")
    p.add_argument("--format", choices=[f.value for f in DiffFormat], default=DiffFormat.TEXT.value,
                   help="text (default), md (GitHub markdown table for a PR comment) or json")
    p.add_argument("--json", action="store_true", help="same as --format json")
    p.add_argument("--fail-on-regression", type=percent, default=None, metavar="PCT",
                   help=f"exit {EXIT_REGRESSION} if step time or peak memory grows by more than PCT percent")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.reports.diff import DiffFormat, diff_plans, render

    fmt = DiffFormat.JSON if args.json else DiffFormat(args.format)
    if args.json and args.format not in (DiffFormat.TEXT.value, DiffFormat.JSON.value):
        raise UserError(f"--json conflicts with --format {args.format}; give one of them")
    old, new = Plan.load(args.old), Plan.load(args.new)
    diff = diff_plans(old, new, old_label=args.old, new_label=args.new)
    print(render(diff, fmt, threshold_pct=args.fail_on_regression), end="")
    if args.fail_on_regression is not None and diff.regressions(args.fail_on_regression):
        return EXIT_REGRESSION
    return 0
