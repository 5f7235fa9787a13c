"""`stratagem replan PLAN.json --cluster NEW_SPEC`: re-plan after the cluster changed (a slow or failed device...).

Rebuilds the plan's model (its name and --set values), prices the old strategy on the new cluster, re-solves its
stage partition, and searches the neighbourhood of the old plan (same tensor/context/expert parallelism and
schedule family; `--scope full` searches everything; `--exclude-slow` also tries leaving slowed devices out).
Among the plans found, the one closest to the old plan that is at most `--stickiness` percent slower than the
fastest is chosen; the command prints what changed in the cluster, the old plan's, the fastest and the chosen step
times, and the plan diff. `-o FILE` writes the new plan; `--json` prints {"plan", "changes", "kept_step_time_s",
"fastest_step_time_s", "chosen", "diff"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from planner.cli.common import (
    add_cluster_argument,
    add_time_limit_argument,
    add_trace_cache_arguments,
    check_output_path,
    input_paths,
    parse_cluster,
    percent,
    plan_settings,
    positive_int,
    time_limit_note,
    time_limit_s,
    trace_cache,
    write_text,
)
from planner.cli.progress import live, search_callback
from planner.errors import UserError
from planner.plan import Plan
from planner.trace_cache import TraceCache
from planner.tracing import trace_model

DEFAULT_STICKINESS_PCT = 2.0


def register(subparsers: argparse._SubParsersAction) -> None:
    from planner.scenarios.replan import ReplanScope

    p = subparsers.add_parser("replan", help="re-plan an existing plan for a changed cluster (stragglers, failures)",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("plan", metavar="PLAN.json", help="the plan made for the old cluster")
    add_cluster_argument(p)
    p.add_argument("--stickiness", "--max-change", dest="stickiness", type=percent, default=DEFAULT_STICKINESS_PCT,
                   metavar="PCT", help="keep closer to the old plan when at most PCT%% slower than the fastest "
                                       "(default %(default)s; 0: always the fastest)")
    p.add_argument("--scope", choices=[s.value for s in ReplanScope], default=ReplanScope.NEIGHBOURHOOD.value,
                   help="neighbourhood (default): keep tp/cp/ep/sp and the schedule family; full: search everything")
    p.add_argument("--exclude-slow", action="store_true",
                   help="also plan without the devices running below nominal speed (leave them out of the job)")
    p.add_argument("--top", type=positive_int, default=1, metavar="K",
                   help="consider the search's K best strategies (more choice for --stickiness; default 1)")
    add_time_limit_argument(p)
    add_trace_cache_arguments(p)
    p.add_argument("--format", choices=("text", "md"), default="text", help="diff rendering (default text)")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write the new plan JSON to FILE")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    p.set_defaults(func=run)


def _model_chain(plan: Plan, cache: TraceCache | None, progress: Any) -> Any:
    """The plan's model rebuilt from its name and settings (`plan_settings`), traced as `stratagem plan` traces
    it, in the plan's dtype."""
    sets, seq = plan_settings(plan)
    return trace_model(plan.model.name, sets, seq=seq, dtype=plan.training.dtype, cache=cache,
                       progress=progress).chain


def run(args: argparse.Namespace) -> int:
    from planner.reports.diff import diff_plans, diff_to_dict, render_markdown, render_text
    from planner.scenarios.replan import cluster_changes, replan

    output = check_output_path(args.output, input_paths(args.plan, args.cluster)) if args.output else None
    old = Plan.load(args.plan)
    cluster = parse_cluster(args.cluster)
    from costmodel.hardware.cluster import Cluster

    try:
        old_cluster = Cluster.from_dict(old.cluster)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{args.plan}: its cluster does not load: {e}") from None
    limit = time_limit_s(args)
    with live(enabled=not args.json) as display:
        progress = search_callback(display)
        chain = _model_chain(old, trace_cache(args), progress)
        result = replan(old, chain, cluster, stickiness=args.stickiness / 100.0, scope=args.scope, top_k=args.top,
                        time_limit_s=limit, exclude_slowed=args.exclude_slow, progress=progress)
    changes = cluster_changes(old_cluster, cluster)
    if note := time_limit_note(result.search.cut_short, result.search.optimality_gap, limit):
        print(note, file=sys.stderr)
    if output is not None:
        write_text(output, result.plan.to_json())
    diff = diff_plans(old, result.plan, old_label=args.plan, new_label=args.output or "replanned")
    if args.json:
        print(json.dumps({
            "plan": result.plan.to_dict(), "changes": changes,
            "kept_step_time_s": result.kept.step_time_s if result.kept else None,
            "fastest_step_time_s": result.fastest.step_time_s, "chosen": result.chosen.kind.value,
            "diff": diff_to_dict(diff)}, sort_keys=True, indent=2))
        return 0
    print(format_replan(result, old, changes, cluster.num_available))
    print(render_markdown(diff) if args.format == "md" else render_text(diff) or "diff: the plan is unchanged\n",
          end="")
    return 0


def format_replan(result: Any, old: Plan, changes: list[str], available: int) -> str:
    new = result.plan
    lines = [f"replan of {old.model.name} for {new.cluster['name']} (was planned for {old.cluster['name']}, "
             f"{old.predicted.step_time_s:.4g} s per step there)"]
    lines += ["cluster changes:", *(f"  {c}" for c in changes)] if changes else ["cluster changes: none"]
    if result.kept is not None:
        lines.append(f"old plan on the new cluster: {result.kept.step_time_s:.4g} s per step")
    else:
        lines.append(f"old plan on the new cluster: cannot run (it needs {old.strategy.num_devices} devices, "
                     f"{available} are available; or it no longer fits in memory)")
    lines.append(f"fastest found: {result.fastest.step_time_s:.4g} s ({result.fastest.label})")
    why = ("the fastest" if result.chosen is result.fastest else
           f"within {100 * result.stickiness:g}% of the fastest and closer to the old plan")
    lines.append(f"chosen: {result.chosen.step_time_s:.4g} s ({result.chosen.label}) -- {why}")
    warm = "reused" if result.warm_start else "computed"
    lines.append(f"search: {result.scope.value}, {new.search.candidates} candidates in {result.time_s:.2f} s "
                 f"(layer prices {warm})")
    return "\n".join(lines)
